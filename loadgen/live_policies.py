"""Two configurations of the step policy on the live server, in one run, with the simulator's error
for each, one command:

    .venv/bin/python -m loadgen.live_policies --out docs/benchmarks/scheduler/live_policies

1. **Measure and fit** this machine's step times as `loadgen.calibrate` does (`measure_grid`, whose
   grid includes 32 rows at ≈ 1,500-token contexts for the attention term; `fit_cost_model`), or
   load a fitted model with `--cost-model`.
2. **SLOs** for this machine from the design's ratios (`calibrate.cpu_slo_ms`): TTFT and TPOT; the
   longest-gap target is TPOT × 100 / 70 (the design scale's 100 ms against its 70 ms).
3. **Live**: for each configuration in turn, start `genserve serve` (REST+SSE, queue budget 60 s as in the
   recorded live goodput, so nothing is refused), warm it up (the engine refits its cost model from
   its own steps every 256 steps), send the same open-loop workloads (the design mix scaled by
   `--scale`, Poisson, seed 0) at each rate, read the engine's predicted-vs-measured step-time
   histogram, stop it. The configurations (`StepBudget`, `engine.core.sched.step_budget`):
   - "caps": `--tpot-target-ms 1 --gap-target-ms 1`: no step is predicted within 1 ms, so the
     design's token caps alone size each step's prefill;
   - "default": the caps plus the prefill the engine's TPOT and gap targets leave room for, the
     targets at `--target-fraction` of the client-side TPOT and gap targets, leaving the rest to the
     request path (bridge, SSE, client) that shares the cores.
4. **Simulate** the same items under each configuration with the fitted model plus the two live-path
   terms `loadgen.calibrate` uses (a time added to every step and a request-path delay), both fitted on
   "caps" at the lowest rate (on the first configuration run when "caps" is not); report
   simulated / live − 1 for TTFT and TPOT p50 / p95 and goodput.

Writes `results.json` and `summary.md` under `--out`. Goodput is the highest rate at which ≥ 95 %
of requests meet TTFT and TPOT, every lower rate too; *+ gap* also asks the run's p99 longest gap to
be within its target. Needs a quiet machine: every number is wall-clock time on shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

from engine.config import CAPS_ALONE
from loadgen import stats as st
from loadgen.workload import LengthMix, WorkItem, arrival_times, synthetic_workload

POLICIES = ("caps", "default")      # configurations of the one step policy (`_targets`)
DEFAULT_RATES = (2.0, 3.0, 4.0, 5.0, 6.0)
GAP_OVER_TPOT = 100.0 / 70.0          # the design scale's gap target over its TPOT target
QUEUE_BUDGET_S = 60.0
WARMUP_S = 20.0


def _targets(policy: str, tpot_ms: float, gap_ms: float, fraction: float) -> tuple[float, float]:
    """The engine's (tpot_target_ms, gap_target_ms) under configuration `policy` of `POLICIES`:
    1 ms each for "caps" (the time budget then adds nothing to the token caps); for "default",
    `fraction` of the client-side targets `tpot_ms` and `gap_ms`, to 0.01 ms."""
    if policy == "caps":
        targets = dict(CAPS_ALONE)
        return targets["tpot_target_ms"], targets["gap_target_ms"]
    if policy == "default":
        return round(tpot_ms * fraction, 2), round(gap_ms * fraction, 2)
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def _target_args(policy: str, tpot_ms: float, gap_ms: float, fraction: float) -> list[str]:
    """`genserve serve` flags of configuration `policy` (the targets of `_targets`)."""
    tpot, gap = _targets(policy, tpot_ms, gap_ms, fraction)
    text = lambda x: f"{x:.2f}".rstrip("0").rstrip(".")  # noqa: E731
    return ["--tpot-target-ms", text(tpot), "--gap-target-ms", text(gap)]


def _ratio(metrics: dict[str, float]) -> dict[str, float | None]:
    """Mean measured / predicted step time and its sample count, from genserve_step_time_ratio."""
    total = sum(v for k, v in metrics.items() if k.startswith("genserve_step_time_ratio_sum"))
    count = sum(v for k, v in metrics.items() if k.startswith("genserve_step_time_ratio_count"))
    return {"mean": total / count if count else None, "steps": count}


def run_live(policy: str, workloads: dict[float, list[WorkItem]], extra_args: Sequence[str], *, seed: int,
             scale: float, progress: bool = True) -> dict[str, Any]:
    """One server with `extra_args`, the warm-up, then every rate's items; records and ratios per rate."""
    from loadgen.clients import RestClient, run_open_loop
    from loadgen.live_server import LiveServer

    mix = LengthMix.design(scale)
    out: dict[str, Any] = {"records": {}, "ratio": {}, "argv": None}
    with LiveServer(QUEUE_BUDGET_S, extra_args, start_timeout_s=900.0) as server:
        out["argv"] = server.argv
        low = min(workloads)
        warm = synthetic_workload(arrival_times(low, duration_s=WARMUP_S, seed=seed + 1), mix, seed=seed + 1)

        async def go(items: list[WorkItem], prefix: str) -> list[st.RequestRecord]:
            client = RestClient(server.url, timeout_s=600.0, seed=seed, prompt_seed=seed)
            try:
                return await run_open_loop(items, client, drain_timeout_s=300.0, request_prefix=prefix)
            finally:
                await client.aclose()

        if progress:
            print(f"  {policy}: warm-up, {len(warm)} requests", file=sys.stderr, flush=True)
        asyncio.run(go(warm, f"{policy}-warm-"))
        before = _ratio(server.wait_idle())
        for rate, items in workloads.items():
            if progress:
                print(f"  {policy}: {len(items)} requests at {rate:g} req/s", file=sys.stderr, flush=True)
            out["records"][rate] = asyncio.run(go(items, f"{policy}{rate:g}-"))
            after = _ratio(server.wait_idle())
            steps = after["steps"] - before["steps"]
            mean = ((after["mean"] or 0) * after["steps"] - (before["mean"] or 0) * before["steps"]) / steps \
                if steps else None
            out["ratio"][rate] = {"mean": mean, "steps": steps}
            before = after
    return out


