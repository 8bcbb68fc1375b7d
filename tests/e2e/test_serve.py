"""End to end: REST+SSE and gRPC against the real model, the openai SDK, cancel, validation."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import sse_events

PROMPT = "The capital of France is"
TOKEN_KEYS = {"id", "object", "created", "model", "choices", "request_id", "index", "text", "token_id"}


def stream_completion(server, **body) -> list:
    payload = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def test_rest_sse_streams_paris_with_the_documented_event_shapes(server):
    events = stream_completion(server)
    assert events[-1] == "[DONE]"
    tokens, final = events[:-2], events[-2]
    assert len(tokens) == 8
    for i, ev in enumerate(tokens):
        assert TOKEN_KEYS <= set(ev)
        assert ev["object"] == "text_completion" and ev["id"] == ev["request_id"]
        assert ev["request_id"].startswith("cmpl-")        # the engine's id, not a proxy's
        assert ev["choices"][0]["finish_reason"] is None
        assert ev["choices"][0]["text"] == ev["text"]
        assert isinstance(ev["token_id"], int) and ev["index"] == 0
    text = "".join(ev["text"] for ev in tokens)
    assert text.startswith(" Paris")
    assert final["finish_reason"] == "length" == final["choices"][0]["finish_reason"]
    assert final["usage"]["prompt_tokens"] == 5 and final["usage"]["completion_tokens"] == 8
    assert final["timing"]["queue_ms"] >= 0 and final["timing"]["ttft_ms"] > 0


def test_grpc_gives_the_same_tokens_as_rest(server):
    rest_ids = [ev["token_id"] for ev in stream_completion(server)[:-2]]
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        msgs = list(stub.Generate(pb.GenerateRequest(
            prompt=PROMPT, max_tokens=8, sampling=pb.SamplingParams(temperature=0.0)), timeout=120))
    assert msgs[0].WhichOneof("event") == "started" and msgs[0].started.request_id
    assert [m.token.token_id for m in msgs if m.HasField("token")] == rest_ids
    assert msgs[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].finished.usage.completion_tokens == 8


def test_grpc_bad_input_names_the_field_in_trailing_metadata(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4,
                                                  sampling=pb.SamplingParams(top_p=1.5)), timeout=60))
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.details()
    assert ("invalid-field", "top_p") in tuple(err.trailing_metadata())


def test_openai_sdk_streams_from_the_bridge(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                            max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks).startswith(" Paris")
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8,
                                      temperature=0)
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks)


def _cancel_metrics(m: dict) -> tuple[float, float]:
    return (m["genserve_cancel_extra_steps_count"], m["genserve_cancel_extra_steps_bucket{le=1.0}"])


def _assert_one_cancel_within_a_step(before: dict, after: dict) -> None:
    """Between two idle /metrics snapshots exactly one request was cancelled, it cost at most one
    more step, and every KV block is free again."""
    count0, le1_0 = _cancel_metrics(before)
    count1, le1_1 = _cancel_metrics(after)
    assert count1 == count0 + 1 and le1_1 == le1_0 + 1
    assert after["genserve_requests_finished_total{finish_reason=cancelled}"] == \
        before["genserve_requests_finished_total{finish_reason=cancelled}"] + 1
    assert after["genserve_kv_blocks_free"] == after["genserve_kv_blocks_capacity"]


def test_delete_cancels_within_one_step_and_frees_blocks(server):
    before = server.wait_idle()
    payload = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=payload, timeout=120) as r:
        lines = r.iter_lines()
        first = None
        for line in lines:
            if line.startswith("data:"):
                first = json.loads(line[5:])
                break
        reply = httpx.delete(f"{server.base_url}/v1/requests/{first['request_id']}", timeout=10)
        assert reply.status_code == 200 and reply.json()["cancelled"] is True
        rest = sse_events(lines)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["finish_reason"] == "cancelled"
    assert rest[-2]["usage"]["completion_tokens"] < 1000
    after = server.wait_idle()
    count0, le1_0 = _cancel_metrics(before)
    count1, le1_1 = _cancel_metrics(after)
    assert count1 == count0 + 1 and le1_1 == le1_0 + 1        # at most one more step
    assert after["genserve_kv_blocks_free"] == after["genserve_kv_blocks_capacity"]
    assert httpx.delete(f"{server.base_url}/v1/requests/{first['request_id']}", timeout=10).status_code == 404


def test_client_disconnect_cancels_within_one_step_and_frees_blocks(server):
    before = server.wait_idle()
    payload = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=payload, timeout=120) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break                       # leaving the block closes the connection
    after = server.wait_idle()
    _assert_one_cancel_within_a_step(before, after)


def test_grpc_client_cancel_cancels_within_one_step_and_frees_blocks(server):
    """A gRPC client's cancel (through Envoy's listener with Envoy on) reaches the engine."""
    before = server.wait_idle()
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        call = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=1000, sampling=pb.SamplingParams(
            temperature=0.0, ignore_eos=True)), timeout=120)
        tokens = 0
        for msg in call:
            tokens += msg.HasField("token")
            if tokens == 3:
                call.cancel()
                break
    after = server.wait_idle()
    _assert_one_cancel_within_a_step(before, after)


def test_the_first_sse_event_arrives_while_the_request_still_runs(server):
    """Nothing between client and engine buffers the stream: when the first token event arrives
    the request is still generating (a buffered response would arrive only once it ended)."""
    server.wait_idle()
    payload = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=payload, timeout=120) as r:
        lines = r.iter_lines()
        first = next(json.loads(line[5:]) for line in lines if line.startswith("data:"))
        assert first["position"] == 0
        assert server.metrics()["genserve_running_rows"] == 1
        assert httpx.delete(f"{server.base_url}/v1/requests/{first['request_id']}", timeout=10).status_code == 200
        rest = sse_events(lines)
    assert rest[-1] == "[DONE]" and rest[-2]["finish_reason"] == "cancelled"
    server.wait_idle()


@pytest.mark.parametrize("body, field, words", [
    ({"prompt_token_ids": [100] * 8000, "max_tokens": 500}, "prompt_token_ids", "8192"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens", "1000"),
    ({"prompt": PROMPT, "max_tokens": 1001}, "max_tokens", "1000"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt_token_ids": [5, 49152]}, "prompt_token_ids", "vocabulary"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature", ">= 0"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": PROMPT, "top_p": 1.5}, "top_p", "(0, 1]"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(server, body, field, words):
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert field in error["message"] and words in error["message"]
    assert set(error) >= {"message", "type", "code"} and error["param"] == field
    ok = httpx.post(f"{server.base_url}/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith(" Paris")
