"""Prefix caching, live: multi-turn chats that share a long system prompt, with and without the cache.

Run from the repository root::

    python -m benchmarks.prefix_cache [--users 20] [--turns 4] [--system-tokens 1000]
                                      [--answer-tokens 32] [--stagger-s 0.5] [--json PATH]

Starts `genserve serve --no-envoy` on the embedded model twice per trace, once with prefix caching
(the default) and once with `--no-prefix-caching`, and replays the same two traces against each:

* chat: `users` users, user i starting `i × stagger_s` seconds in, each holding a `turns`-turn
  conversation through POST /v1/chat/completions (stream, temperature 0, `answer_tokens` tokens
  with ignore_eos). Every conversation opens with the same ≈ `system_tokens`-token system
  prompt; turn k sends the whole conversation so far (system, the user's earlier messages and
  the assistant's earlier answers) plus a new user message, as chat clients do. With the cache,
  a request computes only what no earlier request computed: the user's new message and the
  previous answer.
* distinct: the same requests, shapes and arrival times, but every request's system prompt opens
  with its own ticket number, so no prompt shares even its first block with another (not even the
  same user's earlier turns): the cache's bookkeeping without any hit, to show it costs no
  throughput.

Reported per run: TTFT p50/p95 (client-side, request sent to first content chunk), output
tokens/s over the run (tokens received / wall time from the first request to the last answer),
and the engine's prefix-cache counters (tokens queried, tokens hit). Both servers run on this
machine in the same invocation, one after the other, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import platform
import statistics
import time

import httpx

from loadgen.live_server import LiveServer

SYSTEM_SENTENCE = ("You are the support assistant of a company that makes bicycles, e-bikes and "
                   "their spare parts; answer politely, precisely, and cite the manual section. ")
TOPICS = ["brakes", "gears", "battery", "tyres", "saddle", "chain", "lights", "frame", "warranty",
          "delivery", "pedals", "display", "charger", "lock", "helmet", "bell", "rack", "mudguard",
          "suspension", "motor", "spokes", "handlebar", "grips", "kickstand"]


def system_prompt(tokens: int) -> str:
    """A system prompt of about `tokens` tokens (the sentence is ≈ 30 tokens)."""
    return "".join(f"{SYSTEM_SENTENCE}Section {i}. " for i in range(max(1, tokens // 32)))


def user_message(user: int, turn: int, distinct: bool) -> str:
    """The user's message of `turn` (a distinct prefix per request when `distinct`)."""
    head = f"Ticket {user * 100 + turn}: " if distinct else ""
    return (f"{head}Question {turn + 1} from customer {user}: my {TOPICS[(user + turn) % len(TOPICS)]} "
            f"makes a strange noise after {turn + 2} weeks; what should I check first?")


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], answer_tokens: int
                      ) -> tuple[float, str, int]:
    """Stream one chat completion; returns (TTFT s, answer text, tokens received)."""
    body = {"messages": messages, "max_tokens": answer_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat completion failed: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if "content" in delta and "role" not in delta and choice.get("finish_reason") is None:
                    tokens += 1
                    text.append(delta["content"])
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no token arrived")
    return ttft, "".join(text), tokens


async def conversation(client: httpx.AsyncClient, url: str, user: int, args: argparse.Namespace,
                       system: str, distinct: bool, out: list[dict]) -> None:
    """One user's `turns` turns, each after the previous answer arrived."""
    await asyncio.sleep(user * args.stagger_s)
    messages = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        if distinct:        # no shared prefix: every request's first line is its own
            messages[0] = {"role": "system", "content": f"Ticket {user * 100 + turn}. {system}"}
        messages.append({"role": "user", "content": user_message(user, turn, distinct)})
        ttft, answer, tokens = await one_request(client, url, messages, args.answer_tokens)
        out.append({"user": user, "turn": turn, "ttft_s": ttft, "tokens": tokens})
        messages.append({"role": "assistant", "content": answer})


def run_trace(url: str, args: argparse.Namespace, distinct: bool) -> dict:
    """Replay one trace against the server at `url`; returns its figures."""
    system = system_prompt(args.system_tokens)
    records: list[dict] = []

    async def go() -> float:
        limits = httpx.Limits(max_connections=args.users * 2)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(conversation(client, url, u, args, system, distinct, records)
                                   for u in range(args.users)))
            return time.perf_counter() - t0

    wall = asyncio.run(go())
    ttfts = sorted(r["ttft_s"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "wall_s": round(wall, 2), "tokens": tokens,
            "tok_s": round(tokens / wall, 1),
            "ttft_ms_p50": round(statistics.median(ttfts) * 1000, 1),
            "ttft_ms_p95": round(ttfts[int(0.95 * (len(ttfts) - 1))] * 1000, 1),
            "ttft_ms_p50_by_turn": [round(statistics.median(r["ttft_s"] for r in records
                                                            if r["turn"] == t) * 1000, 1)
                                    for t in range(args.turns)]}


def measure(cache: bool, args: argparse.Namespace) -> dict:
    """Both traces against one fresh server with or without the prefix cache."""
    extra = ["--no-envoy", "--prefix-caching" if cache else "--no-prefix-caching"]
    out = {}
    with LiveServer(queue_budget_s=1e6, extra_args=extra) as server:
        for name, distinct in (("chat", False), ("distinct", True)):
            before = server.wait_idle()
            out[name] = run_trace(server.url, args, distinct)
            after = server.wait_idle()
            out[name]["prefix_cache_queried_tokens"] = (after.get("genserve_prefix_cache_queried_tokens_total", 0)
                                                       - before.get("genserve_prefix_cache_queried_tokens_total", 0))
            out[name]["prefix_cache_hit_tokens"] = (after.get("genserve_prefix_cache_hit_tokens_total", 0)
                                                    - before.get("genserve_prefix_cache_hit_tokens_total", 0))
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison, print it, and write the JSON (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--stagger-s", type=float, default=0.5)
    p.add_argument("--json", type=pathlib.Path, default=pathlib.Path("docs/benchmarks/prefix_cache_cpu.json"))
    args = p.parse_args(argv)
    result = {"host": platform.node(), "machine": platform.machine(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    result["with_cache"] = measure(True, args)
    result["without_cache"] = measure(False, args)
    w, wo = result["with_cache"], result["without_cache"]
    result["ratios"] = {
        "chat_ttft_p50_without_over_with": round(wo["chat"]["ttft_ms_p50"] / w["chat"]["ttft_ms_p50"], 2),
        "chat_ttft_p95_without_over_with": round(wo["chat"]["ttft_ms_p95"] / w["chat"]["ttft_ms_p95"], 2),
        "chat_tok_s_with_over_without": round(w["chat"]["tok_s"] / wo["chat"]["tok_s"], 3),
        "distinct_tok_s_with_over_without": round(w["distinct"]["tok_s"] / wo["distinct"]["tok_s"], 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
