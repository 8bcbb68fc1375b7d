"""Prefix-aware routing across engine replicas: one replica, two with least request, two with
prefix affinity (Envoy's consistent hashing with bounded load), on a multi-turn chat trace.

Run from the repository root::

    python -m benchmarks.routing [--conversations 16] [--turns 4] [--json PATH]

Each of the three runs starts `genserve serve` (Envoy in front; `--replicas 2` gives each engine
half the cores, as it does by default) and sends the same trace: `--conversations` chats running
concurrently, each with its own system prompt (≈ 500–800 tokens of seeded words) and `--turns`
user turns; turn k sends the system prompt, the earlier turns with the answers the server gave,
and a new user message, streamed, `--max-tokens` answer tokens at temperature 0. The runs:

  one         `--replicas 1`
  least       `--replicas 2 --no-prefix-affinity` (every call balanced by least request)
  affinity    `--replicas 2` (the bridge's prefix routing key, Envoy's MAGLEV with bounded load)

Per run, from the engines' metrics (differences across the trace, per `replica` label): the hit
ratio (prefix-cache hit tokens ÷ queried prompt tokens) and each replica's share of the finished
requests; from the client: TTFT of turns 2 and later (p50, p90) and of first turns (p50).

`simulate` models the same trace on N replicas without running it (least request as a random
pick among the least busy, affinity as Envoy's bounded-load consistent hashing) for the 8-replica
estimate in docs/benchmarks/routing.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import random
import sys
import time

import httpx

from loadgen import stats
from loadgen.live_server import LiveServer

RUNS = (                                    # (name, genserve serve flags)
    ("one", ("--replicas", "1")),
    ("least", ("--replicas", "2", "--no-prefix-affinity")),
    ("affinity", ("--replicas", "2")),
)
WORDS = tuple(("the of and to in is was for on with as by at from that this which it be are an or have "
         "not they his her their one all were when there can more would been has will other about "
         "many some time these two may then do first any my now such like our over man me even most "
         "made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own "
         "see men work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three").split())
HIT = "genserve_prefix_cache_hit_tokens_total"
QUERIED = "genserve_prefix_cache_queried_tokens_total"
FINISHED = "genserve_requests_finished_total"


def system_prompt(conversation: int, seed: int) -> str:
    """Conversation `conversation`'s own system prompt: 420–640 seeded words (≈ 500–800 tokens)."""
    rng = random.Random(f"{seed}-system-{conversation}")
    words = [rng.choice(WORDS) for _ in range(rng.randint(420, 640))]
    return f"You are assistant number {conversation}. " + " ".join(words)


def user_message(conversation: int, turn: int, seed: int) -> str:
    """The user's message of turn `turn` (0-based): about 20 seeded words."""
    rng = random.Random(f"{seed}-user-{conversation}-{turn}")
    return f"Question {turn + 1}: " + " ".join(rng.choice(WORDS) for _ in range(20)) + "?"


