"""The scheduler comparison, in virtual time at the design's scale: one command regenerates it.

    .venv/bin/python -m loadgen.report --out docs/benchmarks/scheduler

writes ``README.md`` (the report), ``results.json`` (every number in it) and three PNG plots.
Every run is `loadgen.sim.simulate`: the real `Scheduler`, block pool, admission control and
fair queueing over `SimExecutor` with the reference deployment's costs of docs/design.md (25 ms
for a 1-row decode step, 40 ms for 32 rows, 0.1 ms per prefill token), on 7,152 blocks of 16
tokens. Virtual time makes
the numbers deterministic: the same command gives the same tables on any machine.

What runs (defaults; each run has ``--minutes`` (10) virtual minutes of Poisson arrivals, seed 0,
then drains):

1. modes × rates: static, dynamic (10 ms window), continuous with whole-prompt prefill
   ("continuous_unchunked"), and continuous with 256-token chunked prefill ("continuous", the
   design), at 0.5, 1, 1.5, 2 and 2.5 requests/s on the same trace. The admission budget is
   raised to `COMPARISON_BUDGET_S` for all four, because the design's 2 s of queued work would
   never let a static batch of 32 fill; the design's continuous server (2 s budget) follows as
   its own block.
2. sweep: continuous batching at the design's budget, row cap 16/32/48 × prefill chunk
   128/256/512, at the same five rates; the plots show one point per setting at the highest rate
   (the server saturated: its throughput is its capacity).
3. fairness: key A sends 100 long requests (6,000-token prompts, 1,000-token answers) at t = 0,
   key B one short request (100 + 20 tokens) per second; once with A's 429s final, once with A
   retrying each 429 after Retry-After.
4. disconnects: the design rate (1.5 requests/s) with 20 % of clients leaving after half their
   answer, against the same trace without disconnects.

The trace: `synthetic_workload` over `LengthMix.design()` (prompts 50..8,000 tokens, mean ≈ 1,250;
answers 1..1,000, mean ≈ 300), built once, then re-timed for each rate (`retime`), so the i-th
request has the same lengths at every rate and in every mode.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.config import CAPS_ALONE
from loadgen import stats as st
from loadgen.workload import LengthMix, WorkItem, arrival_times, retime, synthetic_workload, with_disconnects

RATES = (0.5, 1.0, 1.5, 2.0, 2.5)
MODES = ("static", "dynamic", "continuous_unchunked", "continuous")
MODE_LABELS = {"static": "static", "dynamic": "dynamic (10 ms)",
               "continuous_unchunked": "continuous, whole-prompt prefill",
               "continuous": "continuous, chunked prefill (design)"}
COMPARISON_BUDGET_S = 60.0       # queued device-seconds before 429 in the mode comparison
DESIGN_BUDGET_S = 2.0
SWEEP_ROWS = (16, 32, 48)
SWEEP_CHUNKS = (128, 256, 512)
TRACE_SIZE = 4000                # requests in the base trace (2.5 req/s × 10 min needs ≈ 1,500)
DISCONNECT_RATE = 1.5
DISCONNECT_FRACTION = 0.2
FAIR_LONG = (100, 6000, 1000)    # key A: requests, prompt tokens, answer tokens, all at t = 0
FAIR_SHORT = (100, 20)           # key B: prompt tokens, answer tokens, one per second
FAIR_RETRIES = 100
# Our extra target: the longest gap between two tokens (≈ 3 reference steps of 65.6 ms).
STALL_TARGET_MS = 200.0
# How each step is sized: configurations of the one step policy (`StepBudget`), each EngineConfig
# overrides. "caps": the design's token caps alone (no step is predicted within 1 ms targets, so
# the time budget adds nothing); "default": the caps plus the TPOT target's slack spent on
# prefill; "vllm": vLLM-default-like caps (max_num_batched_tokens 2,048, max_num_seqs 256).
POLICIES = {"caps": CAPS_ALONE,
            "default": (),
            "vllm": (("max_rows", 256), ("prefill_token_budget", 2048), ("prefill_token_budget_few_rows", 2048))}
POLICY_LABELS = {"caps": "token caps alone: 32 rows, 256-token chunk (design)",
                 "default": "caps + TPOT slack on prefill (default: TPOT 70 ms, gap 150 ms)",
                 "vllm": "vLLM-default-like: 256 rows, 2,048-token chunk"}
GAP_P99_TARGET_MS = 100.0        # p99 of each request's longest gap between two tokens
BUSY_RATE, BUSY_MINUTE = 2.0, 5  # the plot of step times: this rate, this virtual minute


@dataclass(frozen=True)
class Point:
    """One simulated run.

    Attributes:
        group: "modes", "design", "sweep", "fairness" or "disconnect".
        rate: arrival rate, requests/s (key B's rate in the fairness scenario).
        overrides: EngineConfig fields over `design_config()`.
        minutes: virtual minutes of arrivals.
        seed: seed of the trace and the arrivals.
        max_retries: 429s retried after Retry-After (0: final).
        disconnect: share of clients that leave after half their answer.
        fairness_seconds: key B's stream length in the fairness scenario.
        cost_model: SimExecutor cost fields (None: the design's).
    """

    group: str
    rate: float
    overrides: tuple[tuple[str, Any], ...] = ()
    minutes: float = 10.0
    seed: int = 0
    max_retries: int = 0
    disconnect: float = 0.0
    fairness_seconds: float = 300.0
    cost_model: tuple[tuple[str, float], ...] | None = None

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.overrides)


def base_trace(seed: int = 0, size: int = TRACE_SIZE) -> list[WorkItem]:
    """The comparison's request lengths (design mix), before timing."""
    return synthetic_workload([0.0] * size, LengthMix.design(), seed=seed)


def trace_workload(rate: float, minutes: float, seed: int = 0) -> list[WorkItem]:
    """The base trace at `rate` requests/s (Poisson, seeded) for `minutes` virtual minutes."""
    arrivals = arrival_times(rate, process="poisson", duration_s=minutes * 60.0, seed=seed)
    trace = base_trace(seed, max(TRACE_SIZE, len(arrivals)))
    return retime(trace, arrivals)


def fairness_workload(seconds: float) -> list[WorkItem]:
    """Key A: FAIR_LONG at t = 0. Key B: one FAIR_SHORT request per second for `seconds`."""
    n, prompt, answer = FAIR_LONG
    items = [WorkItem(i, 0.0, "A", prompt, answer) for i in range(n)]
    items += [WorkItem(n + j, float(j), "B", *FAIR_SHORT) for j in range(int(seconds))]
    return items


def run_point(p: Point) -> dict[str, Any]:
    """Simulate one point; its summary (latencies in ms) plus the engine's numbers."""
    from engine.core.sim_executor import SimExecutor
    from loadgen.sim import design_config, simulate

    if p.group == "fairness":
        items = fairness_workload(p.fairness_seconds)
    else:
        items = trace_workload(p.rate, p.minutes, p.seed)
        if p.disconnect:
            items = with_disconnects(items, p.disconnect, seed=p.seed)
    sim = SimExecutor(**dict(p.cost_model)) if p.cost_model else SimExecutor()
    config = {k: v for k, v in p.config.items() if k != "label"}
    res = simulate(items, design_config(**config), sim, max_retries=p.max_retries)
    out = st.summarize(res.records, rate=p.rate, extra={"engine": res.engine_summary()})
    out["point"] = {**asdict(p), "overrides": p.config, "cost_model": dict(p.cost_model or ())}
    out["num_unfinished"] = res.unfinished
    tt, tp = st.DEFAULT_SLO_TTFT_MS, st.DEFAULT_SLO_TPOT_MS
    out["slo_stall"] = {"max_gap_ms": STALL_TARGET_MS, "attainment": sum(
        r.meets_slo(tt, tp) and (r.max_gap_s or 0.0) * 1000.0 <= STALL_TARGET_MS
        for r in res.records) / len(res.records) if res.records else None}
    if p.disconnect:
        gone = [(it, r) for it, r in zip(items, res.records) if r.disconnected]
        stayed = [r for it, r in zip(items, res.records) if not r.disconnected and r.status == st.STATUS_OK]
        out["disconnect"] = {
            "num_disconnected": len(gone),
            "tokens_before_disconnect": sum(r.output_tokens for _, r in gone),
            "tokens_not_generated": sum(it.output_tokens - r.output_tokens for it, r in gone),
            "tokens_after_disconnect": res.extra["tokens_after_disconnect"],
            "cancelled_tokens": res.num_cancelled_tokens,
            "ttft_ms_disconnecting": st._ms(st.percentiles(r.ttft_s for _, r in gone)),
            "ttft_ms_staying": st._ms(st.percentiles(r.ttft_s for r in stayed)),
            "kv_blocks_free_end": res.kv_blocks_free_end,
        }
    return out


# -- the plan -----------------------------------------------------------------------------------
def plan(rates: Sequence[float] = RATES, minutes: float = 10.0, rows: Sequence[int] = SWEEP_ROWS,
         chunks: Sequence[int] = SWEEP_CHUNKS, fairness_seconds: float = 300.0, seed: int = 0) -> list[Point]:
    """Every point of the report, in report order."""
    pts = [Point("modes", r, (("batching", m), ("queue_budget_s", COMPARISON_BUDGET_S)), minutes, seed)
           for m in MODES for r in rates]
    pts += [Point("sweep", r, (("max_rows", n), ("prefill_token_budget", c)), minutes, seed)
            for n in rows for c in chunks for r in rates]
    pts += [Point("fairness", 1.0, (), minutes, seed, max_retries=k, fairness_seconds=fairness_seconds)
            for k in (0, FAIR_RETRIES)]
    pts += [Point("disconnect", DISCONNECT_RATE, (), minutes, seed, disconnect=DISCONNECT_FRACTION)]
    pts += [Point("policy", r, (("label", name),) + ov, minutes, seed) for name, ov in POLICIES.items() for r in rates]
    return pts


def run_all(points: Sequence[Point], jobs: int = 1, progress: bool = True) -> list[dict[str, Any]]:
    """Run `points` on `jobs` processes, results in `points` order."""
    from tqdm import tqdm

    bar = tqdm(total=len(points), desc="simulated runs", unit="run", disable=not progress, file=sys.stderr)
    try:
        if jobs <= 1:
            out = []
            for p in points:
                out.append(run_point(p))
                bar.update()
            return out
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            out = []
            for r in pool.imap(run_point, points):
                out.append(r)
                bar.update()
            return out
    finally:
        bar.close()


# -- analysis -----------------------------------------------------------------------------------
def _group(results, group, **match):
    return [r for r in results if r["point"]["group"] == group
            and all(r["point"]["overrides"].get(k) == v for k, v in match.items())]


def analyse(results: Sequence[dict[str, Any]], rates: Sequence[float]) -> dict[str, Any]:
    """Goodput per mode and per sweep setting, the sweep's best setting, the scenarios' numbers."""
    top = max(rates)
    modes = {}
    for m in MODES:
        runs = _group(results, "modes", batching=m)
        modes[m] = {"goodput_rps": st.goodput((r["rate"], r["slo"]["attainment"]) for r in runs),
                    "goodput_with_stall_target_rps": st.goodput((r["rate"], r["slo_stall"]["attainment"])
                                                                for r in runs)}
    design = [r for r in _group(results, "sweep", max_rows=32, prefill_token_budget=256)]
    sweep = []
    rows = sorted({r["point"]["overrides"]["max_rows"] for r in _group(results, "sweep")})
    chunks = sorted({r["point"]["overrides"]["prefill_token_budget"] for r in _group(results, "sweep")})
    for n in rows:
        for c in chunks:
            runs = _group(results, "sweep", max_rows=n, prefill_token_budget=c)
            sat = next(r for r in runs if r["rate"] == top)
            sweep.append({"max_rows": n, "prefill_token_budget": c,
                          "goodput_rps": st.goodput((r["rate"], r["slo"]["attainment"]) for r in runs),
                          "at_rate": top, "throughput_rps": sat["throughput_rps"],
                          "output_tokens_per_s": sat["output_tokens_per_s"],
                          "tpot_p95_ms": sat["tpot_ms"]["p95"], "ttft_p95_ms": sat["ttft_ms"]["p95"],
                          "max_gap_p95_ms": sat["max_gap_ms"]["p95"], "slo_attainment": sat["slo"]["attainment"]})
    best = max(sweep, key=lambda s: (s["goodput_rps"] or 0.0,
                                     (s["tpot_p95_ms"] or 1e9) <= st.DEFAULT_SLO_TPOT_MS,
                                     s["output_tokens_per_s"] or 0.0)) if sweep else None
    fair = {}
    for r in _group(results, "fairness"):
        key = "retrying" if r["point"]["max_retries"] else "429_final"
        fair[key] = {k: {"sent": v["num_requests"], "completed": v["num_completed"], "429": v["num_rejected_429"],
                         "ttft_ms": v["ttft_ms"]} for k, v in r["per_key"].items()}
        fair[key]["retries"] = r["num_retries"]
        fair[key]["b_p95_under_1s"] = (r["per_key"]["B"]["ttft_ms"]["p95"] or 1e9) < 1000.0
    disc = _group(results, "disconnect")
    base = [r for r in design if r["rate"] == DISCONNECT_RATE]
    policies = {}
    for name in POLICIES:
        runs = _group(results, "policy", label=name)
        policies[name] = _policy_summary(runs, top)
    return {"modes": modes, "policies": policies,
            "design_goodput_rps": st.goodput((r["rate"], r["slo"]["attainment"]) for r in design) if design else None,
            "sweep": sweep, "sweep_best": best, "fairness": fair,
            "disconnect": disc[0]["disconnect"] if disc else None,
            "disconnect_baseline": {"ttft_ms": base[0]["ttft_ms"], "throughput_rps": base[0]["throughput_rps"],
                                    "output_tokens_per_s": base[0]["output_tokens_per_s"]} if base else None}


def _policy_summary(runs, top: float) -> dict[str, Any]:
    """Goodput of one configuration's runs, with and without the p99 longest-gap target, and its numbers
    at the highest rate."""
    gap_ok = {r["rate"]: (r["max_gap_ms"]["p99"] or 0.0) <= GAP_P99_TARGET_MS for r in runs}
    sat = next((r for r in runs if r["rate"] == top), None)
    return {"goodput_rps": st.goodput((r["rate"], r["slo"]["attainment"]) for r in runs),
            "goodput_with_gap_rps": st.goodput((r["rate"], r["slo"]["attainment"] if gap_ok[r["rate"]] else 0.0)
                                               for r in runs),
            "gap_p99_ms": {f"{r['rate']:g}": r["max_gap_ms"]["p99"] for r in runs},
            "attainment": {f"{r['rate']:g}": r["slo"]["attainment"] for r in runs},
            "throughput_rps_at_top": sat and sat["throughput_rps"],
            "output_tokens_per_s_at_top": sat and sat["output_tokens_per_s"]}


def busy_minute(rate: float = BUSY_RATE, minute: int = BUSY_MINUTE, minutes: float = 10.0,
                seed: int = 0) -> dict[str, list[tuple[float, float, int]]]:
    """(start s, step ms, decode rows) of every step in virtual minute `minute` of a run at `rate`,
    per configuration of `POLICIES` (the same trace for each)."""
    from engine.core.sim_executor import SimExecutor
    from loadgen.sim import design_config, simulate

    items = trace_workload(rate, minutes, seed)
    out = {}
    for name, ov in POLICIES.items():
        res = simulate(items, design_config(**dict(ov)), SimExecutor())
        out[name] = [(s.start_s, s.step_s * 1000.0, s.num_decode_rows) for s in res.steps
                     if minute * 60.0 <= s.start_s < (minute + 1) * 60.0]
    return out


def plot_busy_minute(steps: dict[str, list[tuple[float, float, int]]], out: pathlib.Path,
                     rate: float = BUSY_RATE, minute: int = BUSY_MINUTE) -> str:
    """policy_steps.png: step time and decode rows per step of each configuration over one minute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 6.4), sharex=True)
    colors = {"caps": "tab:orange", "default": "tab:blue", "vllm": "tab:green"}
    for name in ("vllm", "caps", "default"):               # the default drawn last, on top
        color, pts = colors[name], steps[name]
        t = [p[0] - minute * 60.0 for p in pts]
        axes[0].plot(t, [p[1] for p in pts], lw=0.7, color=color, label=POLICY_LABELS[name])
        axes[1].plot(t, [p[2] for p in pts], lw=0.7, color=color, label=POLICY_LABELS[name])
    axes[0].axhline(st.DEFAULT_SLO_TPOT_MS, color="grey", ls="--", lw=1)
    axes[0].axhline(GAP_P99_TARGET_MS, color="grey", ls=":", lw=1)
    axes[0].set(ylabel="step time, ms", title=f"Each step, virtual minute {minute}–{minute + 1} at {rate:g} requests/s "
                                              "(design scale; dashed: TPOT target, dotted: gap target)")
    axes[1].set(xlabel="seconds into the minute", ylabel="decode rows per step")
    axes[0].legend(fontsize=8, loc="upper right")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "policy_steps.png", dpi=110)
    plt.close(fig)
    return "policy_steps.png"


# -- plots --------------------------------------------------------------------------------------
def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def plots(results, summary, rates, out: pathlib.Path) -> list[str]:
    """modes_ttft.png, sweep_tpot.png, sweep_ttft.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, marker in zip(MODES, "sDo^"):
        runs = _group(results, "modes", batching=m)
        axes[0].plot([r["rate"] for r in runs], [_nan(r["ttft_ms"]["p95"]) / 1000 for r in runs], marker=marker,
                     label=MODE_LABELS[m])
        axes[1].plot([r["rate"] for r in runs], [100 * _nan(r["slo"]["attainment"]) for r in runs], marker=marker,
                     label=MODE_LABELS[m])
    axes[0].set_yscale("log")
    axes[0].axhline(st.DEFAULT_SLO_TTFT_MS / 1000, color="grey", ls="--", lw=1)
    axes[0].set(xlabel="arrival rate, requests/s", ylabel="p95 TTFT, s (log)", title="p95 time to first token")
    axes[1].axhline(100 * st.GOODPUT_QUANTILE, color="grey", ls="--", lw=1)
    axes[1].set(xlabel="arrival rate, requests/s", ylabel="% of requests meeting both SLOs",
                title=f"SLO: TTFT ≤ {st.DEFAULT_SLO_TTFT_MS / 1000:g} s, TPOT ≤ {st.DEFAULT_SLO_TPOT_MS:g} ms")
    axes[1].legend(fontsize=8, loc="lower left")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("Scheduler modes on the same trace (design scale, virtual time)")
    fig.tight_layout()
    fig.savefig(out / "modes_ttft.png", dpi=110)
    plt.close(fig)
    names.append("modes_ttft.png")

    sweep = summary["sweep"]
    for metric, fname, label, slo in (("tpot_p95_ms", "sweep_tpot.png", "p95 TPOT, ms", st.DEFAULT_SLO_TPOT_MS),
                                      ("ttft_p95_ms", "sweep_ttft.png", "p95 TTFT, ms", st.DEFAULT_SLO_TTFT_MS)):
        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        colors = {16: "tab:blue", 32: "tab:orange", 48: "tab:green"}
        markers = {128: "o", 256: "s", 512: "^"}
        for s in sweep:
            if s[metric] is None or s["output_tokens_per_s"] is None:
                continue
            ax.scatter(s[metric], s["output_tokens_per_s"], color=colors.get(s["max_rows"], "k"),
                       marker=markers.get(s["prefill_token_budget"], "x"), s=60, zorder=3)
            ax.annotate(f"{s['max_rows']}/{s['prefill_token_budget']}", (s[metric], s["output_tokens_per_s"]),
                        textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.axvline(slo, color="grey", ls="--", lw=1)
        ax.set(xlabel=label, ylabel="throughput, output tokens/s",
               title=f"Row cap / prefill chunk at {max(rates):g} requests/s offered")
        for n, c in colors.items():
            ax.scatter([], [], color=c, label=f"row cap {n}")
        for c, mk in markers.items():
            ax.scatter([], [], color="grey", marker=mk, label=f"chunk {c}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


# -- markdown -----------------------------------------------------------------------------------
_f, _pct = st._f, st._pct


def _trio(d, qs=("p50", "p95", "p99"), scale=1.0, nd=0):
    return " / ".join("–" if d.get(q) is None else f"{d[q] * scale:,.{nd}f}" for q in qs)


def _run_table(runs, label_of) -> list[str]:
    lines = ["| setting | rate | done / sent | tok/s | req/s | SLO met | TTFT p50 / p95 / p99 (s) "
             "| TPOT p50 / p95 / p99 (ms) | max gap p50 / p95 / p99 (ms) | queue p50 / p95 / p99 (s) "
             "| rows/step | pool use mean / max | preempt | 429 |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---|---:|---|---:|---:|"]
    for r in runs:
        e = r["engine"]
        unf = f" (+{r['num_unfinished']} stuck)" if r.get("num_unfinished") else ""
        lines.append(
            f"| {label_of(r)} | {r['rate']:g} | {r['num_completed']} / {r['num_requests']}{unf} "
            f"| {_f(r['output_tokens_per_s'])} | {_f(r['throughput_rps'], 2)} | {_pct(r['slo']['attainment'])} "
            f"| {_trio(r['ttft_ms'], scale=1e-3, nd=2)} | {_trio(r['tpot_ms'], nd=1)} | {_trio(r['max_gap_ms'])} "
            f"| {_trio(r['queue_ms'], scale=1e-3, nd=2)} | {_f(e['rows_per_step']['mean'], 1)} "
            f"| {_pct(e['pool_use']['mean'])} / {_pct(e['pool_use']['max'])} | {e['num_preemptions']} "
            f"| {r['num_rejected_429']} |")
    return lines


def _rps(x):
    return "none (the lowest rate already misses)" if x is None else f"{x:g} req/s"


def _policy_section(results, summary, meta) -> list[str]:
    """Section 4: how each step is sized, three configurations of the step policy on the same trace."""
    from engine.config import EngineConfig

    rates = meta["rates"]
    cfg = EngineConfig()
    tpot, gap = cfg.tpot_target_ms, cfg.gap_target_ms
    pol = summary["policies"]
    L = ["", "## 4. How each step is sized: the design's caps, the caps plus the TPOT slack, a vLLM-like budget", "",
         "Same trace, same 2 s admission budget, same SLOs (TTFT ≤ 3 s, TPOT ≤ 70 ms), plus a target on the "
         f"run: the p99 of each request's longest gap between two tokens ≤ **{GAP_P99_TARGET_MS:g} ms**. "
         "*Goodput + gap* is the highest rate at which ≥ 95 % meet TTFT and TPOT and the run meets the gap "
         "target, every lower rate too.", "",
         "genserve has one step policy (`engine.core.sched.step_budget.StepBudget`): at most `max_rows` rows; "
         "a step's prefill pieces join while its prompt tokens stay within the design's token caps (the floor: "
         f"{cfg.prefill_token_budget:,} tokens, {cfg.prefill_token_budget_few_rows:,} while ≤ {cfg.few_rows} rows "
         "decode), or while the cost model (rows, their contexts, prefill pieces) predicts the step within the "
         "time its sampling rows can spare: for each row the least of its gap target (`--gap-target-ms`, after "
         "its last token) and the time that keeps its mean time per output token within the TPOT target "
         "(`--tpot-target-ms`), never less than the TPOT target, never more than the gap target. Rows that "
         "decode faster than the target bank the difference, and the bank is spent on prefill. At equal "
         "service of their keys the prompt with the fewest tokens left to prefill goes first. Memory (5 % "
         "margin), per-key caps, fair queueing and the 64-token prefill grid are the same in all three "
         "configurations:", "",
         "- **Caps alone** (`--tpot-target-ms 1 --gap-target-ms 1`, the design's caps): no step is predicted "
         f"within 1 ms, so the time budget adds nothing: at most {cfg.max_rows} rows and "
         f"{cfg.prefill_token_budget:,} prompt tokens per step ({cfg.prefill_token_budget_few_rows:,} while "
         f"≤ {cfg.few_rows} rows decode).",
         f"- **Default** (no flags: TPOT target {tpot:g} ms, gap target {gap:g} ms): the same caps, plus the "
         "prefill the targets leave room for: a step of 32 decode rows, 40 ms in the design's costs, may "
         f"carry ≈ {(tpot - 40) / 0.1:,.0f} prompt tokens ({tpot - 40:g} ms), up to ≈ {(gap - 40) / 0.1:,.0f} "
         f"({gap - 40:g} ms) when its rows have banked time, where the caps allow {cfg.prefill_token_budget:,}.",
         "- **vLLM-default-like**: caps of 256 rows and 2,048 prompt tokens per step (vLLM's `max_num_seqs` "
         "and `max_num_batched_tokens`; vLLM also counts decode tokens in the 2,048, a difference of at most "
         f"the rows), default targets; a 2,048-token step is predicted beyond the {gap:g} ms gap target, so "
         "its time budget adds nothing either.", "",
         "| configuration | goodput | goodput + gap | " + " | ".join(f"SLO met at {r:g}" for r in rates)
         + " | max gap p99 at " + " / ".join(f"{r:g}" for r in rates) + " (ms) | req/s at "
         + f"{max(rates):g} | out tok/s at {max(rates):g} |",
         "|---|---:|---:|" + "---:|" * len(rates) + "---|---:|---:|"]
    for name in POLICIES:
        p = pol[name]
        runs = _group(results, "policy", label=name)
        L.append(f"| {POLICY_LABELS[name]} | **{_rps(p['goodput_rps'])}** | **{_rps(p['goodput_with_gap_rps'])}** | "
                 + " | ".join(_pct(r["slo"]["attainment"]) for r in runs) + " | "
                 + " / ".join(_f(r["max_gap_ms"]["p99"]) for r in runs)
                 + f" | {_f(p['throughput_rps_at_top'], 2)} | {_f(p['output_tokens_per_s_at_top'])} |")
    L += ["", "![step time and rows per step of each configuration over a busy minute](policy_steps.png)", "",
          f"The plot: every step of virtual minute {meta['busy_minute']}–{meta['busy_minute'] + 1} of the "
          f"{meta['busy_rate']:g} "
          "requests/s run, per configuration (same trace)."]
    live = meta.get("live_policies")
    L += ["", "Caps alone and the default on the live server of this machine, in one run, with the simulator's "
              "error for each: `python -m loadgen.live_policies --out docs/benchmarks/scheduler/live_policies` "
              + (f"([live_policies/summary.md](live_policies/summary.md), run {live['date']}). At this machine's "
                 f"scaled SLOs (TTFT ≤ {live['slo']['ttft_ms']:.0f} ms, TPOT ≤ {live['slo']['tpot_ms']:.0f} ms) "
                 f"and {', '.join(f'{r:g}' for r in live['rates'])} requests/s, live goodput "
                 + ("" if set(live["goodput"]) <= set(POLICIES) else
                    "(that run is from before the two step policies became one, and compared them: \"fixed\" "
                    "was the caps alone, \"slo\" also sized the rows from the cost model) ")
                 + ", ".join(f"{p} {_rps(g)} (simulated {_rps(live['sim_goodput'][p])}, largest percentile "
                             f"error {_pct(live['error'][p])})" for p, g in live["goodput"].items())
                 + f"; with the run's p99 longest gap within {live['slo']['gap_ms']:.0f} ms as well, "
                 + ", ".join(f"{p} {_rps(g)}" for p, g in live["goodput_gap"].items()) + "."
                 if live else "(not run yet on a quiet machine).")]
    L += ["", "All runs of the three configurations:", ""]
    L += _run_table([r for name in POLICIES for r in _group(results, "policy", label=name)],
                    lambda r: r["point"]["overrides"]["label"])
    return L


def markdown(results, summary, meta, images) -> str:
    rates = meta["rates"]
    minutes = meta["minutes"]
    L: list[str] = []
    L += ["# Scheduler comparison and capacity (virtual time, design scale)", "",
          "Regenerate everything on this page (tables, plots, `results.json`) with one command:", "",
          "```", meta["command"], "```", "",
          f"It runs {meta['num_runs']} simulations and took {meta['wall_s']:.0f} s of wall time on "
          f"{meta['jobs']} process(es) last time. Virtual time makes the numbers deterministic; only the wall "
          "time changes between machines.", "",
          "## Setup", "",
          "- **Engine**: the real `Scheduler` (fair queueing, admission control, chunked prefill, "
          "preemption) and block pool, driven by `loadgen.sim.simulate` over `SimExecutor` in virtual time. "
          "Design scale: 7,152 KV blocks of 16 tokens, row cap 32, prefill chunk 256 (1,024 while ≤ 4 rows "
          "decode), 8 rows per key while another key waits, 5 % free-block margin. Admission control answers "
          "429 when the queueing delay a new request would see passes the budget: the estimated device time "
          "of the queued work that waits for rows or KV blocks ahead of it, itself included (a request the "
          "next step would admit adds nothing), plus the prompt tokens running rows have still to prefill "
          "before its prompt's turn (those with no more tokens left than its whole prompt).",
          "- **Cost model**: the reference deployment's assumptions ([../../design.md](../../design.md)), `SimExecutor()` defaults: a decode step takes "
          "25 ms for 1 row and 40 ms for 32 (linear between), plus 0.1 ms per prefill token; no context term. "
          "A model measured on this machine (CPU, SmolLM2-135M) is in [calibration.md](calibration.md).",
          f"- **Trace**: the design's length mix (`LengthMix.design()`: prompts 50..8,000 tokens, mean ≈ 1,250; "
          f"answers 1..1,000, mean ≈ 300, clipped lognormals), seed {meta['seed']}, one base trace re-timed for every "
          f"rate, so the i-th request has the same lengths at every rate and in every mode. Poisson arrivals at "
          f"{', '.join(f'{r:g}' for r in rates)} requests/s for **{minutes:g} virtual minutes per point**, then "
          "the run drains (every request admitted is finished). Answers are forced to their length "
          "(`ignore_eos`).",
          f"- **SLO**: TTFT ≤ **{st.DEFAULT_SLO_TTFT_MS / 1000:g} s** (chosen: an 8,000-token prompt needs "
          "≈ 2.1 s of chunked prefill at 256 tokens per 65.6 ms step, so 3 s leaves ≈ 0.9 s of queueing for the "
          f"longest prompts) and TPOT ≤ **{st.DEFAULT_SLO_TPOT_MS:g} ms** (the design's step target). "
          "**Goodput** is the highest tested rate at which ≥ 95 % of requests meet both, every lower rate too; a "
          "429 counts as a miss.",
          "- Latencies are measured from arrival; percentiles are `numpy.percentile` (linear). TTFT and TPOT "
          "percentiles are over requests that were served (not 429s). *rows/step* is the mean number of "
          "requests in a step; *pool use* is the share of KV blocks in use, step-time weighted.", ""]

    L += ["## 1. Scheduler modes on the same trace", "",
          f"All four modes run with an admission budget of {COMPARISON_BUDGET_S:g} queued device-seconds "
          f"(the design's {DESIGN_BUDGET_S:g} s would 429 a static batch long before 32 requests wait). Static "
          "waits for 32 queued requests and runs the batch until its last row ends; dynamic fires when 32 wait "
          "or the oldest has waited 10 ms; both prefill each batch whole, and no request joins a running batch. "
          "Continuous batching admits between any two steps, with whole-prompt or 256-token chunked prefill.", "",
          f"*Goodput + stall* adds a target of our own, the longest gap between two tokens ≤ "
          f"{STALL_TARGET_MS:g} ms (≈ 3 reference steps of 65.6 ms): TPOT is a mean and does not see a stream frozen "
          "by someone else's prefill, which is what chunked prefill exists for.", "",
          "| mode | goodput | goodput + stall | " + " | ".join(f"SLO met at {r:g}" for r in rates)
          + " | max gap p95 at " + " / ".join(f"{r:g}" for r in rates) + " (ms) |",
          "|---|---:|---:|" + "---:|" * len(rates) + "---|"]
    for m in MODES:
        runs = _group(results, "modes", batching=m)
        L.append(f"| {MODE_LABELS[m]} | **{_rps(summary['modes'][m]['goodput_rps'])}** "
                 f"| {_rps(summary['modes'][m]['goodput_with_stall_target_rps'])} | "
                 + " | ".join(_pct(r["slo"]["attainment"]) for r in runs) + " | "
                 + " / ".join(_f(r["max_gap_ms"]["p95"]) for r in runs) + " |")
    L += ["", "![p95 TTFT and SLO attainment per mode](modes_ttft.png)", ""]
    L += _run_table([r for m in MODES for r in _group(results, "modes", batching=m)],
                    lambda r: MODE_LABELS[r["point"]["overrides"]["batching"]])
    peak = {m: max((r["throughput_rps"] or 0.0) for r in _group(results, "modes", batching=m)) for m in MODES}
    L += ["", "Reading it:", "",
          "- Static and dynamic batching hold every row until the batch's longest answer ends (up to 1,000 "
          "steps), so rows per step decay and newcomers wait for the whole batch: TTFT runs into minutes and "
          f"throughput peaks at {peak['static']:.2f} (static) and {peak['dynamic']:.2f} (dynamic) requests/s, "
          f"against {peak['continuous']:.2f} for continuous batching on the same device. Their TPOT looks good only because a drained batch runs few rows. (The simulator charges "
          "a step for its live rows; a real static batch also pays for finished, padded rows, so these "
          "numbers flatter static.) \"stuck\" counts requests of a last static batch that never filled.",
          "- Whole-prompt prefill gives the best TTFT, but a long prompt freezes every running stream for its "
          "whole prefill: see the max gap column (hundreds of ms at p95, up to 0.8 s for an 8,000-token "
          "prompt). Chunked prefill bounds the gap near the 65.6 ms step and pays with TTFT.",
          f"- Above ≈ 2 requests/s the device is full (the design's estimate); with a {COMPARISON_BUDGET_S:g} s "
          "budget the queue grows to a minute of work and TTFT follows it.", ""]
    design = _group(results, "sweep", max_rows=32, prefill_token_budget=256)
    L += ["## 2. The design's server: continuous, chunked, 2 s admission budget", "",
          f"Goodput: **{_rps(summary['design_goodput_rps'])}** (the design assumed 2 requests/s of capacity and "
          "planned for 1.5). Over capacity, admission control answers 429 instead of letting the queue grow, "
          "which keeps TTFT of the admitted requests bounded.", ""]
    L += _run_table(design, lambda r: "32 rows / 256 chunk")
    L += ["", "## 3. Row cap × prefill chunk", "",
          f"Continuous batching at the design's 2 s budget. One point per setting at {max(rates):g} requests/s "
          "offered (over capacity, so throughput is the setting's capacity; 429s take the excess). "
          "Goodput is over all five rates.", "",
          "![throughput against p95 TPOT](sweep_tpot.png) ![throughput against p95 TTFT](sweep_ttft.png)", "",
          f"| row cap | chunk | goodput | out tok/s at {max(rates):g} | req/s | TPOT p95 (ms) | TTFT p95 (s) "
          "| max gap p95 (ms) | SLO met |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary["sweep"]:
        best = " **(best)**" if s is summary["sweep_best"] or s == summary["sweep_best"] else ""
        L.append(f"| {s['max_rows']} | {s['prefill_token_budget']}{best} | {_rps(s['goodput_rps'])} "
                 f"| {_f(s['output_tokens_per_s'])} | {_f(s['throughput_rps'], 2)} | {_f(s['tpot_p95_ms'], 1)} "
                 f"| {_f(s['ttft_p95_ms'] / 1000 if s['ttft_p95_ms'] is not None else None, 2)} "
                 f"| {_f(s['max_gap_p95_ms'])} | {_pct(s['slo_attainment'])} |")
    b = summary["sweep_best"]
    if b:
        L += ["", f"Best setting (highest goodput, then p95 TPOT within target, then throughput at "
                  f"{max(rates):g} requests/s): **row cap {b['max_rows']}, chunk {b['prefill_token_budget']}**, goodput "
                  f"{_rps(b['goodput_rps'])}, {_f(b['output_tokens_per_s'])} output tokens/s at p95 TPOT "
                  f"{_f(b['tpot_p95_ms'], 1)} ms."]
        over = [f"{x['max_rows']}/{x['prefill_token_budget']}" for x in summary["sweep"]
                if (x["tpot_p95_ms"] or 0.0) > st.DEFAULT_SLO_TPOT_MS]
        if over:
            L += ["", f"Over the {st.DEFAULT_SLO_TPOT_MS:g} ms TPOT target at p95 when saturated: "
                      f"{', '.join(over)} (rows × step cost and the chunk add up, as the design's 40 + 25.6 ms "
                      "arithmetic predicts). A small chunk with many rows starves prefill: TTFT grows while "
                      "the rows are full."]
    L += ["", "All sweep runs, every rate:", ""]
    L += _run_table(_group(results, "sweep"),
                    lambda r: f"{r['point']['overrides']['max_rows']} rows / {r['point']['overrides']['prefill_token_budget']}")
    L += _policy_section(results, summary, meta)
    n, p_long, a_long = FAIR_LONG
    L += ["", "## 5. Fairness: one key floods, another sends one short request per second", "",
          f"Key A sends {n} requests of {p_long:,} prompt + {a_long:,} answer tokens at t = 0; key B sends one "
          f"request of {FAIR_SHORT[0]} + {FAIR_SHORT[1]} tokens per second for {meta['fairness_seconds']:g} s. "
          "Design server (continuous, 2 s budget, 8 rows per key while another waits). The design's target: "
          "B's p95 TTFT under 1 s. TTFT percentiles are over the requests served, measured from the first "
          "attempt's arrival (a retried request's TTFT includes its Retry-After waits).", "",
          "| A's 429s | key | sent | done | 429 (final) | TTFT p50 / p95 / p99 (ms) | B p95 < 1 s |",
          "|---|---|---:|---:|---:|---|---|"]
    for variant, label in (("429_final", "final"), ("retrying", f"retried (≤ {FAIR_RETRIES}×)")):
        f = summary["fairness"].get(variant)
        if not f:
            continue
        for key in ("A", "B"):
            k = f[key]
            L.append(f"| {label} | {key} | {k['sent']} | {k['completed']} | {k['429']} | {_trio(k['ttft_ms'])} "
                     f"| {'yes' if f['b_p95_under_1s'] else 'NO'} |" if key == "B" else
                     f"| {label} | {key} | {k['sent']} | {k['completed']} | {k['429']} | {_trio(k['ttft_ms'])} | |")
    d, base = summary["disconnect"], summary["disconnect_baseline"]
    if d:
        drun = _group(results, "disconnect")[0]
        L += ["", "## 6. Cancellation: 20 % of clients disconnect mid-stream", "",
              f"{DISCONNECT_RATE:g} requests/s for {minutes:g} virtual minutes, design server; a marked client leaves "
              "after half its answer (`with_disconnects`, seed 0) and the engine drops its row at the next step "
              "boundary.", "",
              "| | value |", "|---|---:|",
              f"| requests / disconnected | {drun['num_requests']} / {d['num_disconnected']} |",
              f"| tokens generated for them before they left | {d['tokens_before_disconnect']:,} |",
              f"| tokens generated after the disconnect (cost beyond the next step) | {d['tokens_after_disconnect']} |",
              f"| tokens sampled after the cancel flag (engine counter) | {d['cancelled_tokens']} |",
              f"| answer tokens never generated (device time saved) | {d['tokens_not_generated']:,} |",
              f"| KV blocks free at the end | {d['kv_blocks_free_end']:,} of 7,152 |",
              f"| TTFT p50 / p95 / p99, disconnecting clients (ms) | {_trio(d['ttft_ms_disconnecting'])} |",
              f"| TTFT p50 / p95 / p99, the others (ms) | {_trio(d['ttft_ms_staying'])} |",
              f"| TTFT p50 / p95 / p99, same trace without disconnects (ms) | {_trio(base['ttft_ms'])} |" if base else "",
              "",
              "In virtual time the cancel flag is set while the tokens are pushed, before the next step is "
              "built, so no token is generated after a disconnect; on the live server a flag set during a step "
              "costs that one step (`genserve_cancel_extra_steps`, checked by the e2e tests).", ""]
    cal = meta.get("calibration")
    L += ["## 7. Calibration on this machine", ""]
    if cal:
        lp = cal.get("live_path") or {}
        L += [f"From [calibration.md](calibration.md) (`{cal.get('command', 'python -m loadgen.calibrate')}`, "
              f"run {cal.get('date', '?')}): the simulator with the cost model fitted to this machine's "
              "SmolLM2-135M step times, against the live server (REST+SSE) at the same rates and workload. "
              f"*+ live path*: every step + {lp.get('step_overhead_ms', 0.0):.1f} ms and "
              f"{lp.get('submit_delay_ms', 0.0):.0f} ms of request path, both fitted at the lowest rate "
              "(marked *fit*), checked at the others.", "",
              "| rate | metric | live | sim, engine only | error | sim + live path | error |",
              "|---:|---|---:|---:|---:|---:|---:|"]
        e = lambda x: "–" if x is None else f"{100 * x:+.1f} %"  # noqa: E731
        for row in cal.get("comparison", []):
            fit = " (fit)" if row.get("fit_rate") else ""
            L.append(f"| {row['rate']:g}{fit} | {row['metric']} | {_f(row['live_ms'], 1)} ms "
                     f"| {_f(row['sim_ms'], 1)} ms | {e(row['error'])} | {_f(row.get('sim_live_path_ms'), 1)} ms "
                     f"| {e(row.get('error_live_path'))} |")
        L += ["", f"Largest |error| at the validation rates: {100 * (cal.get('max_abs_error') or 0):.1f} % "
                  f"(target 20 %); engine only, all rates: {100 * (cal.get('max_abs_error_engine_only') or 0):.1f} %. "
                  f"Live goodput on this machine at its scaled SLOs: {_rps(cal.get('live_goodput_rps'))} "
                  "(of the rates tested)."]
    else:
        L += ["Not run yet: `python -m loadgen.calibrate --out docs/benchmarks/scheduler`."]
    L += ["", "## Caveats", "",
          "- The step costs are the design's assumptions, not measurements of a 7B model on a GPU; "
          "`SimExecutor.from_json` loads a measured model (`genserve-loadgen sim --cost-model FILE`), and the "
          "calibration shows how well the simulator tracks a live server when the costs are measured.",
          "- No padding is modelled: every mode computes only real tokens (static batching pays less than a "
          "padded implementation would).",
          "- Synthetic lengths, not logged prompts; a JSONL trace replays real ones (`--trace`).", ""]
    return "\n".join(L)


def _live_policies(path: pathlib.Path) -> dict[str, Any] | None:
    """The live comparison's date and goodput per policy (`loadgen.live_policies`), if it was run."""
    if not path.exists():
        return None
    res = json.loads(path.read_text())
    return {"date": res["summary"]["date"], "slo": res["summary"]["slo"], "rates": res["summary"]["rates"],
            "goodput": {p: g["live_goodput_rps"] for p, g in res["policies"].items()},
            "goodput_gap": {p: g["live_goodput_gap_rps"] for p, g in res["policies"].items()},
            "sim_goodput": {p: g["sim_goodput_rps"] for p, g in res["policies"].items()},
            "error": {p: g["max_abs_error"] for p, g in res["policies"].items()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/benchmarks/scheduler"))
    parser.add_argument("--minutes", type=float, default=10.0, help="virtual minutes of arrivals per point")
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="requests/s, comma separated")
    parser.add_argument("--rows", default=",".join(map(str, SWEEP_ROWS)), help="sweep: row caps")
    parser.add_argument("--chunks", default=",".join(map(str, SWEEP_CHUNKS)), help="sweep: prefill chunks")
    parser.add_argument("--fairness-seconds", type=float, default=300.0, help="key B's stream, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    if 32 not in rows or 256 not in chunks or DISCONNECT_RATE not in rates:
        raise SystemExit(f"the sweep must include row cap 32, chunk 256 and rate {DISCONNECT_RATE:g} "
                         "(the design's server)")
    points = plan(rates, args.minutes, rows, chunks, args.fairness_seconds, args.seed)
    t0 = time.perf_counter()
    results = run_all(points, args.jobs, args.progress)
    wall = time.perf_counter() - t0
    summary = analyse(results, rates)
    args.out.mkdir(parents=True, exist_ok=True)
    cal_path = args.out / "calibration.json"
    calibration = json.loads(cal_path.read_text()) if cal_path.exists() else None
    command = "python -m loadgen.report --out " + str(args.out)
    if args.minutes != 10.0 or rates != list(RATES) or args.seed:
        command += f" --minutes {args.minutes:g} --rates {args.rates} --seed {args.seed}"
    meta = {"command": command, "rates": rates, "minutes": args.minutes, "seed": args.seed, "jobs": args.jobs,
            "wall_s": wall, "num_runs": len(points), "fairness_seconds": args.fairness_seconds,
            "slo_ttft_ms": st.DEFAULT_SLO_TTFT_MS, "slo_tpot_ms": st.DEFAULT_SLO_TPOT_MS,
            "calibration": calibration and calibration.get("summary"),
            "live_policies": _live_policies(args.out / "live_policies" / "results.json")}
    images = plots(results, summary, rates, args.out)
    minute = min(BUSY_MINUTE, int(args.minutes // 2))
    busy_rate = BUSY_RATE if BUSY_RATE in rates else max(rates)
    meta.update(busy_minute=minute, busy_rate=busy_rate)
    images.append(plot_busy_minute(busy_minute(busy_rate, minute, args.minutes, args.seed), args.out,
                                   busy_rate, minute))
    (args.out / "results.json").write_text(st.dumps({"meta": meta, "summary": summary, "runs": list(results)}))
    (args.out / "README.md").write_text(markdown(results, summary, meta, images))
    print(f"wrote {args.out}/README.md, results.json, {', '.join(images)} ({wall:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
