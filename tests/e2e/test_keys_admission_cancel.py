"""API keys, 429 admission, deadlines and mass disconnects against live servers."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.e2e.conftest import KEYED_MAX_BODY_BYTES, sse_events

PROMPT = "The capital of France is"
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}


def test_unknown_or_missing_key_is_401_before_any_work(keyed_server):
    before = keyed_server.metrics()
    for headers in ({"Authorization": "Bearer nope"}, {}):
        reply = httpx.post(f"{keyed_server.base_url}/v1/completions", headers=headers,
                           json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert reply.status_code == 401
        assert "authorization" in reply.json()["error"]["message"]
    after = keyed_server.metrics()
    assert after["genserve_requests_rejected_total{code=401}"] == before["genserve_requests_rejected_total{code=401}"] + 2
    assert after["genserve_steps_total"] == before["genserve_steps_total"]
    ok = httpx.post(f"{keyed_server.base_url}/v1/completions", headers=ALICE,
                    json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert ok.status_code == 200


def test_serve_passes_the_body_limit_to_the_bridge(keyed_server):
    url = f"{keyed_server.base_url}/v1/completions"
    big = {"prompt": "a " * KEYED_MAX_BODY_BYTES, "max_tokens": 1}             # > the limit
    reply = httpx.post(url, headers=ALICE, json=big, timeout=30)
    assert reply.status_code == 413 and str(KEYED_MAX_BODY_BYTES) in reply.json()["error"]["message"]
    small = {"prompt": "a " * (KEYED_MAX_BODY_BYTES // 4), "max_tokens": 1}      # under it: not a 413
    assert httpx.post(url, headers=ALICE, json=small, timeout=60).status_code != 413


async def _post_async(url: str, content) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(url, headers={**ALICE, "content-type": "application/json"}, content=content)


def test_a_body_of_any_size_over_the_limit_gets_the_413_through_envoy(keyed_server):
    # An async client writes its whole body before it reads: the answer must wait for the body,
    # or the client sees a reset. 20 MB with a Content-Length, and a chunked one without.
    url = f"{keyed_server.base_url}/v1/completions"
    expected = {"error": {"message": f"request body is larger than {KEYED_MAX_BODY_BYTES} bytes",
                          "type": "invalid_request_error", "code": "payload_too_large", "param": None}}

    async def chunks():
        for _ in range(200):
            yield b" " * 100_000

    for content in (b"{" + b" " * 20_000_000 + b"}", chunks()):
        reply = asyncio.run(_post_async(url, content))
        assert reply.status_code == 413 and reply.json() == expected


def test_delete_with_another_key_is_404_and_the_stream_goes_on(keyed_server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{keyed_server.base_url}/v1/completions", headers=ALICE, json=body,
                      timeout=120) as r:
        lines = r.iter_lines()
        first = next(ev for ev in map(str, lines) if ev.startswith("data:"))
        request_id = first.split('"request_id":"')[1].split('"')[0]
        reply = httpx.delete(f"{keyed_server.base_url}/v1/requests/{request_id}", headers=BOB, timeout=10)
        assert reply.status_code == 404
        rest = sse_events(lines)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["finish_reason"] == "length" and rest[-2]["usage"]["completion_tokens"] == 24


async def _burst(base_url: str, n: int) -> list[httpx.Response]:
    """`n` simultaneous 1,000-token prompts, each with its own first token (and new ones on each
    call), so that no prompt is in the prefix cache and each costs its whole prefill."""
    body = [(17 * i) % 20000 + 100 for i in range(1, 1000)]
    first = 20000 + time.monotonic_ns() // 1000 % 10000
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(
            client.post(f"{base_url}/v1/completions", headers=ALICE,
                        json={"prompt_token_ids": [first + k] + body, "max_tokens": 4, "temperature": 0})
            for k in range(n)))


def test_a_burst_past_the_budget_gets_429_with_retry_after_and_nothing_is_lost(keyed_server):
    keyed_server.wait_idle()
    before = keyed_server.metrics()
    replies = asyncio.run(_burst(keyed_server.base_url, 16))
    codes = [r.status_code for r in replies]
    ok = [r for r in replies if r.status_code == 200]
    rejected = [r for r in replies if r.status_code == 429]
    assert ok and rejected and len(ok) + len(rejected) == 16, codes
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"]
    for r in ok:
        assert r.json()["choices"][0]["finish_reason"] == "length"
    after = keyed_server.wait_idle()
    finished = sum(after[k] - before[k] for k in after if k.startswith("genserve_requests_finished_total"))
    assert finished == len(ok)
    assert after["genserve_requests_rejected_total{code=429}"] - before["genserve_requests_rejected_total{code=429}"] == len(rejected)
    assert after["genserve_kv_blocks_free"] == after["genserve_kv_blocks_capacity"]


def test_a_request_past_its_deadline_ends_cancelled_with_reason_deadline(server):
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "deadline_s": 0.5}
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "cancelled"
    assert reply.json()["usage"]["completion_tokens"] < 1000
    assert "deadline" in reply.text


async def _streams_with_disconnects(base_url: str, n: int, disconnect_every: int) -> list:
    async def one(i: int):
        body = {"prompt": f"Request {i}: count to ten.", "max_tokens": 20, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=300) as client:
            async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
                seen = []
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        seen.append(line)
                        if i % disconnect_every == 0 and len(seen) == 3:
                            return ("disconnected", seen)
                return ("complete", seen)
    return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_fifth_of_50_streams_disconnect_each_costs_at_most_one_step(server):
    before = server.wait_idle()
    results = asyncio.run(_streams_with_disconnects(server.base_url, 50, 5))
    assert sum(1 for kind, _ in results if kind == "disconnected") == 10
    for kind, lines in results:
        if kind == "complete":
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    after = server.wait_idle()
    cancelled = after["genserve_cancel_extra_steps_count"] - before["genserve_cancel_extra_steps_count"]
    within_one = (after["genserve_cancel_extra_steps_bucket{le=1.0}"]
                  - before["genserve_cancel_extra_steps_bucket{le=1.0}"])
    assert cancelled == 10 and within_one == 10
    assert after["genserve_kv_blocks_free"] == after["genserve_kv_blocks_capacity"]
