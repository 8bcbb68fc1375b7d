"""OpenAI parity over the fake GenerateService: several prompts, echo, best_of, stream_options,
chat ids and logprob bytes, recorded fields, GET /v1/models/{model}, /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from bridge.chat import ChatCompletionBuilder
from bridge.completions import CompletionBuilder
from genserve.v1 import generate_pb2 as pb
from tests.bridge.fake_generate_service import FULL_TEXT, TOKENS
from tests.bridge.sse import MODEL_NAME, data_events

CHAT = [{"role": "user", "content": "Say hello"}]


async def test_several_prompts_answer_prompt_major_then_n_with_usage_summed(client, fake):
    r = await client.post("/v1/completions", json={"prompt": ["one two", "three"], "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == FULL_TEXT for c in body["choices"])
    assert sorted(req.prompt for req in fake.service.requests) == ["one two", "three"]   # calls run at once
    assert all(req.n == 2 for req in fake.service.requests)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4 * len(TOKENS),
                             "total_tokens": 3 + 4 * len(TOKENS), "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["id"].startswith("fake-")


async def test_several_token_id_prompts_stream_with_choice_indices(client, fake):
    r = await client.post("/v1/completions", json={"prompt": [[1, 2], [3, 4, 5]], "stream": True,
                                                   "stream_options": {"include_usage": True}})
    events = data_events(r.text)
    assert sorted(list(req.prompt_token_ids.ids) for req in fake.service.requests) == [[1, 2], [3, 4, 5]]
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: FULL_TEXT, 1: FULL_TEXT}
    assert len({e["id"] for e in events}) == 1                   # one completion
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 5
    assert events[-1]["usage"]["completion_tokens"] == 2 * len(TOKENS)
    assert all(e["usage"] is None for e in events if "token_id" in e)


@pytest.mark.parametrize("second", ["hang", "hang-before-started"])
async def test_cancelling_a_several_prompt_completion_cancels_every_prompt(client, fake, second):
    # "hang-before-started": the DELETE comes before the bridge has every call's Started.
    stream = asyncio.create_task(client.post("/v1/completions", json={
        "prompt": ["hang", second], "stream": True}, headers={"X-Request-Id": "grp"}))
    for _ in range(1000):                  # up to 10 s: a loaded machine schedules the task late
        if len(fake.service._cancel_flags) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(fake.service._cancel_flags) == 2, "both prompts' calls should have reached the service"
    r = await client.delete("/v1/requests/grp")
    assert r.status_code == 200, r.text
    assert sorted(call_id for call_id, _ in fake.service.cancel_calls) == ["grp", "grp-1"]
    events = data_events((await asyncio.wait_for(stream, 5)).text)
    assert sorted(e["index"] for e in events if e.get("finish_reason")) == [0, 1]
    assert all(e["finish_reason"] == "cancelled" for e in events if e.get("finish_reason"))


async def test_echo_puts_the_prompt_first(client, fake):
    body = (await client.post("/v1/completions", json={"prompt": ["Hi there", "Yo"], "echo": True})).json()
    assert [c["text"] for c in body["choices"]] == ["Hi there" + FULL_TEXT, "Yo" + FULL_TEXT]
    body = (await client.post("/v1/completions", json={"prompt": list(b"caf\xc3\xa9"), "echo": True})).json()
    assert body["choices"][0]["text"] == "café" + FULL_TEXT          # token ids: the engine detokenizes
    events = data_events((await client.post("/v1/completions", json={
        "prompt": "Hi", "echo": True, "stream": True})).text)
    assert events[0]["choices"][0]["text"] == "Hi" and "token_id" not in events[0]
    assert "".join(e["choices"][0]["text"] for e in events) == "Hi" + FULL_TEXT
    r = await client.post("/v1/completions", json={"prompt": [300], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_echo_with_logprobs_asks_the_engine_for_the_prompts_logprobs(client, fake):
    r = await client.post("/v1/completions", json={"prompt": "Hi", "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    [req] = fake.service.requests
    assert req.HasField("prompt_logprobs") and req.prompt_logprobs == 1 and req.logprobs == 1
    await client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1})
    assert not fake.service.requests[-1].HasField("prompt_logprobs")     # no echo: not asked


async def test_best_of_asks_the_engine_for_best_of_samples_with_logprobs(client, fake):
    body = (await client.post("/v1/completions", json={"prompt": "Hi", "best_of": 3, "n": 2})).json()
    [req] = fake.service.requests
    assert req.n == 3 and req.HasField("logprobs") and req.logprobs == 0
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])      # not asked for
    assert body["usage"]["completion_tokens"] == 3 * len(TOKENS)     # every sample drawn
    for extra, word in [({"best_of": 1, "n": 2}, "at least"), ({"best_of": 2, "stream": True}, "stream")]:
        r = await client.post("/v1/completions", json={"prompt": "Hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
        assert word in r.json()["error"]["message"]


def _messages(*events):
    """Started, then (index, text, logprob) tokens, then Finished for each index seen."""
    out = [pb.GenerateResponse(request_id="r", started=pb.Started(request_id="r", prompt_tokens=2))]
    indices = []
    for position, (index, text, logprob) in enumerate(events):
        out.append(pb.GenerateResponse(request_id="r", token=pb.Token(
            index=index, text=text, token_id=5, logprob=logprob, position=position)))
        indices.append(index)
    for index in dict.fromkeys(indices):
        out.append(pb.GenerateResponse(request_id="r", finished=pb.Finished(
            index=index, reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=2, completion_tokens=2))))
    return out


def test_best_of_returns_the_n_samples_of_highest_mean_logprob_per_prompt():
    b = CompletionBuilder(model="m", created=1, num_samples=6, logprobs=True, num_prompts=2, n=1)
    for msg in _messages((0, "a", -3.0), (1, "b", -1.0), (2, "c", -0.5), (0, "a", -3.0), (1, "b", -1.0),
                         (2, "c", -0.1), (3, "d", -0.5), (4, "e", -0.2), (5, "f", -0.9),
                         (3, "d", -0.5), (4, "e", -0.2), (5, "f", -0.9)):
        b.events_for(msg)
    choices = b.completion()["choices"]
    assert [(c["index"], c["text"]) for c in choices] == [(0, "cc"), (1, "ee")]
    assert choices[0]["logprobs"]["token_logprobs"] == pytest.approx([-0.5, -0.1])


async def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(client):
    for route, body in [("/v1/completions", {"prompt": "one two"}), ("/v1/chat/completions", {"messages": CHAT})]:
        r = await client.post(route, json={**body, "stream": True, "n": 2, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
        events = data_events(r.text)
        per_choice = [e for e in events if e["choices"]]
        assert all(e["usage"]["prompt_tokens"] == 2 for e in per_choice), route
        counts: dict[int, list[int]] = {}
        for e in per_choice:
            counts.setdefault(e["choices"][0]["index"], []).append(e["usage"]["completion_tokens"])
        for series in counts.values():
            assert series == sorted(series) and series[-1] == len(TOKENS), (route, series)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2 * len(TOKENS)


async def test_chat_tools_and_formats_asking_for_nothing_are_accepted(client, fake):
    ok = {"tools": [], "tool_choice": "none", "functions": None, "function_call": "none",
          "parallel_tool_calls": False, "response_format": {"type": "text"}, "modalities": ["text"],
          "messages": [{"role": "user", "content": "Hi", "name": "ann"}]}
    r = await client.post("/v1/chat/completions", json=ok)
    assert r.status_code == 200, r.text
    for field, value in [("tools", [{"type": "function"}]), ("tool_choice", "sometimes")]:
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


async def test_chat_without_max_tokens_leaves_it_to_the_engine(client, fake):
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        await client.post("/v1/chat/completions", json={"messages": CHAT, **extra})
        assert not fake.service.requests[-1].HasField("max_tokens")


async def test_chat_ids_are_chatcmpl_hex_or_the_clients(client, fake):
    body = (await client.post("/v1/chat/completions", json={"messages": CHAT})).json()
    assert body["id"].startswith("chatcmpl-") and not body["id"].startswith("chatcmpl-cmpl-")
    assert fake.service.requests[-1].request_id == body["id"]
    body = (await client.post("/v1/chat/completions", json={"messages": CHAT},
                              headers={"X-Request-Id": "mine"})).json()
    assert body["id"] == "chatcmpl-mine" and body["request_id"] == "mine"


def test_chat_logprob_bytes_are_each_tokens_own():
    """😀 split over two tokens: the first carries no text but its own two bytes."""
    b = ChatCompletionBuilder(model="m", created=1, num_samples=1, logprobs=True)
    b.events_for(pb.GenerateResponse(request_id="r", started=pb.Started(request_id="r", prompt_tokens=1)))
    for position, (text, raw) in enumerate([("", b"\xf0\x9f"), ("😀", b"\x98\x80"), (" ok", b" ok")]):
        tok = pb.Token(index=0, text=text, token_id=9, logprob=-0.5, position=position, token_bytes=raw)
        tok.top_logprobs.add(token_id=9, text=raw.decode("utf-8", "replace"), logprob=-0.5, token_bytes=raw)
        b.events_for(pb.GenerateResponse(request_id="r", token=tok))
    b.events_for(pb.GenerateResponse(request_id="r", finished=pb.Finished(index=0, reason=pb.FINISH_REASON_STOP)))
    choice = b.completion()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [e["bytes"] for e in entries] == [[0xF0, 0x9F], [0x98, 0x80], list(b" ok")]
    assert bytes(sum((e["bytes"] for e in entries), [])).decode() == choice["message"]["content"] == "😀 ok"
    assert "".join(e["token"] for e in entries) == "😀 ok"
    assert entries[0]["top_logprobs"][0]["token"] == "\ufffd"
    assert bytes(sum((e["top_logprobs"][0]["bytes"] for e in entries), [])) == "😀 ok".encode()


async def test_recorded_fields_reach_the_log(client, caplog):
    caplog.set_level(logging.INFO, logger="bridge.serving")
    r = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "user": "u1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto"})
    assert r.status_code == 200
    [record] = [rec for rec in caplog.records if rec.getMessage() == "request fields recorded"]
    assert record.openai_fields == {"user": "u1", "metadata": json.dumps({"team": "a"}), "store": "false",
                                    "service_tier": "auto"}


async def test_model_retrieve_and_unknown_model(client):
    r = await client.get(f"/v1/models/{MODEL_NAME}")
    assert r.status_code == 200 and r.json()["id"] == MODEL_NAME and r.json()["object"] == "model"
    r = await client.get("/v1/models/org/other-model")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                 "code": "model_not_found", "param": "model"}
    assert "org/other-model" in r.json()["error"]["message"]


async def test_tokenize_and_detokenize(client, fake):
    r = await client.post("/tokenize", json={"model": MODEL_NAME, "prompt": "héllo"},
                          headers={"Authorization": "Bearer k9"})
    assert r.json() == {"count": 6, "max_model_len": 8192, "tokens": list("héllo".encode()), "token_strs": None}
    assert fake.service.metadata[-1]["authorization"] == "Bearer k9"
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"},
                                                          {"role": "assistant", "content": "b"}]})
    assert r.json()["tokens"] == list(b"a\nb")
    r = await client.post("/detokenize", json={"tokens": list("héllo".encode())})
    assert r.json() == {"prompt": "héllo"}
    for path, body, field in [("/detokenize", {"tokens": [999]}, "tokens"), ("/tokenize", {}, None),
                              ("/tokenize", {"prompt": "x", "messages": CHAT}, None),
                              ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
                              ("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs"),
                              ("/tokenize", {"prompt": "x", "colour": 1}, "colour")]:
        r = await client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)