def simulate_policy(items: list[WorkItem], fields: dict[str, float], facts: dict[str, Any], config: Any,
                    *, step_overhead_ms: float = 0.0, submit_delay_s: float = 0.0) -> list[st.RequestRecord]:
    """The simulator's records for `items` under `config` with the fitted costs (+ live-path terms)."""
    from engine.core.sim_executor import SimExecutor
    from loadgen.sim import simulate

    f = {**fields, "step_base_ms": fields["step_base_ms"] + step_overhead_ms}
    sim = SimExecutor(**f, vocab_size=facts["vocab_size"], eos_token_id=facts["eos_token_id"])
    return simulate(items, config, sim, submit_delay_s=submit_delay_s).records


def fit_live_path(items: list[WorkItem], live: list[st.RequestRecord], fields: dict[str, float],
                  facts: dict[str, Any], config: Any, slo: tuple[float, float]) -> tuple[float, float]:
    """(ms added to every step, request-path delay in ms) that make the simulated TPOT p50 and TTFT
    p50 equal the live ones on `items` (bisection; `loadgen.calibrate.compare` fits the same terms)."""
    live_s = st.summarize(live, ttft_ms=slo[0], tpot_ms=slo[1])

    def tpot(ms: float) -> float:
        recs = simulate_policy(items, fields, facts, config, step_overhead_ms=ms)
        return st.summarize(recs, ttft_ms=slo[0], tpot_ms=slo[1])["tpot_ms"]["p50"] or 0.0

    target = live_s["tpot_ms"]["p50"] or 0.0
    lo, hi = 0.0, 1.0
    while tpot(hi) < target and hi < 1000.0:
        hi *= 2.0
    for _ in range(14):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if tpot(mid) < target else (lo, mid)
    overhead = (lo + hi) / 2.0
    recs = simulate_policy(items, fields, facts, config, step_overhead_ms=overhead)
    sim_ttft = st.summarize(recs, ttft_ms=slo[0], tpot_ms=slo[1])["ttft_ms"]["p50"] or 0.0
    return overhead, max(0.0, (live_s["ttft_ms"]["p50"] or 0.0) - sim_ttft)


