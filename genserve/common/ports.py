"""Is a TCP port free to listen on? `check_ports_free` asks before a server starts anything.

gRPC servers (and Envoy's listeners) set SO_REUSEPORT by default, so a second server on a taken
port binds it silently and the kernel splits new connections between the two. genserve's engine
binds exclusively instead (`service.server`), and `genserve serve` checks every port it will open
with `check_ports_free` before it starts a child; `free_port` picks one. Imports nothing beyond
the standard library.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable


class PortInUse(OSError):
    """A port genserve must listen on is taken (by another process, or another genserve).

    Attributes:
        host: the address it would bind ("127.0.0.1", "0.0.0.0", "::1", ...).
        port: the TCP port.
        what: which listener wanted it ("engine gRPC", "bridge", ...).
    """

    def __init__(self, host: str, port: int, what: str = "") -> None:
        self.host, self.port, self.what = host, port, what
        for_what = f" ({what})" if what else ""
        super().__init__(errno.EADDRINUSE,
                         f"port {port} on {host} is already in use{for_what}: another process listens "
                         f"there (a genserve already running?); stop it or choose another port")

    def __str__(self) -> str:
        return self.strerror


def port_is_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind `host:port` now (TCP).

    The probe sets SO_REUSEADDR, as servers do, so a port whose old connections linger in
    TIME_WAIT counts as free, and never SO_REUSEPORT, so any socket bound or listening there
    counts as taken. Port 0 (any free port) is always free. Another process may still take a
    free port before the server binds it.
    """
    if port == 0:
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def check_ports_free(listeners: Iterable[tuple[str, str, int]]) -> None:
    """Check the ports a set of servers will listen on, before any of them starts.

    Args:
        listeners: (what, host, port) triples, e.g. ("bridge", "127.0.0.1", 8000); port 0 is
            skipped (the OS picks one).
    Raises:
        PortInUse: the first port that is taken.
        ValueError: two listeners name the same port (the message names both).
        OSError: a host that cannot be bound at all (an address this machine does not have).
    """
    seen: dict[int, str] = {}
    for what, host, port in listeners:
        if port == 0:
            continue
        if port in seen:
            raise ValueError(f"port {port} is given twice: to {seen[port]} and to {what}")
        seen[port] = what
        if not port_is_free(host, port):
            raise PortInUse(host, port, what)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
