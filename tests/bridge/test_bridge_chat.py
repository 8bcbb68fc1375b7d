"""/v1/chat/completions over the fake GenerateService: the request it sends, chunks, JSON, errors."""

from __future__ import annotations

import re

import httpx

from genserve.v1 import generate_pb2 as pb
from tests.bridge.fake_generate_service import FULL_TEXT, TOKENS
from tests.bridge.sse import MODEL_NAME, data_events, parse_sse

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


async def test_messages_sampling_and_limits_travel_in_the_grpc_request(client: httpx.AsyncClient, fake):
    r = await client.post("/v1/chat/completions", json={
        "model": "whatever", "messages": MESSAGES + [{"role": "user", "content": [
            {"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 11, "n": 2,
        "stop": "\n", "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    req = fake.service.requests[-1]
    assert req.WhichOneof("prompt_input") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "Be brief."), ("user", "Say hello"), ("user", "part one, part two")]
    assert req.max_tokens == 7 and req.n == 2 and req.logprobs == 3
    assert req.sampling.seed == 11 and list(req.sampling.stop) == ["\n"]
    assert abs(req.sampling.temperature - 0.5) < 1e-6


async def test_whole_answer_is_a_chat_completion(client: httpx.AsyncClient):
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "n": 2})
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL_NAME
    # OpenAI's id shape, chatcmpl-<hex> (not chatcmpl-cmpl-<hex>), and the id to cancel it by.
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"]) and body["request_id"] == body["id"]
    assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": FULL_TEXT}] * 2
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
    assert body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 2 * len(TOKENS)
    assert body["usage"]["prompt_tokens"] == 4      # the fake counts the messages' words
    assert body["timing"] == {"queue_ms": 1.5, "ttft_ms": 12.25, "e2e_ms": 40.0}   # as /v1/completions


async def test_stream_opens_with_the_role_then_deltas_then_finish_and_usage(client: httpx.AsyncClient):
    r = await client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = data_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
    deltas = [e["choices"][0]["delta"]["content"] for e in events[1:1 + len(TOKENS)]]
    assert "".join(deltas) == FULL_TEXT
    finish = events[1 + len(TOKENS)]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["delta"] == {}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(TOKENS)
    assert all("usage" in e for e in events)           # null until the last, as OpenAI sends it


async def test_bad_messages_are_400s_naming_the_field_and_reach_no_engine(client: httpx.AsyncClient, fake):
    service = fake.service
    before = len(service.requests)
    for messages, field in [([], "messages"), ([{"role": "bot", "content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": None}], "messages[0].content")]:
        r = await client.post("/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "logit_bias": {"the": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias"), r.text
    assert "token ids" in r.json()["error"]["message"]
    assert len(service.requests) == before


async def test_engine_errors_map_as_for_completions(client: httpx.AsyncClient):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "error:RESOURCE_EXHAUSTED:3"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "midstream-error:INTERNAL"}], "stream": True})
    events = parse_sse(r.text)
    assert events[0][0] is None and events[-1][0] == "error"


def test_finish_chunk_carries_genserve_timing():
    from bridge.chat import ChatCompletionBuilder
    b = ChatCompletionBuilder(model="m", created=1, num_samples=1, logprobs=False)
    assert b.events_for(pb.GenerateResponse(request_id="r", started=pb.Started(request_id="r", prompt_tokens=3))) == []
    # A sample that ends before any token still opens with its role chunk, then finishes.
    [role, chunk] = b.events_for(pb.GenerateResponse(request_id="r", finished=pb.Finished(
        index=0, reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=3, completion_tokens=0),
        timing=pb.Timing(queue_ms=1.0, ttft_ms=2.0, e2e_ms=3.0))))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk["choices"][0]["finish_reason"] == "stop"
    assert chunk["timing"] == {"queue_ms": 1.0, "ttft_ms": 2.0, "e2e_ms": 3.0}
    assert b.all_finished and b.completion()["choices"][0]["message"]["content"] == ""


def test_whole_answers_timing_spans_its_samples():
    """Non-streamed, `timing` is the longest queue wait, the earliest first token and the latest
    end over the samples (as /v1/completions answers); a sample that ended before its first
    token (no `ttft_ms` in its Timing) is not the earliest, and ttft_ms is null when no sample had
    a first token; `timing` is null when no sample reported a timing."""
    from bridge.chat import ChatCompletionBuilder

    def whole_answer(*timings: pb.Timing | None) -> dict:
        b = ChatCompletionBuilder(model="m", created=1, num_samples=len(timings), logprobs=False)
        for index, timing in enumerate(timings):
            b.events_for(pb.GenerateResponse(request_id="r", finished=pb.Finished(
                index=index, reason=pb.FINISH_REASON_LENGTH, timing=timing)))
        return b.completion()

    assert whole_answer(pb.Timing(queue_ms=2.0, ttft_ms=9.0, e2e_ms=30.0),
                        pb.Timing(queue_ms=5.0, ttft_ms=7.5, e2e_ms=20.0))["timing"] == \
        {"queue_ms": 5.0, "ttft_ms": 7.5, "e2e_ms": 30.0}
    assert whole_answer(pb.Timing(queue_ms=1.0, e2e_ms=4.0),
                        pb.Timing(queue_ms=1.0, ttft_ms=6.0, e2e_ms=25.0))["timing"] == \
        {"queue_ms": 1.0, "ttft_ms": 6.0, "e2e_ms": 25.0}
    assert whole_answer(pb.Timing(queue_ms=3.0, e2e_ms=4.0))["timing"] == \
        {"queue_ms": 3.0, "ttft_ms": None, "e2e_ms": 4.0}
    assert whole_answer(None)["timing"] is None


async def test_each_turn_carries_the_conversations_prefix_routing_key(client: httpx.AsyncClient, fake):
    """The bridge tags the Generate call with the key Envoy hashes: the same for every turn of a
    conversation of one API key, another for another API key (genserve/common/prefix_route.py)."""
    from genserve.common.prefix_route import ROUTE_KEY_HEADER, request_route_key

    opening = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = [*opening, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    for messages, key in ((opening, "sk-a"), (later, "sk-a"), (later, "sk-b")):
        resp = await client.post("/v1/chat/completions", json={"messages": messages},
                                 headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200
    keys = [md[ROUTE_KEY_HEADER] for md in fake.service.metadata]
    assert keys[0] == keys[1] != keys[2]
    assert keys == [request_route_key(req, md["authorization"])
                    for req, md in zip(fake.service.requests, fake.service.metadata)]
    assert len(keys[0]) == 32
