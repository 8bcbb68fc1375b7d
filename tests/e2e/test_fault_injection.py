"""Failure handling end to end, on a real `genserve serve` with fault injection.

The engine is started with GENSERVE_FAIL_AT_STEP=K and a one-shot file: its K-th forward pass
after start-up raises. Every open stream, over SSE and over gRPC, must end with an explicit
error; the engine process exits non-zero; the supervisor restarts it (the one-shot file keeps
the new engine healthy); the bridge answers 503 with Retry-After meanwhile and serves again on
its own. The last test sends SIGTERM to the supervisor and checks the drain.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import grpc
import httpx
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import start_server

FAIL_AT_STEP = 60
RECOVERY_TIMEOUT_S = 240.0
LONG = 300          # tokens: the streams are still open when step FAIL_AT_STEP raises


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    once = tmp_path_factory.mktemp("fault") / "fired"
    yield from start_server("--queue-budget-s", "60", "--drain-grace-s", "90",
                            env={"GENSERVE_FAIL_AT_STEP": str(FAIL_AT_STEP),
                                 "GENSERVE_FAIL_ONCE_FILE": str(once)})


def sse_until_end(base_url: str, i: int, max_tokens: int = LONG,
                  started: concurrent.futures.Future | None = None) -> dict:
    """Stream one completion; returns the number of data events (tokens and the final event),
    the `event: error` payload, and whether [DONE] came."""
    body = {"prompt": f"Stream {i}: tell a long story.", "stream": True, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    out = {"tokens": 0, "error": None, "done": False, "status": None}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                if event == "error":
                    out["error"] = json.loads(data)
                elif data == "[DONE]":
                    out["done"] = True
                else:
                    out["tokens"] += 1
                    if started is not None and not started.done():
                        started.set_result(True)
                event = None
    return out


def grpc_until_end(target: str, i: int, max_tokens: int = LONG) -> dict:
    out = {"tokens": 0, "code": None, "details": ""}
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        req = pb.GenerateRequest(prompt=f"gRPC stream {i}: tell a long story.", max_tokens=max_tokens,
                                 sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True))
        try:
            for msg in stub.Generate(req, timeout=120):
                out["tokens"] += msg.HasField("token")
        except grpc.RpcError as err:
            out["code"], out["details"] = err.code(), err.details()
    return out


def test_a_forward_pass_fault_ends_every_open_stream_with_an_error_and_the_engine_comes_back(faulty_server):
    srv = faulty_server
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        sse = [pool.submit(sse_until_end, srv.base_url, i) for i in range(3)]
        rpc = [pool.submit(grpc_until_end, srv.grpc_target, i) for i in range(3)]
        sse_results = [f.result(timeout=180) for f in sse]
        grpc_results = [f.result(timeout=180) for f in rpc]
    failed_at = time.monotonic()

    for res in sse_results:
        assert res["status"] == 200 and res["tokens"] > 0, res
        assert res["error"] is not None and not res["done"], res       # error event, then the end
        err = res["error"]["error"]
        assert err["code"] == "unavailable" and "injected fault" in err["message"], err
    for res in grpc_results:
        assert res["tokens"] > 0, res
        assert res["code"] == grpc.StatusCode.UNAVAILABLE and "injected fault" in res["details"], res

    # While the engine is down or loading, the bridge answers 503 with Retry-After.
    reply = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert reply.status_code == 503, reply.text
    assert int(reply.headers["retry-after"]) >= 1
    assert reply.json()["error"]["code"] == "unavailable"
    health = httpx.get(f"{srv.base_url}/health", timeout=10)
    assert health.status_code == 503 and "retry-after" in health.headers

    # The supervisor restarts the engine; the bridge recovers by itself.
    while httpx.get(f"{srv.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() - failed_at < RECOVERY_TIMEOUT_S, "engine did not come back"
        time.sleep(0.1)
    print(f"\n  engine back {time.monotonic() - failed_at:.1f} s after the fault")
    assert any("engine exited with 1" in line for line in srv.output), srv.output[-20:]
    ok = httpx.post(f"{srv.base_url}/v1/completions",
                    json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith(" Paris")
    res = sse_until_end(srv.base_url, 99, max_tokens=8)
    assert res["done"] and res["error"] is None and res["tokens"] == 8 + 1
    assert grpc_until_end(srv.grpc_target, 99, max_tokens=8) == {"tokens": 8, "code": None, "details": ""}
    m = srv.wait_idle()
    assert m["genserve_kv_blocks_free"] == m["genserve_kv_blocks_capacity"]


def test_sigterm_drains_open_streams_and_refuses_new_requests(faulty_server):
    srv = faulty_server
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started: concurrent.futures.Future = concurrent.futures.Future()
        stream = pool.submit(sse_until_end, srv.base_url, 7, 40, started)
        started.result(timeout=60)
        srv.process.send_signal(signal.SIGTERM)
        refused = None
        while not stream.done():
            r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
            if r.status_code == 503:
                refused = r
                break
            time.sleep(0.05)
        res = stream.result(timeout=120)
    assert refused is not None, "no request was refused while draining"
    assert "retry-after" in refused.headers and "draining" in refused.json()["error"]["message"]
    assert res["done"] and res["error"] is None and res["tokens"] == 40 + 1, res
    assert srv.process.wait(60) == 0
