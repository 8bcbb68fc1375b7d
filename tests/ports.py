"""Free loopback ports for tests that start servers.

Two ways a port a test picked can be gone by the time its server binds it (seconds later, after
the server has loaded a model), and what this module does about each:
- another pick in the same test: `reserve_ports` picks all of a test's ports while every one of
  them is held bound, so none is handed out twice;
- another process: ports are taken *below* the OS's ephemeral range (Linux's
  `net.ipv4.ip_local_port_range`, 32768–60999 by default). The kernel gives every outgoing
  connection's local port, and every `bind(port 0)`, from that range, so a port picked there can
  be taken meanwhile by any client connection or `free_port` pick of a server the other
  pytest-xdist worker runs. Below it, only explicit binds compete, and the range is split among
  the workers so that two workers never offer the same port.
"""

from __future__ import annotations

import os
import random
import socket

# Ports below this are left alone (well-known and registered services people run locally).
LOWEST_PORT = 10_000
# Where the ephemeral range starts when /proc does not say (Linux's default, IANA's is 49152).
DEFAULT_EPHEMERAL_START = 32_768
# Picks tried for one run of ports before giving up.
MAX_TRIES = 10_000


def ephemeral_start() -> int:
    """The first port of the OS's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range;
    elsewhere `DEFAULT_EPHEMERAL_START`)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def port_range() -> range:
    """The ports this process's tests take: this pytest-xdist worker's share (worker i of n: the
    i-th of n equal slices) of [`LOWEST_PORT`, the ephemeral range's start); the whole span
    outside xdist.

    Raises:
        RuntimeError: the span left to a worker is under 100 ports (an ephemeral range that
            starts unusually low).
    """
    stop = ephemeral_start()
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % count if worker[2:].isdigit() else 0
    width = (stop - LOWEST_PORT) // count
    if width < 100:
        raise RuntimeError(f"tests/ports.py: ports {LOWEST_PORT}..{stop} leave {width} per worker; "
                           "the ephemeral range starts too low for the tests' servers")
    return range(LOWEST_PORT + index * width, LOWEST_PORT + (index + 1) * width)


def reserve_ports(*counts: int) -> list[int]:
    """The first port of each of `len(counts)` runs of `counts[i]` consecutive ports, free on
    127.0.0.1 now and taken from `port_range()`, no two runs sharing a port: every port stays
    bound until all are chosen (separate picks could hand one out twice).

    Raises:
        RuntimeError: no free run of `counts[i]` ports found in `MAX_TRIES` random picks.
    """
    span = port_range()
    pick = random.Random(os.urandom(8))
    held: list[socket.socket] = []
    firsts: list[int] = []
    try:
        for n in counts:
            for _ in range(MAX_TRIES):
                first = pick.randrange(span.start, span.stop - n + 1)
                run: list[socket.socket] = []
                try:
                    for port in range(first, first + n):
                        run.append(socket.socket())
                        run[-1].bind(("127.0.0.1", port))
                except OSError:
                    for s in run:
                        s.close()
                    continue
                held += run
                firsts.append(first)
                break
            else:
                raise RuntimeError(f"reserve_ports: no {n} free consecutive ports in {span}")
        return firsts
    finally:
        for s in held:
            s.close()
