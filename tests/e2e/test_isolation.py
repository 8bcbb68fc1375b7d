"""Isolation: many concurrent requests, each with a unique marker string in its prompt; no output
contains another request's marker, and every request finishes.

Size. `test_isolation` runs GENSERVE_ISOLATION_N requests (default 200). The full 1,000 is
`test_isolation_full`, marked `slow` and skipped unless GENSERVE_ISOLATION_FULL=1; it makes every
check of the 200 with five times the requests, so in a run that has it the 200 skip (unless
GENSERVE_ISOLATION_N asks for them). `.ci/run` sets that variable when the change under test
touches `engine/` or `service/` (the files `git diff --name-only` lists against origin/main when
that ref exists, else against HEAD~1; see .ci/run), so the full size runs in CI once per change
to the engine or the service, and the ordinary run stays short. Run it by hand with
`GENSERVE_ISOLATION_FULL=1 .venv/bin/python -m pytest tests/e2e/test_isolation.py`.

The prompt asks the model to repeat its marker, so most answers do contain their own marker:
a row that read another row's KV blocks, or tokens routed to the wrong stream, would show up as a
foreign marker. Half of the requests go over REST+SSE, half over gRPC. A few requests are then
sent again alone and must give the same text (greedy decoding is batch-invariant here).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import string
import time

import grpc
import httpx
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

MAX_TOKENS = 10                  # a marker is 7 tokens (" K", "Q", "Z", "W", "4", "8", "2")
DEFAULT_N = 200
FULL_N = 1000
# A queued request hears nothing until it is admitted; on a busy 2-core machine the last of 1,000
# can wait minutes (the engine's own 600 s deadline still applies).
CLIENT_TIMEOUT_S = 1800


def markers(n: int, seed: int = 4) -> list[str]:
    """n distinct markers like "KQZW482": random (4.6e8 possible), so the model cannot derive one
    from another and a garbled echo practically never spells another request's marker."""
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choices(string.ascii_uppercase, k=4)) + "".join(rng.choices(string.digits, k=3)))
    return sorted(out, key=lambda _: rng.random())


def prompt(marker: str) -> str:
    return f"Secret code: {marker}. Repeat the secret code exactly. Secret code: {marker}. The secret code is"


async def _rest(client: httpx.AsyncClient, base: str, marker: str) -> dict:
    body = {"prompt": prompt(marker), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, finish, errors, kind = [], None, [], "message"
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:") and line != "data: [DONE]":
                event = json.loads(line[5:])
                if kind == "error":
                    errors.append(event)       # shown by the assertion if the request failed
                if "token_id" in event:
                    text.append(event["text"])
                finish = event.get("finish_reason") or finish
            elif not line:
                kind = "message"
    return {"marker": marker, "text": "".join(text), "finish_reason": finish, "errors": errors,
            "status": r.status_code, "headers": dict(r.headers)}


async def _grpc(stub: pb_grpc.GenerateServiceStub, marker: str) -> dict:
    req = pb.GenerateRequest(prompt=prompt(marker), max_tokens=MAX_TOKENS, sampling=pb.SamplingParams(temperature=0.0))
    text, finish = [], None
    async for msg in stub.Generate(req, timeout=CLIENT_TIMEOUT_S):
        if msg.HasField("token"):
            text.append(msg.token.text)
        elif msg.HasField("finished"):
            finish = pb.FinishReason.Name(msg.finished.reason).removeprefix("FINISH_REASON_").lower()
    return {"marker": marker, "text": "".join(text), "finish_reason": finish}


async def _run_all(server, marks: list[str], num_alone: int = 3) -> tuple[list[dict], list[dict], float]:
    """All requests at once, then the first `num_alone` again one at a time (one event loop:
    grpc.aio keeps a poller bound to it)."""
    limits = httpx.Limits(max_connections=len(marks) + 10, max_keepalive_connections=20)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client, \
            grpc.aio.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        send = lambda i, m: _rest(client, server.base_url, m) if i % 2 == 0 else _grpc(stub, m)  # noqa: E731
        t0 = time.monotonic()
        together = await asyncio.gather(*(send(i, m) for i, m in enumerate(marks)))
        elapsed = time.monotonic() - t0
        alone = [await send(i, m) for i, m in enumerate(marks[:num_alone])]
    return together, alone, elapsed


def check_isolation(server, n: int) -> None:
    server.wait_idle()
    marks = markers(n)
    results, alone, elapsed = asyncio.run(_run_all(server, marks))
    pattern = re.compile(r"[A-Z]{4}\d{3}")
    known = set(marks)
    own = 0
    for res in results:
        assert res["finish_reason"] in ("length", "stop"), res
        foreign = {m for m in pattern.findall(res["text"]) if m in known and m != res["marker"]}
        assert not foreign, f"{res['marker']}'s output has other requests' markers {foreign}: {res['text']!r}"
        own += res["marker"] in res["text"]
    print(f"\n  isolation: {n} concurrent requests in {elapsed:.1f} s; {own} answers repeat their own marker")
    assert own >= n // 4, "the prompt no longer makes the model repeat its marker; the test lost its teeth"
    # The same prompt alone gives the same answer as in the crowd.
    for crowd, single in zip(results, alone):
        assert single["text"] == crowd["text"], (single, crowd)
    m = server.wait_idle()
    assert m["genserve_kv_blocks_free"] == m["genserve_kv_blocks_capacity"]


FULL = os.environ.get("GENSERVE_ISOLATION_FULL") == "1"


@pytest.mark.skipif(FULL and "GENSERVE_ISOLATION_N" not in os.environ,
                    reason="test_isolation_full makes the same checks with 1,000 requests in this run")
def test_isolation(server):
    check_isolation(server, int(os.environ.get("GENSERVE_ISOLATION_N", DEFAULT_N)))


@pytest.mark.slow
@pytest.mark.skipif(not FULL,
                    reason="the full 1,000: set GENSERVE_ISOLATION_FULL=1 (.ci/run does when engine/ or service/ changed)")
def test_isolation_full(server):
    check_isolation(server, FULL_N)
