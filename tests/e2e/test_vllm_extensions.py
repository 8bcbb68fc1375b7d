"""vLLM's OpenAI-server extensions that training and evaluation tooling sends, against the real
server through the openai SDK (`extra_body`, as such tools send them): `return_tokens_as_token_ids`,
`response_format` on /v1/completions and `prompt_logprobs` on both endpoints."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import sse_events

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _prompt_ids(server, **body) -> list[int]:
    return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60).json()["tokens"]


def test_return_tokens_as_token_ids_on_completions(server, client):
    """Each logprobs token and alternative is `token_id:<id>`: the ids the stream's events carry,
    the same logprobs as without the flag, and the same text; with echo the prompt's tokens are
    its /tokenize ids."""
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    plain = client.completions.create(**body).choices[0]
    as_ids = client.completions.create(**body, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert as_ids.text == plain.text
    assert as_ids.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert as_ids.logprobs.text_offset == plain.logprobs.text_offset
    ids = [int(t.removeprefix("token_id:")) for t in as_ids.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in as_ids.logprobs.tokens)
    assert httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"] == plain.text
    for top_ids, top_text in zip(as_ids.logprobs.top_logprobs, plain.logprobs.top_logprobs):
        assert len(top_ids) == len(top_text) and all(k.startswith("token_id:") for k in top_ids)
        assert sorted(top_ids.values()) == sorted(top_text.values())
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=600,
                      json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "stream": True,
                            "return_tokens_as_token_ids": True}) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]" and e.get("token_id") is not None]
    assert [e["choices"][0]["logprobs"]["tokens"][0] for e in events] == [f"token_id:{e['token_id']}" for e in events]
    echo = client.completions.create(**{**body, "max_tokens": 1}, echo=True,
                                     extra_body={"return_tokens_as_token_ids": True}).choices[0]
    prompt_ids = _prompt_ids(server, prompt=PROMPT)
    assert echo.logprobs.tokens[:len(prompt_ids)] == [f"token_id:{i}" for i in prompt_ids]
    assert echo.logprobs.tokens[len(prompt_ids)] == as_ids.logprobs.tokens[0]


def test_return_tokens_as_token_ids_on_chat(client):
    """Chat's logprobs entries and alternatives are named `token_id:<id>`; their logprobs and
    `bytes` (the token's own) are those without the flag."""
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=5, temperature=0,
                logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**body).choices[0]
    as_ids = client.chat.completions.create(**body, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert as_ids.message.content == plain.message.content
    for a, p in zip(as_ids.logprobs.content, plain.logprobs.content, strict=True):
        assert a.token.startswith("token_id:") and a.logprob == p.logprob and a.bytes == p.bytes
        assert [t.logprob for t in a.top_logprobs] == [t.logprob for t in p.top_logprobs]
        assert all(t.token.startswith("token_id:") for t in a.top_logprobs)
    assert bytes(b for e in as_ids.logprobs.content for b in e.bytes).decode() == plain.message.content


def test_response_format_on_completions(server, client):
    """`response_format` (json_schema, json_object) on /v1/completions constrains the text as on
    chat, streamed alike; a bad schema is a 400 naming the field."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 50000000}},
              "required": ["city", "population"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    reply = client.completions.create(model=MODEL, prompt="Paris as JSON:", max_tokens=60, temperature=0,
                                      extra_body={"response_format": fmt})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), schema)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Paris as JSON:", max_tokens=60, temperature=0, stream=True,
        extra_body={"response_format": fmt}) if c.choices)
    assert streamed == choice.text
    obj = client.completions.create(model=MODEL, prompt="Any JSON:", max_tokens=40, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 3, "response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "frobnicate"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 3, "response_format": {"type": "json_object"},
                         "guided_regex": "a+"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text


def test_prompt_logprobs_on_completions(server, client):
    """vLLM's shape: one entry per prompt token (its /tokenize ids), null first, then
    {id: {logprob, rank, decoded_token}} with the prompt token first and at most k alternatives
    ranked 1..k; the prompt token's logprob is echo's, computed in the same prefill."""
    k = 2
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": k}).to_dict()
    entries = reply["choices"][0]["prompt_logprobs"]
    ids = _prompt_ids(server, prompt=PROMPT)
    assert len(entries) == len(ids) == reply["usage"]["prompt_tokens"] and entries[0] is None
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                     logprobs=k).choices[0].logprobs
    for position, (entry, token_id) in enumerate(zip(entries[1:], ids[1:]), 1):
        first = next(iter(entry))
        assert first == str(token_id) and len(entry) <= k + 1
        assert entry[first]["logprob"] == pytest.approx(echo.token_logprobs[position], abs=1e-6)
        assert entry[first]["decoded_token"] == echo.tokens[position]
        alternatives = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None)
        assert [r for r, _ in alternatives] == list(range(1, k + 1))
        assert [lp for _, lp in alternatives] == sorted((lp for _, lp in alternatives), reverse=True)
        if entry[first]["rank"] is None:
            assert entry[first]["logprob"] <= alternatives[-1][1]
    assert reply["choices"][0]["logprobs"] is None          # prompt_logprobs alone adds no token logprobs
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices[0].model_extra.get(
        "prompt_logprobs") is None


def test_prompt_logprobs_on_chat_and_not_with_stream(server, client):
    """On chat the prompt logprobs are the completion's (vLLM's place), one per prompt token of
    the rendered conversation; with `stream` they are refused, naming the field."""
    messages = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 0}).to_dict()
    entries = reply["prompt_logprobs"]
    ids = _prompt_ids(server, messages=messages)
    assert len(entries) == len(ids) == reply["usage"]["prompt_tokens"] and entries[0] is None
    assert [int(next(iter(e))) for e in entries[1:]] == ids[1:]
    assert all(len(e) == 1 and e[next(iter(e))]["rank"] is None for e in entries[1:])
    for route, body in (("/v1/chat/completions", {"messages": messages}), ("/v1/completions", {"prompt": PROMPT})):
        r = httpx.post(f"{server.base_url}{route}", timeout=60,
                       json={**body, "max_tokens": 2, "stream": True, "prompt_logprobs": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt_logprobs" and "stream" in error["message"], error
