"""The REST+SSE and gRPC clients against a scripted GenerateService (a test double, no model).

The REST client goes through the real bridge app (uvicorn on a localhost port), so the SSE format
it parses is the bridge's own. The double streams exactly `max_tokens` tokens and answers RESOURCE_EXHAUSTED
(retry-after 1) to the API key "full".
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bridge.app import create_app
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from loadgen.clients import GrpcClient, RestClient, require_localhost, run_open_loop
from loadgen.workload import WorkItem
from tests.uvicorn_app import served

TOKEN_DELAY_S = 0.002


class ScriptedService(pb_grpc.GenerateServiceServicer):
    """Streams max_tokens tokens; 429 for key "full"; records requests and cancelled calls."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.keys: list[str] = []
        self.cancelled: list[str] = []

    async def Generate(self, request, context):
        meta = dict(context.invocation_metadata())
        key = meta.get("authorization", "").removeprefix("Bearer ")
        self.requests.append(request)
        self.keys.append(key)
        if key == "full":
            context.set_trailing_metadata((("retry-after", "1"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "2.0 device-seconds queued")
        rid = request.request_id or f"srv-{len(self.requests)}"
        n_prompt = len(request.prompt_token_ids.ids) or len(request.prompt.split())
        yield pb.GenerateResponse(request_id=rid, started=pb.Started(request_id=rid, prompt_tokens=n_prompt))
        try:
            for i in range(request.max_tokens):
                await asyncio.sleep(TOKEN_DELAY_S)
                yield pb.GenerateResponse(request_id=rid, token=pb.Token(text=f" t{i}", token_id=100 + i, position=i))
        except (asyncio.CancelledError, GeneratorExit):   # cancelled at an await, or at a yield
            self.cancelled.append(rid)
            raise
        yield pb.GenerateResponse(request_id=rid, finished=pb.Finished(
            reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=n_prompt, completion_tokens=request.max_tokens),
            timing=pb.Timing(queue_ms=3.0, ttft_ms=5.0, e2e_ms=9.0)))


@pytest.fixture
async def service():
    server = grpc.aio.server()
    svc = ScriptedService()
    pb_grpc.add_GenerateServiceServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield svc, f"127.0.0.1:{port}"
    await server.stop(None)


@pytest.fixture
async def rest(service):
    _, target = service
    async with served(create_app(target)) as url:
        client = RestClient(url, seed=5)
        yield client
        await client.aclose()


@pytest.fixture
async def grpc_client(service):
    _, target = service
    client = GrpcClient(target, seed=5)
    yield client
    await client.aclose()


def test_only_localhost_is_a_target():
    for ok in ("http://127.0.0.1:8000", "http://localhost:1/x", "127.0.0.1:50051", "http://[::1]:80", "localhost:9"):
        assert require_localhost(ok) == ok
    for bad in ("http://example.com", "10.0.0.1:50051", "http://8.8.8.8:80", ""):
        with pytest.raises(ValueError):
            require_localhost(bad)


@pytest.mark.parametrize("which", ["rest", "grpc"])
async def test_a_workload_gives_one_record_per_item(which, service, rest, grpc_client):
    svc, _ = service
    client = rest if which == "rest" else grpc_client
    items = [WorkItem(0, 0.0, "alice", 12, 5), WorkItem(1, 0.02, "bob", 7, 3, prompt=(11, 12, 13)),
             WorkItem(2, 0.04, "alice", 4, 2, prompt="a text prompt"),
             WorkItem(3, 0.05, "alice", 9, 400, disconnect_after=3), WorkItem(4, 0.05, "full", 9, 8)]
    done = []
    records = await run_open_loop(items, client, progress=done.append, drain_timeout_s=30)
    assert len(done) == 5
    r0, r1, r2, r3, r4 = records
    for r, it in zip(records[:3], items[:3]):
        assert r.status == 200 and r.finish_reason == "length" and r.completed, r
        assert r.output_tokens == it.output_tokens and r.error == ""
        assert 0 < r.ttft_s <= r.e2e_s and r.queue_s == pytest.approx(0.003)
        assert r.max_gap_s is not None and (r.tpot_s is None) == (it.output_tokens == 1)
    assert r3.disconnected and r3.output_tokens == 3 and r3.status == 200 and r3.finish_reason is None
    assert r4.status == 429 and r4.output_tokens == 0 and r4.ttft_s is None and "queued" in r4.error
    # What the server was sent: exact lengths, ignore_eos, the item's key, ids or text, seeds.
    sent = {(r.max_tokens, r.sampling.ignore_eos) for r in svc.requests}
    assert sent == {(5, True), (3, True), (2, True), (400, True), (8, True)}
    by_tokens = {r.max_tokens: r for r in svc.requests}
    assert len(by_tokens[5].prompt_token_ids.ids) == 12 and list(by_tokens[3].prompt_token_ids.ids) == [11, 12, 13]
    assert by_tokens[2].prompt == "a text prompt"
    assert by_tokens[5].sampling.seed == 5 and by_tokens[3].sampling.seed == 6
    assert sorted(svc.keys) == ["alice", "alice", "alice", "bob", "full"]
    # The gRPC client cancels the call, the REST client closes its connection (the bridge then
    # cancels the call): either way the service sees the request cancelled.
    for _ in range(500):
        if svc.cancelled:
            break
        await asyncio.sleep(0.01)
    assert svc.cancelled == [r3.request_id]


@pytest.mark.parametrize("which", ["rest", "grpc"])
async def test_429_is_retried_after_retry_after(which, rest, grpc_client, monkeypatch):
    sleeps = []
    real_sleep = asyncio.sleep

    async def fake_sleep(s, *a):
        if s >= 1:              # Retry-After waits: do not really wait
            sleeps.append(s)
            return
        await real_sleep(s, *a)

    monkeypatch.setattr("loadgen.clients.asyncio.sleep", fake_sleep)
    client = rest if which == "rest" else grpc_client
    [rec] = await run_open_loop([WorkItem(0, 0.0, "full", 3, 2)], client, max_retries=2)
    assert rec.status == 429 and rec.retries == 2 and sleeps == [1.0, 1.0]
    assert "queued" in rec.error and rec.output_tokens == 0


def test_rest_urls_keep_their_path_and_need_http():
    assert RestClient("http://127.0.0.1:1/x/").url == "http://127.0.0.1:1/x/v1/completions"
    for bad in ("127.0.0.1:8000", "https://localhost:1"):
        with pytest.raises(ValueError, match="http://"):
            RestClient(bad)


async def test_rest_timeout_is_recorded_as_such(service):
    _, target = service
    async with served(create_app(target)) as url:
        client = RestClient(url, timeout_s=1.0)
        try:
            [rec] = await run_open_loop([WorkItem(0, 0.0, "alice", 4, 2000)], client)
        finally:
            await client.aclose()
    # 2,000 tokens 2 ms apart take 4 s: the stream started (200, tokens), then timed out.
    assert rec.status == 200 and 0 < rec.output_tokens < 2000
    assert rec.error == "timeout: the stream did not end within 1 s" and rec.finish_reason is None


async def _sse_app_with_a_long_line(scope, receive, send):
    """A bare ASGI app whose SSE stream has one token event, then a 1 MiB line."""
    if scope["type"] == "lifespan":
        while (msg := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "more_body": True,
                "body": b'data: {"choices": [{"text": " a"}]}\n\n'})
    await send({"type": "http.response.body", "body": b"data: " + b"x" * (1 << 20) + b"\n\n"})


async def test_rest_line_over_the_limit_is_an_error_not_a_clean_record():
    async with served(_sse_app_with_a_long_line) as url:
        client = RestClient(url)
        try:
            [rec] = await run_open_loop([WorkItem(0, 0.0, "", 4, 3)], client)
        finally:
            await client.aclose()
    assert rec.status == 200 and rec.output_tokens == 1 and rec.error and rec.finish_reason is None