async def one_turn(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """One streamed chat completion; (TTFT in s, the answer's text)."""
    start = time.perf_counter()
    ttft, parts = None, []
    body = {"model": "x", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    parts.append(text)
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(parts)


async def conversation(client: httpx.AsyncClient, index: int, turns: int, max_tokens: int,
                       seed: int, delay_s: float) -> list[dict]:
    """Run conversation `index` turn after turn; one record {conversation, turn, ttft_s} a turn."""
    await asyncio.sleep(delay_s)
    messages = [{"role": "system", "content": system_prompt(index, seed)}]
    records = []
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(index, turn, seed)})
        ttft, answer = await one_turn(client, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        records.append({"conversation": index, "turn": turn, "ttft_s": ttft})
    return records


def run_trace(url: str, conversations: int, turns: int, max_tokens: int, seed: int,
              stagger_s: float) -> list[dict]:
    """Every conversation at once (the i-th starting i × `stagger_s` s late); the turn records."""
    async def go():
        limits = httpx.Limits(max_connections=conversations + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
            done = await asyncio.gather(*(conversation(client, i, turns, max_tokens, seed, i * stagger_s)
                                          for i in range(conversations)))
        return [r for records in done for r in records]
    return asyncio.run(go())


def by_replica(metrics: dict[str, float], name: str) -> dict[str, float]:
    """A counter's value per `replica` label ("0" when the engines are not labelled), summed
    over its other labels."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == name or key.startswith(name + "{"):
            labels = dict(p.split("=", 1) for p in key[len(name) + 1:-1].split(",") if "=" in p)
            replica = labels.get("replica", "0")
            out[replica] = out.get(replica, 0.0) + value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """after − before, per key of `after`."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def summarize(records: list[dict], before: dict[str, float], after: dict[str, float]) -> dict:
    """The run's figures: hit ratio, per-replica hit ratio and share, TTFT percentiles (ms)."""
    hit = delta(by_replica(after, HIT), by_replica(before, HIT))
    queried = delta(by_replica(after, QUERIED), by_replica(before, QUERIED))
    finished = delta(by_replica(after, FINISHED), by_replica(before, FINISHED))
    total = sum(finished.values()) or 1.0
    later = [r["ttft_s"] for r in records if r["turn"] > 0]
    first = [r["ttft_s"] for r in records if r["turn"] == 0]
    ms = lambda values, q: 1000 * stats.percentiles(values, (q,))[f"p{q}"]     # noqa: E731
    return {
        "turns": len(records),
        "hit_tokens": sum(hit.values()), "queried_tokens": sum(queried.values()),
        "hit_ratio": sum(hit.values()) / max(1.0, sum(queried.values())),
        "replicas": {r: {"requests": finished.get(r, 0.0), "share": finished.get(r, 0.0) / total,
                         "hit_ratio": hit.get(r, 0.0) / max(1.0, queried.get(r, 0.0))}
                     for r in sorted(finished)},
        "later_ttft_p50_ms": ms(later, 50), "later_ttft_p90_ms": ms(later, 90),
        "first_ttft_p50_ms": ms(first, 50),
    }


# ---- the model of the same trace on N replicas -------------------------------------------------

def bounded_load_pick(order: list[int], active: list[int], factor_pct: int) -> int:
    """Envoy's bounded-load choice: the first replica of `order` (the key's hash order) whose
    active requests do not exceed its slots, ceil(ceil((total + 1) × factor / 100) / N)
    (Envoy's `isHostOverloaded`: overloaded when active > slots)."""
    n = len(active)
    total_slots = ((sum(active) + 1) * factor_pct + 99) // 100
    slots = max(1, -(-total_slots // n))
    for replica in order:
        if active[replica] <= slots:
            return replica
    return order[0]


def simulate(replicas: int, conversations: int, turns: int, system_tokens: list[int],
             turn_tokens: int, policy: str, factor_pct: int = 125, seed: int = 0,
             piece: int = 64) -> float:
    """Expected hit ratio of the trace on `replicas` replicas with unbounded caches.

    Turns run in rounds (every conversation's turn k together, as in the closed-loop trace);
    within a round each request is placed while the earlier ones of the round are active.
    `least`: a random replica among those with the fewest active requests; `affinity`: the
    conversation's hash order with Envoy's bounded load. A request hits the longest prefix of its
    prompt that an earlier turn of its conversation computed on the same replica, in whole
    `piece`-token prefill pieces (the engine caches a prompt's whole pieces only, never the
    generated tokens, and always computes the last prompt token).
    Token counts: `system_tokens[i]` for conversation i's system prompt, `turn_tokens` per
    user message + answer. Returns hit tokens ÷ prompt tokens.
    """
    rng = random.Random(seed)
    cached: list[dict[int, int]] = [dict() for _ in range(replicas)]   # conv -> tokens cached
    hit = queried = 0
    for turn in range(turns):
        active = [0] * replicas
        for conv in rng.sample(range(conversations), conversations):
            prompt = system_tokens[conv] + turn * turn_tokens + turn_tokens // 2
            if policy == "least":
                low = min(active)
                replica = rng.choice([r for r in range(replicas) if active[r] == low])
            else:
                digest = hashlib.blake2b(f"{conv}".encode(), digest_size=8).digest()
                start = int.from_bytes(digest, "little") % replicas
                order = [(start + i) % replicas for i in range(replicas)]
                replica = bounded_load_pick(order, active, factor_pct)
            active[replica] += 1
            hit += min(cached[replica].get(conv, 0), (prompt - 1) // piece * piece)
            queried += prompt
            cached[replica][conv] = max(cached[replica].get(conv, 0), prompt // piece * piece)
    return hit / queried


def simulated_table(replica_counts: tuple[int, ...] = (1, 2, 8), conversations_per_replica: int = 8,
                    turns: int = 4, system_range: tuple[int, int] = (450, 700), turn_tokens: int = 70,
                    factors: tuple[int, ...] = (125, 150), seeds: int = 40) -> list[dict]:
    """`simulate` averaged over `seeds` traces for each replica count: conversations
    `conversations_per_replica` × N (and 16 when that differs), system prompts drawn from
    `system_range` tokens (450–700 reproduces the measured one-replica hit ratio), least request
    and affinity at each hash balance factor; one dict per (N, conversations)."""
    rows = []
    for n in replica_counts:
        for conversations in sorted({16, conversations_per_replica * n}):
            def mean(policy: str, factor: int = 125) -> float:
                total = 0.0
                for seed in range(seeds):
                    rng = random.Random(seed)
                    system = [rng.randint(*system_range) for _ in range(conversations)]
                    total += simulate(n, conversations, turns, system, turn_tokens, policy, factor, seed)
                return total / seeds
            rows.append({"replicas": n, "conversations": conversations, "least": mean("least"),
                         **{f"affinity_{f}": mean("affinity", f) for f in factors}})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with --simulate, print the model's table); prints a Markdown table
    and writes --json. Returns 0. Raises RuntimeError when a server does not start."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens a turn")
    p.add_argument("--stagger-s", type=float, default=0.1, help="start of conversation i: i × this")
    p.add_argument("--kv-pool-gib", type=float, default=1.0, help="each replica's KV pool")
    p.add_argument("--hash-balance-factor", type=int, default=125,
                   help="the affinity run's bounded load (genserve serve --hash-balance-factor)")
    p.add_argument("--runs", default=",".join(name for name, _ in RUNS), help="which runs, comma-separated")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=pathlib.Path, help="also write the figures as JSON here")
    p.add_argument("--simulate", action="store_true",
                   help="print the model's hit ratios for 1, 2 and 8 replicas (no server) and exit")
    opts = p.parse_args(argv)
    if opts.simulate:
        rows = simulated_table()
        one = {r["conversations"]: r["least"] for r in rows if r["replicas"] == 1}
        print("| replicas | conversations | least request | affinity (factor 125) | affinity (150) |")
        print("|---:|---:|---:|---:|---:|")
        for r in rows:
            base = one.get(r["conversations"], one[16])
            print(f"| {r['replicas']} | {r['conversations']} | {r['least']:.3f} ({r['least'] / base:.2f}×) | "
                  f"{r['affinity_125']:.3f} ({r['affinity_125'] / base:.2f}×) | "
                  f"{r['affinity_150']:.3f} ({r['affinity_150'] / base:.2f}×) |")
        return 0
    load_start = os.getloadavg()[0]
    results: dict[str, dict] = {}
    for name in opts.runs.split(","):
        extra = [*dict(RUNS)[name], "--kv-pool-gib", f"{opts.kv_pool_gib:g}"]
        if name == "affinity":
            extra += ["--hash-balance-factor", str(opts.hash_balance_factor)]
        with LiveServer(queue_budget_s=1e6, extra_args=extra) as server:
            run_trace(server.url, 2, 1, 4, opts.seed + 1000, 0.0)        # warm-up, other prompts
            server.wait_idle()
            before = server.metrics()
            start = time.monotonic()
            records = run_trace(server.url, opts.conversations, opts.turns, opts.max_tokens, opts.seed,
                                opts.stagger_s)
            wall = time.monotonic() - start
            after = server.wait_idle()
            results[name] = {**summarize(records, before, after), "wall_s": wall, "argv": extra}
            print(f"[routing] {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    out = {"conversations": opts.conversations, "turns": opts.turns, "max_tokens": opts.max_tokens,
           "kv_pool_gib": opts.kv_pool_gib, "results": results,
           "loadavg_1min": [load_start, os.getloadavg()[0]]}
    print(f"{opts.conversations} conversations × {opts.turns} turns, {opts.max_tokens}-token answers, "
          f"load average {load_start:.1f} → {os.getloadavg()[0]:.1f}")
    print("| run | hit ratio | later-turn TTFT p50 / p90 ms | first-turn TTFT p50 ms | requests per replica | wall s |")
    print("|---|---:|---|---:|---|---:|")
    for name, s in results.items():
        shares = " / ".join(f"{v['requests']:.0f} ({v['share']:.0%})" for v in s["replicas"].values())
        print(f"| {name} | {s['hit_ratio']:.3f} | {s['later_ttft_p50_ms']:,.0f} / {s['later_ttft_p90_ms']:,.0f} | "
              f"{s['first_ttft_p50_ms']:,.0f} | {shares} | {s['wall_s']:.0f} |")
    if opts.json:
        opts.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
