"""Free loopback ports for tests that start servers: picked while all of them are held bound,
so two picks in one test can never be the same port (picking one port at a time cannot promise
that: each pick releases its port before the next)."""

from __future__ import annotations

import socket


def reserve_ports(*counts: int) -> list[int]:
    """The first port of each of `len(counts)` runs of `counts[i]` consecutive ports free on
    127.0.0.1 now, no two runs sharing a port: every port stays bound until all are chosen, so
    the OS cannot hand one out twice (separate `free_port` calls can: each releases its port
    before the next pick)."""
    held: list[socket.socket] = []
    firsts: list[int] = []
    try:
        for n in counts:
            while True:
                run = [socket.socket()]
                try:
                    run[0].bind(("127.0.0.1", 0))
                    first = run[0].getsockname()[1]
                    if first + n - 1 > 65535:
                        raise OSError("past the last port")
                    for port in range(first + 1, first + n):
                        run.append(socket.socket())
                        run[-1].bind(("127.0.0.1", port))
                except OSError:
                    for s in run:
                        s.close()
                    continue
                held += run
                firsts.append(first)
                break
        return firsts
    finally:
        for s in held:
            s.close()
