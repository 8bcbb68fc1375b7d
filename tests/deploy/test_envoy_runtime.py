"""The Envoy configuration run for real on loopback, in front of stand-in upstreams: two fake
engines (grpcio servers with grpc.health.v1 and a scripted GenerateService) and a fake bridge
(an HTTP/1.1 server). It checks what the configuration promises: gRPC and REST split on one port,
a 429 or an UNAVAILABLE retried once on the other replica, Cancel swept across the replicas until
one knows the request, 429/503 passed through unchanged with
Retry-After, SSE not buffered, a NOT_SERVING replica out of rotation within 2 s, Envoy's own
503s carrying Retry-After, and the weighted fallback weighing replicas by their load reports.

The engines cluster runs ROUND_ROBIN here (a chart value) rather than the default LEAST_REQUEST:
with two replicas, round robin makes "the retry went to the other replica" deterministic, while
least-request's random two-choice pick re-selects the refusing replica on a retry with
a small probability (after host_selection_retry_max_attempts = 5 re-picks), which a test could only
check statistically.
"""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from genserve.deploy import envoy
from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from service.load_report import HEADER as LOAD_REPORT_HEADER, Load, report_text
from tests.deploy.helpers import tool
from tests.ports import reserve_ports

SERVICE = "genserve.v1.GenerateService"
START_TIMEOUT_S = 15.0
EJECT_WITHIN_S = 2.0
SSE_PAUSE_S = 0.8


# ---- stand-in upstreams -------------------------------------------------------------------------

