"""End to end: /v1/chat/completions against the real model, through the openai SDK and raw HTTP."""

from __future__ import annotations

import math

import httpx
import pytest

from engine.tokenizer import Tokenizer
from genserve.common.chat_messages import parse_messages
from service.chat import template_for

MESSAGES = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def _chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions",
                      json={"messages": MESSAGES, **body}, timeout=120)


def test_openai_sdk_streams_chat_and_equals_the_whole_answer(server, openai_client):
    chunks = list(openai_client.chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in streamed
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = openai_client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12,
                                                  temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == streamed
    token_chunks = [c for c in chunks if c.choices and c.choices[0].delta.role is None
                    and c.choices[0].finish_reason is None]
    assert whole.usage.completion_tokens == len(token_chunks)


def test_chat_equals_completions_on_the_rendered_template(server):
    """The engine renders the model's own template: the same text sent as a plain prompt gives
    the same greedy tokens."""
    template = template_for(Tokenizer.from_gguf())
    prompt = template.render(parse_messages(MESSAGES))
    chat = _chat(server, max_tokens=10, temperature=0).json()
    plain = httpx.post(f"{server.base_url}/v1/completions",
                       json={"prompt": prompt, "max_tokens": 10, "temperature": 0}, timeout=120).json()
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_stop_strings_n_and_seeds_behave_as_on_completions(server):
    free = _chat(server, max_tokens=16, temperature=0).json()["choices"][0]["message"]["content"]
    word = free.split()[1]
    stopped = _chat(server, max_tokens=16, temperature=0, stop=[word]).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["message"]["content"] == free[:free.index(word)]
    a = _chat(server, max_tokens=8, temperature=1.0, n=3, seed=1234).json()
    b = _chat(server, max_tokens=8, temperature=1.0, n=3, seed=1234).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in a["choices"]] == [c["message"]["content"] for c in b["choices"]]
    assert len({c["message"]["content"] for c in a["choices"]}) > 1     # each sample its own generator
    assert all(c["finish_reason"] in ("stop", "length") for c in a["choices"])
    assert 3 <= a["usage"]["completion_tokens"] <= 24


def test_logprobs_in_the_chat_shape(server, openai_client):
    whole = openai_client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=6,
                                                  temperature=0, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for e in content:
        assert math.isfinite(e.logprob) and e.logprob <= 0 and len(e.top_logprobs) == 2
        assert bytes(e.bytes) == e.token.encode()
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4     # greedy: the top token
    streamed = list(openai_client.chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        stream=True, stream_options={"include_usage": True}))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in entries] == [(e.token, round(e.logprob, 4)) for e in content]
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 6


@pytest.mark.parametrize(("messages", "field"), [
    ([], "messages"),
    ([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}], "messages[1].role"),
    ([{"role": "user", "content": 42}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ("hello", "messages"),
])
def test_bad_messages_get_a_400_naming_the_field(server, messages, field):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_a_repeated_system_prompt_is_served_from_the_prefix_cache(server):
    """The second conversation with the same long system prompt takes it from the cache (the
    engine's counters say how much), and an identical request answers identically."""
    system = {"role": "system", "content": "You are a patient tutor of geography. " * 30}
    ask = lambda q: httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={  # noqa: E731
        "messages": [system, {"role": "user", "content": q}], "max_tokens": 8, "temperature": 0}).json()
    before = server.wait_idle()
    first = ask("Name a river in France.")
    mid = server.wait_idle()
    again = ask("Name a river in France.")
    other = ask("Name a mountain in Italy.")
    after = server.wait_idle()
    hit = lambda m: m.get("genserve_prefix_cache_hit_tokens_total", 0.0)  # noqa: E731
    assert hit(mid) == hit(before)                       # the first computed everything
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 256
    # Each later request took the whole 64-token pieces of the shared part.
    assert hit(after) - hit(mid) >= 2 * ((prompt_tokens - 16) // 64 * 64 - 64)
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert other["usage"]["prompt_tokens"] > 256
    assert after["genserve_kv_blocks_free"] == after["genserve_kv_blocks_capacity"]
