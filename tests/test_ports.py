"""A port already taken: the engine (`python -m service`) and `genserve serve` exit non-zero with a
message naming the port, and the engine's gRPC server binds exclusively (no SO_REUSEPORT sharing
with a second engine)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys

import pytest
from grpc_health.v1 import health_pb2

from genserve.common.ports import PortInUse, check_ports_free, port_is_free
from genserve.common.ports import free_port
from tests.ports import reserve_ports

EXIT_PORT_IN_USE = 3
RUN_TIMEOUT_S = 120


@contextlib.contextmanager
def occupied(host: str = "127.0.0.1"):
    """A plain listening socket on a free port of `host`; yields the port."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        sock.listen()
        yield sock.getsockname()[1]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env={**os.environ, "GENSERVE_LOG_FORMAT": "text"})


def test_port_probe_sees_a_listener_and_a_bound_socket():
    with occupied() as port:
        assert not port_is_free("127.0.0.1", port)
        assert not port_is_free("0.0.0.0", port)     # a wildcard bind collides with it too
    assert port_is_free("127.0.0.1", port)           # closed: free again
    with socket.socket() as sock:                     # bound, not listening
        sock.bind(("127.0.0.1", 0))
        assert not port_is_free("127.0.0.1", sock.getsockname()[1])
    assert port_is_free("127.0.0.1", 0)


def test_check_ports_free_names_the_taken_port_and_duplicates():
    with occupied() as port:
        with pytest.raises(PortInUse) as info:
            check_ports_free([("bridge", "127.0.0.1", reserve_ports(1)[0]), ("engine 0 gRPC", "127.0.0.1", port)])
    assert info.value.port == port and info.value.what == "engine 0 gRPC"
    assert f"port {port} on 127.0.0.1 is already in use (engine 0 gRPC)" in str(info.value)
    with pytest.raises(ValueError, match="port 8123 is given twice: to bridge and to Envoy admin"):
        check_ports_free([("bridge", "127.0.0.1", 8123), ("Envoy admin", "127.0.0.1", 8123)])


def test_engine_exits_when_its_grpc_port_is_taken():
    with occupied() as port:
        proc = run("-m", "service", "--port", str(port))
    assert proc.returncode == EXIT_PORT_IN_USE, proc.stderr[-2000:]
    assert f"port {port} on 127.0.0.1 is already in use (engine gRPC)" in proc.stderr


def test_engine_exits_when_its_metrics_port_is_taken():
    with occupied() as metrics_port:
        proc = run("-m", "service", "--port", str(reserve_ports(1)[0]), "--metrics-port", str(metrics_port))
    assert proc.returncode == EXIT_PORT_IN_USE, proc.stderr[-2000:]
    assert f"port {metrics_port} on 127.0.0.1 is already in use (engine metrics)" in proc.stderr


async def test_a_second_engine_server_cannot_share_the_port():
    """gRPC's default SO_REUSEPORT would let the second bind succeed; the engine's must fail."""
    from service.server import EngineServer
    from tests.service.harness import running_server

    async with running_server() as first:
        second = EngineServer(first.server.config, "127.0.0.1", first.server.port)
        stop = asyncio.Event()
        code = await asyncio.wait_for(second.run(stop), 30)
        assert code == EXIT_PORT_IN_USE
        assert await first.health() == health_pb2.HealthCheckResponse.SERVING   # the first still serves


@pytest.mark.parametrize("which", ["public", "grpc", "metrics", "bridge", "envoy-admin"])
def test_genserve_serve_checks_every_port_before_starting(which):
    """Nothing starts (exit within seconds, no engine loaded) and the message names the port."""
    with occupied() as taken:
        names = ("public", "grpc", "metrics", "bridge", "envoy-admin")
        ports = dict(zip(names, reserve_ports(1, 1, 1, 1, 1)))
        ports[which] = taken
        what = {"public": "Envoy listener", "grpc": "engine 0 gRPC", "metrics": "engine 0 metrics",
                "bridge": "bridge", "envoy-admin": "Envoy admin"}[which]
        proc = run("-m", "genserve.deploy.cli", "serve", "--port", str(ports["public"]),
                   "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
                   "--bridge-port", str(ports["bridge"]), "--envoy-admin-port", str(ports["envoy-admin"]))
    assert proc.returncode == EXIT_PORT_IN_USE, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert f"port {taken} on 127.0.0.1 is already in use ({what})" in proc.stderr
    assert "genserve ready" not in proc.stdout


def test_genserve_serve_checks_the_second_replica_port():
    while True:
        first = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", first + 1))
            except OSError:
                continue                     # first + 1 is taken by someone else: pick again
            sock.listen()
            public, metrics = reserve_ports(1, 2)
            proc = run("-m", "genserve.deploy.cli", "serve", "--port", str(public), "--grpc-port", str(first),
                       "--replicas", "2", "--metrics-port", str(metrics))
            break
    assert proc.returncode == EXIT_PORT_IN_USE, proc.stderr[-2000:]
    assert f"port {first + 1} on 127.0.0.1 is already in use (engine 1 gRPC)" in proc.stderr


def test_reserved_ports_lie_below_the_ephemeral_range_in_this_workers_share(monkeypatch):
    """`reserve_ports` takes ports where no outgoing connection or `bind(0)` lands (below the
    ephemeral range), and two pytest-xdist workers' shares do not overlap."""
    from tests import ports

    shares = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        share = ports.port_range()
        firsts = reserve_ports(1, 3, 2)
        assert all(share.start <= p and p + 2 < share.stop for p in firsts), (firsts, share)
        assert len({firsts[0], *range(firsts[1], firsts[1] + 3), *range(firsts[2], firsts[2] + 2)}) == 6
        shares.append(share)
    assert shares[0].stop <= shares[1].start < ports.ephemeral_start()
    assert shares[0].start == ports.LOWEST_PORT and shares[1].stop <= ports.ephemeral_start()
