"""Two engines behind the real Envoy (`genserve serve --replicas 2`) for the replica and routing
tests: the fleet's start, its engines' ports, Envoy's view of their health and weights, a child's
pid."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator

from tests.e2e.conftest import start_server

EJECT_WITHIN_S = 2.0          # Envoy's active health check ejects a killed replica within this
RESTART_TIMEOUT_S = 240.0     # a restarted engine loads its weights and warms up (loaded cores)


def two_engine_fleet(*extra: str, env: dict[str, str] | None = None) -> Iterator:
    """Start two engines with small KV pools (both fit on two cores) behind Envoy, yield the
    server once Envoy sees both healthy, stop it after. `extra`: more `genserve serve` flags;
    `env`: more environment for the server."""
    gen = start_server("--queue-budget-s", "3600", "--drain-grace-s", "2", *extra, replicas=2,
                       kv_pool_gib=0.25, env=env)
    server = next(gen)
    try:
        for port in engine_ports(server):
            wait_envoy_health(server, port, healthy=True, timeout_s=RESTART_TIMEOUT_S)
        yield server
    finally:
        next(gen, None)                 # stops the server


def engine_ports(server) -> list[int]:
    """The engines' gRPC ports, replica 0 first."""
    return [int(target.rsplit(":", 1)[1]) for target in server.engine_targets]


def admin_url(server, timeout_s: float = 10.0) -> str:
    """Envoy's admin address, from the ready message (its last line may still be on its way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(server.output):
            found = re.search(r"admin (http://127\.0\.0\.1:\d+)", line)
            if found:
                return found.group(1)
        time.sleep(0.05)
    raise AssertionError("no Envoy admin address in genserve's output")


def envoy_health(server, port: int) -> str:
    """The engines cluster's health flags of the replica on `port` ("healthy", or why not)."""
    with urllib.request.urlopen(f"{admin_url(server)}/clusters", timeout=2) as reply:
        text = reply.read().decode()
    (flags,) = [line.rsplit("::", 1)[1] for line in text.splitlines()
                if line.startswith(f"engines::127.0.0.1:{port}::health_flags::")]
    return flags


def wait_envoy_health(server, port: int, healthy: bool, timeout_s: float) -> float:
    """Seconds until Envoy sees the replica on `port` as `healthy` (or not); fails after `timeout_s`."""
    start = time.monotonic()
    while (envoy_health(server, port) == "healthy") != healthy:
        assert time.monotonic() - start < timeout_s, \
            f"replica :{port} not {'healthy' if healthy else 'ejected'} within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - start


def active_requests(server, cluster: str) -> list[int]:
    """Requests Envoy has in flight to each host of `cluster` (its admin /clusters `rq_active`)."""
    with urllib.request.urlopen(f"{admin_url(server)}/clusters", timeout=2) as reply:
        text = reply.read().decode()
    counts = [int(line.rsplit("::", 1)[1]) for line in text.splitlines()
              if line.startswith(f"{cluster}::") and "::rq_active::" in line]
    assert counts, f"no host of cluster {cluster} in Envoy's /clusters"
    return counts


def envoy_stats(server, pattern: str) -> dict[str, int]:
    """Envoy's counters and gauges whose names match the regular expression `pattern` (its admin
    /stats?filter=), as {name: value}; kept in failure messages, so a flaky run shows what
    Envoy saw (health-check failures, ejections, membership changes)."""
    with urllib.request.urlopen(f"{admin_url(server)}/stats?filter={pattern}", timeout=2) as reply:
        text = reply.read().decode()
    stats = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().lstrip("-").isdigit():
            stats[name] = int(value)
    return stats


def host_weight(server, port: int) -> int:
    """The weight Envoy's engines cluster gives the replica on `port` (1 unless the balancer is
    weighted round robin and the replica's load reports set another)."""
    with urllib.request.urlopen(f"{admin_url(server)}/clusters", timeout=2) as reply:
        text = reply.read().decode()
    (weight,) = [int(line.rsplit("::", 1)[1]) for line in text.splitlines()
                 if line.startswith(f"engines::127.0.0.1:{port}::weight::")]
    return weight


def pid_of(server, name: str) -> int:
    """The pid of the supervisor's child `name` as last started (from genserve's output)."""
    pids = [int(m.group(1)) for line in list(server.output)
            if (m := re.search(rf"started {name} \(pid (\d+)\)", line))]
    assert pids, f"no start of {name} in genserve's output"
    return pids[-1]
