"""The request surface end to end: n, stop strings, logprobs, edge values, multi-byte text."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.e2e.conftest import sse_events

PROMPT = "The capital of France is"


def completion(server, **body) -> dict:
    reply = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed(server, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/completions",
                      json={"prompt": PROMPT, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def texts_by_index(events: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for ev in events:
        if "token_id" in ev:
            out[ev["index"]] = out.get(ev["index"], "") + ev["text"]
    return out


def test_n_samples_differ_and_repeat_with_a_seed(server):
    body = dict(n=3, max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    first = completion(server, **body)
    again = completion(server, **body)
    texts = [c["text"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) == 3
    assert texts == [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])]
    assert first["usage"]["completion_tokens"] == 36
    events = streamed(server, **body)
    assert texts_by_index(events) == dict(enumerate(texts))
    finals = [ev for ev in events if ev.get("finish_reason")]
    assert sorted(ev["index"] for ev in finals) == [0, 1, 2]


@pytest.mark.parametrize("stop", [" of", ".", "never-in-the-output"])
def test_stop_strings_streamed_equals_non_streamed(server, stop):
    prompt = "Q: Name the capital of France.\nA: The capital of France is"
    body = dict(prompt=prompt, max_tokens=24, temperature=0.8, seed=7, stop=[stop])
    whole = completion(server, **body)["choices"][0]
    events = streamed(server, **body)
    assert texts_by_index(events)[0] == whole["text"]
    assert stop not in whole["text"]
    free = completion(server, **{**body, "stop": []})["choices"][0]["text"]
    if stop in free:
        assert whole["finish_reason"] == "stop"
        assert whole["text"] == free[:free.index(stop)]
    else:
        assert whole["text"] == free


def test_a_stop_string_spanning_two_tokens(server):
    free = completion(server, max_tokens=12, temperature=0)["choices"][0]["text"]   # " Paris.\n\nThe..."
    assert free.startswith(" Paris.")
    stopped = completion(server, max_tokens=12, temperature=0, stop=["s."])["choices"][0]
    assert stopped["text"] == " Pari" and stopped["finish_reason"] == "stop"


def test_logprobs_are_finite_in_the_openai_shape(server):
    choice = completion(server, max_tokens=6, temperature=0.7, seed=3, logprobs=3)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert math.isfinite(value) and value <= 0
        assert 1 <= len(top) <= 3 and all(math.isfinite(v) for v in top.values())
    greedy = completion(server, max_tokens=4, temperature=0, logprobs=1)["choices"][0]["logprobs"]
    for token, value, top in zip(greedy["tokens"], greedy["token_logprobs"], greedy["top_logprobs"]):
        assert top[token] == pytest.approx(value)          # greedy picks the most likely token


def test_sampling_edge_values(server):
    greedy = completion(server, max_tokens=10, temperature=0)["choices"][0]["text"]
    assert completion(server, max_tokens=10, temperature=1e-5, seed=1)["choices"][0]["text"] == greedy
    a = completion(server, max_tokens=10, temperature=0.9, seed=5, top_k=0)["choices"][0]["text"]
    b = completion(server, max_tokens=10, temperature=0.9, seed=5, top_k=-1)["choices"][0]["text"]
    assert a == b
    default = completion(server, temperature=0, ignore_eos=True)
    assert default["usage"]["completion_tokens"] == 16                # OpenAI's default max_tokens


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 4, "colour": "red"}, "colour"),
    ({"n": 9}, "n"),
    ({"logprobs": 6}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_wrong_types_unknown_fields_and_out_of_range_are_400s(server, body, field):
    reply = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert field in error["message"] and error["param"] == field


def test_multibyte_answers_stream_without_replacement_characters(server):
    prompt = "Emojis: 😀 😃 😄 😁 😆"            # the model continues with emoji (4-byte UTF-8)
    events = streamed(server, prompt=prompt, max_tokens=30, temperature=0.9, seed=11, ignore_eos=True)
    text = texts_by_index(events)[0]
    assert "\ufffd" not in text
    assert any(ord(ch) > 0x2000 for ch in text), text     # the answer really has multi-byte text
    assert json.dumps(text)