def gap_goodput(runs: Sequence[dict[str, Any]], gap_ms: float) -> float | None:
    """Goodput that also asks each run's p99 longest gap to be within `gap_ms`."""
    return st.goodput((r["rate"], r["slo"]["attainment"] if (r["max_gap_ms"]["p99"] or 0.0) <= gap_ms else 0.0)
                      for r in runs)


def markdown(res: dict[str, Any]) -> str:
    """summary.md: the command, the SLOs, goodput per configuration, the simulator's error, every run."""
    s, _f, _pct = res["summary"], st._f, st._pct
    slo = s["slo"]
    source = ("given on the command line" if slo.get("given")
              else "scaled from the design's ratios with this run's fitted step times")
    L = ["# The step policy's configurations on the live server (this machine)", "",
         f"Regenerate (≈ {s['expected_minutes']:.0f} minutes on a quiet machine; it starts and stops its own "
         "`genserve serve` on free localhost ports):", "", "```", s["command"], "```", "",
         f"Last run {s['date']} on {res['machine']['cpus']} CPU(s), {s['wall_s'] / 60:.1f} minutes. Workload: the "
         f"design's length mix scaled by {s['scale']:g}, Poisson arrivals for {s['duration_s']:g} s per rate, seed "
         f"{s['seed']}, REST+SSE through the bridge, queue budget {QUEUE_BUDGET_S:g} s (no 429s).", "",
         f"SLOs {source}: TTFT ≤ {slo['ttft_ms']:.0f} ms, "
         f"TPOT ≤ {slo['tpot_ms']:.0f} ms, p99 longest gap ≤ {slo['gap_ms']:.0f} ms. Configurations: *caps*, "
         "the design's token caps alone (engine targets of 1 ms, within which no step is predicted); "
         "*default*, the caps plus the prefill the engine's TPOT and gap targets leave room for, the targets "
         f"at {100 * s['target_fraction']:.0f} % of the SLOs' TPOT and gap.", "",
         "| configuration | goodput | goodput + gap | sim goodput | " + " | ".join(f"SLO met at {r:g}" for r in s["rates"])
         + " | measured / predicted step (mean) |", "|---|---:|---:|---:|" + "---:|" * len(s["rates"]) + "---|"]
    for p in s["policies"]:
        g = res["policies"][p]
        L.append(f"| {p} | **{_rps(g['live_goodput_rps'])}** | {_rps(g['live_goodput_gap_rps'])} "
                 f"| {_rps(g['sim_goodput_rps'])} | "
                 + " | ".join(_pct(x["live"]["slo"]["attainment"]) for x in g["runs"]) + " | "
                 + " / ".join(_f(g["ratio"].get(f"{r:g}", {}).get("mean"), 2) for r in s["rates"]) + " |")
    lp = s["live_path"]
    L += ["", f"Simulator: the fitted cost model plus every step + {lp['step_overhead_ms']:.2f} ms and "
              f"{lp['submit_delay_ms']:.1f} ms of request path, both fitted on {lp['fit_policy']} at "
              f"{lp['fit_rate']:g} requests/s. Error = simulated / live − 1.", "",
          "| configuration | rate | metric | live | sim | error |", "|---|---:|---|---:|---:|---:|"]
    for row in s["errors"]:
        e = "–" if row["error"] is None else f"{100 * row['error']:+.1f} %"
        L.append(f"| {row['policy']} | {row['rate']:g} | {row['metric']} | {_f(row['live_ms'], 1)} ms "
                 f"| {_f(row['sim_ms'], 1)} ms | {e} |")
    for p in s["policies"]:
        err = res["policies"][p]["max_abs_error"]
        L.append("")
        L.append(f"Largest |error|, {p}: {'–' if err is None else f'{100 * err:.1f} %'}.")
    L += ["", "| configuration | rate | side | done / sent | req/s | out tok/s | TTFT p50 / p95 / p99 (ms) "
              "| TPOT p50 / p95 / p99 (ms) | max gap p50 / p95 / p99 (ms) | SLO met |",
          "|---|---:|---|---:|---:|---:|---|---|---|---:|"]
    for p in s["policies"]:
        for x in res["policies"][p]["runs"]:
            for side in ("live", "sim"):
                r = x[side]
                t = lambda k: " / ".join(_f(r[k][q], 1) for q in ("p50", "p95", "p99"))  # noqa: E731
                L.append(f"| {p} | {x['rate']:g} | {side} | {r['num_completed']} / {r['num_requests']} "
                         f"| {_f(r['throughput_rps'], 2)} | {_f(r['output_tokens_per_s'])} | {t('ttft_ms')} "
                         f"| {t('tpot_ms')} | {t('max_gap_ms')} | {_pct(r['slo']['attainment'])} |")
    L.append("")
    return "\n".join(L)