@dataclass
class FakeEngine(pb_grpc.GenerateServiceServicer):
    """A GenerateService whose answer is set by `mode`: "ok" (a three-message stream naming this
    replica), "exhausted" (RESOURCE_EXHAUSTED + retry-after 7, before any message, as genserve's
    admission does) or "unavailable" (UNAVAILABLE + retry-after 2, as a draining engine does)."""

    name: str
    port: int = field(default_factory=lambda: reserve_ports(1)[0])
    mode: str = "ok"
    calls: int = 0
    running: set[str] = field(default_factory=set)   # request ids Cancel finds here
    cancels: int = 0
    load_report: str | None = None    # an `endpoint-load-metrics` value to end each stream with

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_GenerateServiceServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.set_serving(True)
        self.server.start()

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            self.health.set(name, status)

    def Generate(self, request, context):
        with self.lock:
            self.calls += 1
        if self.mode == "exhausted":
            context.set_trailing_metadata((("retry-after", "7"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queued work over budget")
        if self.mode == "unavailable":
            context.set_trailing_metadata((("retry-after", "2"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        if self.load_report is not None:      # sent in the trailers, as the engine sends it
            context.set_trailing_metadata(((LOAD_REPORT_HEADER, self.load_report),))
        yield pb.GenerateResponse(request_id=self.name, started=pb.Started(request_id=self.name))
        for position in range(2):
            yield pb.GenerateResponse(request_id=self.name, token=pb.Token(text="x", position=position))

    def Cancel(self, request, context):
        """As genserve's servicer: NOT_FOUND (trailers-only) unless the id runs here."""
        with self.lock:
            self.cancels += 1
        if request.request_id not in self.running:
            context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no running request {request.request_id!r}")
        return pb.CancelResponse(request_id=request.request_id)


class FakeBridge(http.server.ThreadingHTTPServer):
    """HTTP/1.1: /busy -> 429 Retry-After 9; /down -> 503 Retry-After 4; /sse -> two SSE events
    SSE_PAUSE_S apart; anything else -> 200. Counts requests by path."""

    daemon_threads = True

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        super().__init__(("127.0.0.1", 0), FakeBridgeHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class FakeBridgeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def reply(self, code: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(code)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        hits = self.server.hits
        hits[self.path] = hits.get(self.path, 0) + 1
        if self.path == "/busy":
            self.reply(429, b'{"error": {"code": "rate_limited"}}',
                       {"Retry-After": "9", "Content-Type": "application/json"})
        elif self.path == "/down":
            self.reply(503, b'{"error": {"code": "unavailable"}}',
                       {"Retry-After": "4", "Content-Type": "application/json"})
        elif self.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, event in enumerate((b"data: 1\n\n", b"data: 2\n\n")):
                if i:
                    time.sleep(SSE_PAUSE_S)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.reply(200, b"ok", {"Content-Type": "text/plain"})


# ---- Envoy ------------------------------------------------------------------------------------------

@dataclass
class Envoy:
    process: subprocess.Popen
    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counter(self, name: str) -> int:
        """The value of one of Envoy's counters (admin /stats), 0 before its first increment."""
        for line in self.admin(f"/stats?filter=^{name}$").splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=2) as r:
            return r.read().decode()

    def host_healthy(self, cluster: str, port: int) -> bool:
        flags = [line.rsplit("::", 1)[1] for line in self.admin("/clusters").splitlines()
                 if line.startswith(f"{cluster}::127.0.0.1:{port}::health_flags::")]
        assert len(flags) == 1
        return flags[0] == "healthy"

    def host_weight(self, cluster: str, port: int) -> int:
        """The weight Envoy balances the host on `port` of `cluster` by (admin /clusters)."""
        (weight,) = [int(line.rsplit("::", 1)[1]) for line in self.admin("/clusters").splitlines()
                     if line.startswith(f"{cluster}::127.0.0.1:{port}::weight::")]
        return weight

    def wait_health(self, cluster: str, port: int, healthy: bool, timeout_s: float) -> float:
        """Seconds until the host's health is `healthy`; fails the test after `timeout_s`."""
        start = time.monotonic()
        while self.host_healthy(cluster, port) != healthy:
            assert time.monotonic() - start < timeout_s, \
                f"{cluster} 127.0.0.1:{port} not {'healthy' if healthy else 'ejected'} in {timeout_s} s"
            time.sleep(0.05)
        return time.monotonic() - start


def start_envoy(tmp_path, bridge_port: int, engine_ports: list[int],
                engine_values: dict | None = None) -> Envoy:
    """Envoy with the chart's configuration for these loopback upstreams, once it is LIVE;
    `engine_values`: more chart values of `envoy.engines`."""
    envoy_binary = tool("envoy")
    tool("helm")
    port, admin_port = reserve_ports(1, 1)
    text = envoy.render_envoy_config(
        listen_host="127.0.0.1", listen_port=port, admin_port=admin_port,
        bridge=[("127.0.0.1", bridge_port)], engines=[("127.0.0.1", p) for p in engine_ports],
        extra_values={"envoy": {"accessLog": False,
                                "engines": {"lbPolicy": "ROUND_ROBIN", **(engine_values or {})}}})
    config = tmp_path / f"envoy-{port}.yaml"
    config.write_text(text)
    process = subprocess.Popen([str(envoy_binary), "-c", str(config), "--disable-hot-restart",
                                "--concurrency", "1", "--log-level", "error"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proxy = Envoy(process, port, admin_port)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, f"envoy exited: {process.stderr.read()}"
        try:
            if proxy.admin("/ready").strip() == "LIVE":
                return proxy
        except OSError:
            pass
        assert time.monotonic() < deadline, "envoy did not become ready"
        time.sleep(0.05)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tool("envoy")                   # skip before starting any server when the tools are missing
    tool("helm")
    engines = [FakeEngine("a"), FakeEngine("b")]
    bridge = FakeBridge()
    proxy = start_envoy(tmp_path_factory.mktemp("envoy"), bridge.server_address[1],
                        [e.port for e in engines])
    for engine in engines:
        proxy.wait_health("engines", engine.port, True, START_TIMEOUT_S)
    yield proxy, engines, bridge
    stop(proxy.process)
    for engine in engines:
        engine.server.stop(0)
    bridge.shutdown()


@pytest.fixture
def fleet(stack):
    """The running stack with both engines answering "ok", serving and healthy in Envoy."""
    proxy, engines, bridge = stack
    for engine in engines:
        engine.mode, engine.calls, engine.cancels, engine.running = "ok", 0, 0, set()
        engine.set_serving(True)
    for engine in engines:
        proxy.wait_health("engines", engine.port, True, 5.0)
    return proxy, engines, bridge


def generate(proxy: Envoy, n: int = 1) -> list[str]:
    """`n` Generate calls through Envoy's public port; the replica names that answered."""
    names = []
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        for _ in range(n):
            replies = list(stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=5))
            assert len(replies) == 3
            names.append(replies[0].request_id)
    return names


# ---- gRPC -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["exhausted", "unavailable"])
def test_refusal_is_retried_on_the_other_replica(fleet, mode):
    proxy, (a, b), _ = fleet
    a.mode = mode
    names = generate(proxy, 20)
    assert names == ["b"] * 20
    assert a.calls >= 1            # the balancer did pick a, and Envoy retried on b
    assert b.calls == 20


def test_429_passes_through_when_every_replica_is_full(fleet):
    proxy, engines, _ = fleet
    for engine in engines:
        engine.mode = "exhausted"
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=5))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "queued work over budget"
    assert ("retry-after", "7") in tuple(err.value.trailing_metadata())
    # One try and one retry, on different replicas.
    assert [e.calls for e in engines] == [1, 1]


def test_cancel_sweeps_the_replicas_until_one_knows_the_request(fleet):
    """Cancel reaches the replica running the request whichever replica the balancer picks
    first: the other's NOT_FOUND is retried on it."""
    proxy, (a, b), _ = fleet
    a.running, b.running = {"on-a"}, {"on-b"}
    retries_before = proxy.counter("cluster.engines.upstream_rq_retry")
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        for _ in range(10):
            assert stub.Cancel(pb.CancelRequest(request_id="on-a"), timeout=5).request_id == "on-a"
        # Every cancel reached a once; each one whose first try went to b (NOT_FOUND there) was
        # retried, on a: b's calls are exactly Envoy's retries, and round robin made some.
        assert a.cancels == 10
        assert b.cancels > 0
        assert proxy.counter("cluster.engines.upstream_rq_retry") - retries_before == b.cancels
        a.cancels = b.cancels = 0
        with pytest.raises(grpc.RpcError) as err:
            stub.Cancel(pb.CancelRequest(request_id="nowhere"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nowhere" in err.value.details()
    # One try and num_retries (7) retries, which asked both replicas.
    assert a.cancels + b.cancels == 8
    assert a.cancels >= 1 and b.cancels >= 1


def test_grpc_health_reaches_the_engines(fleet):
    proxy, _, bridge = fleet
    before = dict(bridge.hits)
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert bridge.hits == before


def test_not_serving_replica_leaves_rotation_within_2_s(fleet):
    """Health checks every 0.5 s, two failures: a draining (or killed) replica stops receiving
    requests within 2 s, and the workers route by the new health at once."""
    proxy, (a, b), _ = fleet
    start = time.monotonic()
    a.set_serving(False)
    proxy.wait_health("engines", a.port, False, EJECT_WITHIN_S)
    a.calls = b.calls = 0
    assert generate(proxy, 10) == ["b"] * 10
    assert time.monotonic() - start < EJECT_WITHIN_S
    assert a.calls == 0
    a.set_serving(True)
    proxy.wait_health("engines", a.port, True, EJECT_WITHIN_S)


def test_killed_replica_is_ejected_and_its_requests_retried(tmp_path, stack):
    """A replica whose process is gone: its requests are retried on the other (connect-failure),
    and health checking takes it out of rotation within 2 s."""
    _, _, bridge = stack
    a, b = FakeEngine("a"), FakeEngine("b")
    proxy = start_envoy(tmp_path, bridge.server_address[1], [a.port, b.port])
    try:
        for engine in (a, b):
            proxy.wait_health("engines", engine.port, True, START_TIMEOUT_S)
        start = time.monotonic()
        a.server.stop(0)
        assert generate(proxy, 10) == ["b"] * 10
        proxy.wait_health("engines", a.port, False, EJECT_WITHIN_S)
        assert time.monotonic() - start < EJECT_WITHIN_S
    finally:
        stop(proxy.process)
        a.server.stop(0)
        b.server.stop(0)


def test_weighted_round_robin_weighs_replicas_by_their_load_reports(tmp_path, stack):
    """envoy.engines.lbPolicy CLIENT_SIDE_WEIGHTED_ROUND_ROBIN: Envoy reads the engines' ORCA
    reports (service.load_report's text, in a gRPC stream's trailers), weighs each replica by
    rps / utilization once it has reported for the blackout period, and sends calls in that
    proportion. Replica a reports 4 requests/s at utilization 0.5 (its queue at half the 429
    budget): weight 8; replica b the same rps at 0.125: weight 32, four times a's calls."""
    _, _, bridge = stack
    a, b = FakeEngine("a"), FakeEngine("b")
    a.load_report = report_text(Load(running_rows=2, max_rows=32, queued_device_s=1.0, queue_budget_s=2.0,
                                     kv_blocks_free=900, kv_blocks_total=1000), rps=4.0)
    b.load_report = report_text(Load(running_rows=4, max_rows=32, queued_device_s=0.0, queue_budget_s=2.0,
                                     kv_blocks_free=1000, kv_blocks_total=1000), rps=4.0)
    proxy = start_envoy(tmp_path, bridge.server_address[1], [a.port, b.port], engine_values={
        "lbPolicy": "CLIENT_SIDE_WEIGHTED_ROUND_ROBIN",
        "weighted": {"blackoutPeriod": "1s", "weightUpdatePeriod": "0.1s"}})
    try:
        for engine in (a, b):
            proxy.wait_health("engines", engine.port, True, START_TIMEOUT_S)
        # No report yet: every replica at weight 1 (plain round robin).
        assert [proxy.host_weight("engines", e.port) for e in (a, b)] == [1, 1]
        deadline = time.monotonic() + 10
        while [proxy.host_weight("engines", e.port) for e in (a, b)] != [8, 32]:
            assert time.monotonic() < deadline, \
                [proxy.host_weight("engines", e.port) for e in (a, b)]
            generate(proxy, 2)                 # keep both replicas reporting
            time.sleep(0.05)
        a.calls = b.calls = 0
        names = generate(proxy, 40)
        assert (names.count("a"), names.count("b")) == (a.calls, b.calls)
        assert 7 <= a.calls <= 9, (a.calls, b.calls)          # 40 × 8 / 40, smooth schedule
    finally:
        stop(proxy.process)
        a.server.stop(0)
        b.server.stop(0)


# ---- REST and SSE -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path, code, retry_after", [("/busy", 429, "9"), ("/down", 503, "4")])
def test_rest_refusals_pass_through_unchanged(fleet, path, code, retry_after):
    proxy, engines, bridge = fleet
    hits = bridge.hits.get(path, 0)
    reply = httpx.get(proxy.url + path, timeout=5)
    assert reply.status_code == code
    assert reply.headers["retry-after"] == retry_after
    assert reply.headers["content-type"] == "application/json"
    assert reply.json()["error"]["code"] in ("rate_limited", "unavailable")
    assert bridge.hits[path] == hits + 1            # not retried
    assert [e.calls for e in engines] == [0, 0]     # REST never goes to the engines


def test_sse_is_not_buffered(fleet):
    proxy, _, _ = fleet
    start = time.monotonic()
    arrivals = []
    with httpx.stream("GET", proxy.url + "/sse", timeout=5) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/event-stream"
        for line in reply.iter_lines():
            if line.startswith("data: "):
                arrivals.append((line, time.monotonic() - start))
    assert [line for line, _ in arrivals] == ["data: 1", "data: 2"]
    first, second = arrivals[0][1], arrivals[1][1]
    assert first < SSE_PAUSE_S / 2                  # the first event did not wait for the second
    assert second - first >= SSE_PAUSE_S * 0.9


def test_envoys_own_503_has_retry_after(tmp_path):
    """With nothing listening upstream, Envoy answers itself: 503 plus Retry-After over REST,
    UNAVAILABLE with retry-after metadata over gRPC (what the bridge turns into a 503)."""
    bridge, engine_a, engine_b = reserve_ports(1, 1, 1)     # nothing listens on them
    proxy = start_envoy(tmp_path, bridge, [engine_a, engine_b])
    try:
        reply = httpx.get(proxy.url + "/v1/models", timeout=5)
        assert reply.status_code == 503
        assert reply.headers["retry-after"] == "1"
        with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ("retry-after", "1") in tuple(err.value.trailing_metadata())
    finally:
        stop(proxy.process)
