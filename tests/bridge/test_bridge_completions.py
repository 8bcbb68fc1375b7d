"""POST /v1/completions: SSE events, non-stream JSON, and the gRPC request the bridge builds."""

from __future__ import annotations

import json

import pytest

from tests.bridge.sse import MODEL_NAME, data_events, parse_sse
from tests.bridge.fake_generate_service import FULL_TEXT, TOKENS

CHUNK_KEYS = {"id", "object", "created", "model", "choices", "request_id", "index"}


async def test_stream_events_are_design_events_and_openai_chunks(client, fake):
    resp = await client.post("/v1/completions", json={"prompt": "one two three", "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = data_events(resp.text)
    tokens, finish = events[:-1], events[-1]
    assert len(tokens) == len(TOKENS)
    request_id = tokens[0]["request_id"]
    assert request_id and resp.headers["x-request-id"] == request_id
    for position, (event, (text, token_id)) in enumerate(zip(tokens, TOKENS)):
        assert CHUNK_KEYS | {"text", "token_id", "position"} == set(event)  # no logprob unless asked
        assert event["id"] == event["request_id"] == request_id
        assert event["object"] == "text_completion"
        assert isinstance(event["created"], int)
        assert event["model"] == MODEL_NAME
        assert (event["index"], event["text"], event["token_id"], event["position"]) == (0, text, token_id, position)
        assert event["choices"] == [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]
    assert "".join(e["text"] for e in tokens) == FULL_TEXT
    assert finish["finish_reason"] == "stop"
    assert finish["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert finish["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert finish["timing"] == {"queue_ms": 1.5, "ttft_ms": 12.25, "e2e_ms": 40.0}      # TIMING to the µs
    assert finish["id"] == request_id and "detail" not in finish


async def test_stream_n_samples_with_logprobs(client):
    body = {"prompt": "hi", "stream": True, "n": 2, "logprobs": 2, "max_tokens": 3, "model": "gpt-4"}
    resp = await client.post("/v1/completions", json=body)
    events = data_events(resp.text)
    by_index = {0: [], 1: []}
    for event in events:
        assert event["model"] == MODEL_NAME           # the served model, not the name the body gave
        by_index[event["index"]].append(event)
    for index, sample in by_index.items():
        tokens, finish = sample[:-1], sample[-1]
        assert [e["text"] for e in tokens] == [t for t, _ in TOKENS[:3]]
        offset = 0
        for position, event in enumerate(tokens):
            assert event["logprob"] == pytest.approx(-0.5 * (position + 1))
            logprobs = event["choices"][0]["logprobs"]
            assert logprobs["tokens"] == [event["text"]]
            assert logprobs["token_logprobs"] == [event["logprob"]]
            assert len(logprobs["top_logprobs"][0]) == 2
            assert logprobs["text_offset"] == [offset]
            offset += len(event["text"])
        assert finish["finish_reason"] == "length" and finish["choices"][0]["finish_reason"] == "length"
        assert finish["usage"]["completion_tokens"] == 3


async def test_stream_mid_stream_error_is_an_error_event(client):
    resp = await client.post("/v1/completions", json={"prompt": "midstream-error:UNAVAILABLE", "stream": True})
    assert resp.status_code == 200  # the stream had started
    events = parse_sse(resp.text)
    assert events[0][0] is None and json.loads(events[0][1])["text"] == TOKENS[0][0]
    name, data = events[-1]
    assert name == "error" and len(events) == 2
    error = json.loads(data)["error"]
    assert error["code"] == "unavailable" and error["type"] and "mid-stream" in error["message"]


async def test_stream_that_ends_early_is_an_error_event(client):
    resp = await client.post("/v1/completions", json={"prompt": "incomplete", "stream": True})
    name, data = parse_sse(resp.text)[-1]
    assert name == "error" and "before every sample finished" in json.loads(data)["error"]["message"]


async def test_non_stream_completion(client):
    resp = await client.post("/v1/completions", json={"prompt": "a b", "n": 2, "max_tokens": 2})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert body["id"] == body["request_id"] == resp.headers["x-request-id"]
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": i, "text": "Hello,", "logprobs": None, "finish_reason": "length"} for i in range(2)
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["timing"] == {"queue_ms": 1.5, "ttft_ms": 12.25, "e2e_ms": 40.0}        # TIMING to the µs


async def test_non_stream_logprobs(client):
    body = (await client.post("/v1/completions", json={"prompt": "x", "logprobs": 0})).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [t for t, _ in TOKENS]
    assert logprobs["token_logprobs"] == pytest.approx([-0.5, -1.0, -1.5, -2.0])
    assert logprobs["top_logprobs"] == [{}] * 4
    assert logprobs["text_offset"] == [0, 5, 6, 12]


async def test_grpc_request_carries_every_field_and_the_key(client, fake):
    body = {
        "prompt": "hello there", "max_tokens": 7, "temperature": 0, "top_k": 40, "top_p": 0.9,
        "stop": ["\n", "END"], "seed": 1234, "n": 3, "logprobs": 5, "ignore_eos": True, "model": "m",
    }
    headers = {"Authorization": "Bearer sk-test", "X-Request-Id": "client-id-1"}
    resp = await client.post("/v1/completions", json=body, headers=headers)
    assert resp.status_code == 200 and resp.json()["id"] == "client-id-1"
    (req,), (md,) = fake.service.requests, fake.service.metadata
    assert md["authorization"] == "Bearer sk-test"
    assert req.WhichOneof("prompt_input") == "prompt" and req.prompt == "hello there"
    assert req.request_id == "client-id-1"
    assert (req.max_tokens, req.n, req.logprobs) == (7, 3, 5)
    s = req.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.ignore_eos) == (0.0, 40, pytest.approx(0.9), 1234, True)
    assert s.HasField("temperature") and list(s.stop) == ["\n", "END"]


async def test_grpc_request_defaults(client, fake):
    await client.post("/v1/completions", json={"prompt": "x", "stop": "STOP", "temperature": None})
    (req,), (md,) = fake.service.requests, fake.service.metadata
    assert "authorization" not in md
    assert (req.max_tokens, req.n) == (16, 1) and not req.HasField("logprobs")
    s = req.sampling
    assert (s.temperature, s.top_k, s.top_p, s.ignore_eos) == (1.0, 0, 1.0, False)
    assert not s.HasField("seed") and list(s.stop) == ["STOP"]
    assert req.request_id == ""


@pytest.mark.parametrize(
    "body, ids",
    [
        ({"prompt_token_ids": [1, 2, 3]}, [1, 2, 3]),
        ({"prompt": [5, 6]}, [5, 6]),  # OpenAI: a prompt may be token ids
        ({"prompt": [[7, 8, 9]]}, [7, 8, 9]),  # OpenAI: a one-prompt batch
        ({"prompt_token_ids": []}, []),  # the service rejects an empty prompt, not the bridge
    ],
)
async def test_prompt_token_ids(client, fake, body, ids):
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    (req,) = fake.service.requests
    assert req.WhichOneof("prompt_input") == "prompt_token_ids"
    assert list(req.prompt_token_ids.ids) == ids
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)


async def test_queued_stream_sends_keepalive_comments_until_its_first_token(fake):
    """A stream whose first token waits (a queued request) gets an SSE comment every
    `keepalive_s`, which clients skip and proxies count as activity; then its events as usual,
    and none once tokens flow."""
    import httpx

    from bridge.app import create_app

    app = create_app(fake.target, model_name=MODEL_NAME, keepalive_s=0.1)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bridge", timeout=10) as c:
            resp = await c.post("/v1/completions",
                                json={"prompt": "slow-first-token:0.45", "stream": True})
            fast = await c.post("/v1/completions", json={"prompt": "one two", "stream": True})
    assert resp.status_code == 200
    blocks = [b for b in resp.text.split("\n\n") if b]
    first_data = next(i for i, b in enumerate(blocks) if b.startswith("data:"))
    assert 3 <= first_data <= 5 and all(b == ": keep-alive" for b in blocks[:first_data])
    assert ": keep-alive" not in blocks[first_data:]
    events = data_events(resp.text)                 # the comments do not disturb the events
    assert "".join(e["text"] for e in events[:-1]) == FULL_TEXT
    assert events[-1]["finish_reason"] == "stop"
    assert ": keep-alive" not in fast.text and data_events(fast.text)[-1]["finish_reason"] == "stop"
