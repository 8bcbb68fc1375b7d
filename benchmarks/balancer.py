"""Envoy's engine balancer, least request against round robin, on two local engine replicas.

Run from the repository root::

    python -m benchmarks.balancer [--rates 0.5,1,1.5] [--duration 40] [--json PATH]

For each policy (`LEAST_REQUEST`, then `ROUND_ROBIN`) it starts `genserve serve --replicas 2
--lb-policy POLICY` (Envoy in front, two engine processes with half the cores each, small KV
pools) and sends the same skewed open-loop trace at each rate: Poisson arrivals, one in five from
key `heavy` with a long prompt (`--heavy-prompt`, 1,024 tokens) and a short answer, the rest from
key `light` with a short prompt and answer (32 + 32 tokens). A heavy prompt's prefill holds its
replica for many steps; round robin still sends every second light request there, least request
sends it to the replica with fewer open streams. Per policy and rate it prints TTFT p50/p95 (all,
and the light key's), TPOT p50, and the share of requests meeting TTFT ≤ `--slo-ttft-ms` and
TPOT ≤ `--slo-tpot-ms`; goodput is the highest rate where that share is ≥ 95 %.

Everything (client, Envoy, bridge, both engines) shares this machine's cores, and the rates must be
ones the two replicas sustain, else both policies only measure a growing queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys

from loadgen import stats
from loadgen.clients import RestClient, run_open_loop
from loadgen.live_server import LiveServer
from loadgen.workload import WorkItem, arrival_times

POLICIES = ("LEAST_REQUEST", "ROUND_ROBIN")
HEAVY_EVERY = 5                  # one request in five is the heavy key's
LIGHT_PROMPT, LIGHT_OUTPUT, HEAVY_OUTPUT = 32, 32, 16


def skewed_trace(rate: float, duration_s: float, heavy_prompt: int, seed: int) -> list[WorkItem]:
    """Poisson arrivals at `rate` requests/s for `duration_s` s; every HEAVY_EVERY-th is key
    "heavy" (`heavy_prompt` prompt tokens, HEAVY_OUTPUT output), the others key "light"."""
    items = []
    for i, t in enumerate(arrival_times(rate, duration_s=duration_s, seed=seed)):
        heavy = i % HEAVY_EVERY == HEAVY_EVERY - 1
        items.append(WorkItem(index=i, arrival_s=float(t), api_key="heavy" if heavy else "light",
                              prompt_tokens=heavy_prompt if heavy else LIGHT_PROMPT,
                              output_tokens=HEAVY_OUTPUT if heavy else LIGHT_OUTPUT))
    return items


def run_trace(url: str, items: list[WorkItem], prefix: str) -> list[stats.RequestRecord]:
    """Send `items` open-loop to the server at `url`; one record per item."""
    async def go():
        client = RestClient(url, timeout_s=600.0)
        try:
            return await run_open_loop(items, client, request_prefix=prefix, drain_timeout_s=300.0)
        finally:
            await client.aclose()
    return asyncio.run(go())


def summarize(records: list[stats.RequestRecord], slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """TTFT/TPOT percentiles (ms), the light key's TTFT, SLO attainment and failures."""
    def ms(values, q):
        p = stats.percentiles([v for v in values if v is not None], (q,))
        return None if p[f"p{q}"] is None else 1000 * p[f"p{q}"]
    light = [r for r in records if r.api_key == "light"]
    return {"requests": len(records), "completed": sum(r.completed for r in records),
            "ttft_p50_ms": ms((r.ttft_s for r in records), 50), "ttft_p95_ms": ms((r.ttft_s for r in records), 95),
            "light_ttft_p95_ms": ms((r.ttft_s for r in light), 95),
            "tpot_p50_ms": ms((r.tpot_s for r in records), 50),
            "slo_attainment": stats.slo_attainment(records, slo_ttft_ms, slo_tpot_ms)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.balancer", description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="0.5,1,1.5", help="arrival rates, requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    p.add_argument("--heavy-prompt", type=int, default=1024, help="prompt tokens of the heavy key")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0, help="TTFT target (docs/design.md: 3 s)")
    p.add_argument("--slo-tpot-ms", type=float, default=70.0, help="TPOT target (docs/design.md: 70 ms)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=pathlib.Path, help="also write the figures as JSON here")
    opts = p.parse_args(argv)
    rates = [float(r) for r in opts.rates.split(",")]
    load_start = os.getloadavg()[0]
    results: dict[str, dict[str, dict]] = {}
    for policy in POLICIES:
        extra = ["--replicas", "2", "--lb-policy", policy, "--kv-pool-gib", "0.25"]
        with LiveServer(queue_budget_s=1e6, extra_args=extra) as server:
            run_trace(server.url, skewed_trace(2.0, 3.0, 64, opts.seed), f"warm-{policy}-")
            results[policy] = {}
            for rate in rates:
                records = run_trace(server.url, skewed_trace(rate, opts.duration, opts.heavy_prompt, opts.seed),
                                    f"{policy}-{rate:g}-")
                results[policy][f"{rate:g}"] = summarize(records, opts.slo_ttft_ms, opts.slo_tpot_ms)
                print(f"[balancer] {policy} at {rate:g} req/s: {results[policy][f'{rate:g}']}",
                      file=sys.stderr, flush=True)
    out = {"rates": rates, "duration_s": opts.duration, "heavy_prompt": opts.heavy_prompt,
           "slo_ttft_ms": opts.slo_ttft_ms, "slo_tpot_ms": opts.slo_tpot_ms, "results": results,
           "goodput_rps": {pol: stats.goodput((float(r), s["slo_attainment"]) for r, s in res.items())
                           for pol, res in results.items()},
           "loadavg_1min": [load_start, os.getloadavg()[0]]}
    print(f"Two engine replicas behind Envoy, skewed trace (1 in {HEAVY_EVERY} requests a "
          f"{opts.heavy_prompt}-token prompt), {opts.duration:g} s per rate, SLO TTFT ≤ "
          f"{opts.slo_ttft_ms:g} ms and TPOT ≤ {opts.slo_tpot_ms:g} ms, load average "
          f"{load_start:.1f} → {os.getloadavg()[0]:.1f}")
    print("| policy | req/s | done | TTFT p50 / p95 ms | light key TTFT p95 ms | TPOT p50 ms | SLO met |")
    print("|---|---:|---:|---|---:|---:|---:|")
    fmt = lambda x: "–" if x is None else f"{x:,.0f}"                              # noqa: E731
    for policy, res in results.items():
        for rate, s in res.items():
            print(f"| {policy} | {rate} | {s['completed']} / {s['requests']} | {fmt(s['ttft_p50_ms'])} / "
                  f"{fmt(s['ttft_p95_ms'])} | {fmt(s['light_ttft_p95_ms'])} | {fmt(s['tpot_p50_ms'])} | "
                  f"{s['slo_attainment']:.1%} |")
    for policy, g in out["goodput_rps"].items():
        print(f"goodput {policy}: {'none of the rates' if g is None else f'{g:g} req/s'}")
    if opts.json:
        opts.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