def _rps(x: float | None) -> str:
    return "none" if x is None else f"{x:g} req/s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.live_policies", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/benchmarks/scheduler/live_policies"))
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES), help="requests/s, comma separated")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    parser.add_argument("--scale", type=float, default=0.064, help="length mix scale (0.064: prompts 16..512)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="configurations of the step policy: caps, default or both, comma separated")
    parser.add_argument("--target-fraction", type=float, default=0.9,
                        help="the default configuration's engine targets this share of the client-side TPOT "
                             "and gap targets")
    parser.add_argument("--cost-model", type=pathlib.Path, default=None,
                        help="a fitted model (calibrate's cost_model_cpu.json) instead of measuring one now")
    parser.add_argument("--reps", type=int, default=3, help="repeats per grid point when measuring")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="TTFT target, ms (default: scaled from the fitted model, as calibrate does)")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="TPOT target, ms (default: scaled from the fitted model, as calibrate does)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    from engine.config import EngineConfig
    from engine.core.cost_model import CostModel
    from loadgen.calibrate import cpu_slo_ms, fit_cost_model, measure_grid
    from loadgen.sim import design_config

    t0 = time.perf_counter()
    rates = [float(x) for x in args.rates.split(",")]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if set(policies) - set(POLICIES) or not policies:
        raise SystemExit(f"--policies takes {', '.join(POLICIES)}")
    if args.cost_model is not None:
        fields, quality = CostModel.from_json(args.cost_model).params(), {"loaded_from": str(args.cost_model)}
        facts = json.loads(pathlib.Path(args.cost_model).with_name("calibration.json").read_text())["machine"] \
            if pathlib.Path(args.cost_model).with_name("calibration.json").exists() else {}
        facts = {"vocab_size": facts.get("vocab_size", 49152), "eos_token_id": facts.get("eos_token_id", 2),
                 "num_blocks": facts.get("num_blocks")}
    else:
        print("measuring step times on the real model ...", file=sys.stderr, flush=True)
        samples, facts = measure_grid(reps=args.reps, progress=args.progress)
        fields, quality = fit_cost_model(samples)
    mix = LengthMix.design(args.scale)
    ttft_ms, tpot_ms = cpu_slo_ms(fields, mix)
    ttft_ms = args.slo_ttft_ms or ttft_ms
    tpot_ms = args.slo_tpot_ms or tpot_ms
    gap_ms = tpot_ms * GAP_OVER_TPOT
    slo = (ttft_ms, tpot_ms)
    workloads = {r: synthetic_workload(arrival_times(r, duration_s=args.duration, seed=args.seed), mix, seed=args.seed)
                 for r in rates}
    live = {p: run_live(p, workloads, _target_args(p, tpot_ms, gap_ms, args.target_fraction), seed=args.seed,
                        scale=args.scale, progress=args.progress) for p in policies}
    num_blocks = facts.get("num_blocks") or EngineConfig().num_blocks or 5825
    configs = {}
    for p in policies:
        tpot_target, gap_target = _targets(p, tpot_ms, gap_ms, args.target_fraction)
        configs[p] = design_config(num_blocks=num_blocks, queue_budget_s=QUEUE_BUDGET_S,
                                   tpot_target_ms=tpot_target, gap_target_ms=gap_target)
    fit_policy = "caps" if "caps" in policies else policies[0]
    low = min(rates)
    overhead_ms, delay_ms = fit_live_path(workloads[low], live[fit_policy]["records"][low], fields, facts,
                                          configs[fit_policy], slo)
    out_policies, errors = {}, []
    for p in policies:
        runs = []
        for r in rates:
            recs = live[p]["records"][r]
            sim = simulate_policy(workloads[r], fields, facts, configs[p], step_overhead_ms=overhead_ms,
                                  submit_delay_s=delay_ms / 1000.0)
            ls, ss = (st.summarize(x, rate=r, ttft_ms=ttft_ms, tpot_ms=tpot_ms) for x in (recs, sim))
            runs.append({"rate": r, "live": ls, "sim": ss})
            for metric in ("ttft_ms", "tpot_ms"):
                for q in ("p50", "p95"):
                    lv, sv = ls[metric][q], ss[metric][q]
                    errors.append({"policy": p, "rate": r, "metric": f"{metric[:-3].upper()} {q}", "live_ms": lv,
                                   "sim_ms": sv, "error": (sv / lv - 1.0) if lv and sv is not None else None,
                                   "fit_rate": p == fit_policy and r == low})
        errs = [abs(e["error"]) for e in errors if e["policy"] == p and e["error"] is not None and not e["fit_rate"]]
        out_policies[p] = {
            "runs": runs, "ratio": {f"{r:g}": v for r, v in live[p]["ratio"].items()}, "argv": live[p]["argv"],
            "live_goodput_rps": st.goodput((x["rate"], x["live"]["slo"]["attainment"]) for x in runs),
            "live_goodput_gap_rps": gap_goodput([x["live"] for x in runs], gap_ms),
            "sim_goodput_rps": st.goodput((x["rate"], x["sim"]["slo"]["attainment"]) for x in runs),
            "max_abs_error": max(errs) if errs else None}
    wall = time.perf_counter() - t0
    command = f"python -m loadgen.live_policies --out {args.out}"
    if rates != list(DEFAULT_RATES) or args.duration != 60.0 or policies != list(POLICIES):
        command += f" --rates {args.rates} --duration {args.duration:g} --policies {','.join(policies)}"
    if args.cost_model is not None:
        command += f" --cost-model {args.cost_model}"
    if args.slo_ttft_ms or args.slo_tpot_ms:
        command += f" --slo-ttft-ms {ttft_ms:g} --slo-tpot-ms {tpot_ms:g}"
    summary = {"command": command, "date": datetime.date.today().isoformat(), "scale": args.scale,
               "duration_s": args.duration, "seed": args.seed, "rates": rates, "policies": policies,
               "target_fraction": args.target_fraction,
               "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "gap_ms": gap_ms,
                       "given": bool(args.slo_ttft_ms or args.slo_tpot_ms)},
               "live_path": {"step_overhead_ms": overhead_ms, "submit_delay_ms": delay_ms, "fit_rate": low,
                             "fit_policy": fit_policy},
               "errors": errors, "wall_s": wall,
               "expected_minutes": wall / 60.0 if args.cost_model is None else wall / 60.0 + 6.0}
    res = {"summary": summary, "cost_model": fields, "fit": quality, "policies": out_policies,
           "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(), **facts}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(st.dumps(res))
    (args.out / "summary.md").write_text(markdown(res))
    print(f"wrote {args.out}/summary.md ({wall:.0f} s): " + ", ".join(
        f"{p} goodput {_rps(out_policies[p]['live_goodput_rps'])}" for p in policies), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
