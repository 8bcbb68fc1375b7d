"""`genserve-loadgen` (or `python -m loadgen`): open-loop load against a live server, or the simulator.

    genserve-loadgen run --url http://127.0.0.1:8000 --rate 0.5,1,1.5 --duration 60 --scale 0.064 --out out/
    genserve-loadgen run --grpc 127.0.0.1:50051 --rate 1 --num-requests 100
    genserve-loadgen sim --rate 0.5,1,1.5,2,2.5 --duration 3600 --out sim/

Both send the same workload (synthetic design mix, or `--trace` re-timed by `--rate`, or the
trace's own arrival times when `--rate` is absent) and write the same report: `results.json`
(configuration, one summary per rate, goodput), `summary.md` and `records.jsonl` (one line per
request). Each rate gets the same lengths and prompts (same seed), so runs differ only in timing.
Live runs only target localhost and are bounded in requests (`--num-requests`, or `--duration`
× rate) and time (`--duration`, then `--drain-timeout`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from engine.config import BATCHING_MODES, EngineConfig
from loadgen import stats as st
from loadgen.workload import (
    DEFAULT_API_KEY, MAX_REQUESTS, LengthMix, WorkItem, arrival_times, load_trace, retime, save_trace,
    synthetic_workload, with_disconnects)

MAX_DURATION_S = 24 * 3600.0


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate takes numbers separated by commas, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError("every rate must be > 0 requests per second")
    return rates


def build_workload(args: argparse.Namespace, rate: float | None) -> list[WorkItem]:
    """The items of one run: trace or synthetic mix, timed by the arrival process at `rate`."""
    keys = args.api_key or [DEFAULT_API_KEY]
    if args.trace:
        trace = load_trace(args.trace, default_api_key=keys[0])
        if args.scale != 1.0:
            raise SystemExit("--scale applies to the synthetic mix, not to a --trace")
        if rate is None:
            items = trace
            if args.num_requests is not None:
                items = items[:args.num_requests]
            if args.duration is not None:
                items = [it for it in items if it.arrival_s < args.duration]
        else:
            items = retime(trace, arrival_times(rate, process=args.arrival, duration_s=args.duration,
                                                num_requests=args.num_requests, seed=args.seed))
    else:
        if rate is None:
            raise SystemExit("--rate is required without a --trace")
        arrivals = arrival_times(rate, process=args.arrival, duration_s=args.duration,
                                 num_requests=args.num_requests, seed=args.seed)
        items = synthetic_workload(arrivals, LengthMix.design(args.scale), keys, seed=args.seed)
    return with_disconnects(items, args.disconnect_fraction, seed=args.seed,
                            after_tokens=args.disconnect_after)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False, file=sys.stderr)


def _write(out: pathlib.Path | None, rep: dict[str, Any], records: dict[float | None, list[st.RequestRecord]],
           workloads: dict[float | None, list[WorkItem]]) -> str:
    md = st.markdown(rep)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(st.dumps(rep))
        (out / "summary.md").write_text(md + "\n")
        with open(out / "records.jsonl", "w") as f:
            for rate, recs in records.items():
                for r in recs:
                    f.write(json.dumps({"rate": rate, **asdict(r)}) + "\n")
        for rate, items in workloads.items():
            save_trace(items, out / f"workload-{rate if rate is not None else 'trace'}.jsonl")
    return md


def _config(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "progress", "command") and v is not None}
    cfg.update(extra)
    return {k: v if isinstance(v, int | float | str | bool | list) else str(v) for k, v in cfg.items()}


def cmd_run(args: argparse.Namespace) -> int:
    """Open-loop load against a live server, one run per rate."""
    from loadgen.clients import GrpcClient, RestClient, run_open_loop

    if (args.url is None) == (args.grpc is None):
        raise SystemExit("give exactly one of --url (REST+SSE) or --grpc (gRPC)")
    if args.duration is None and args.num_requests is None:
        raise SystemExit("a live run needs --duration or --num-requests")
    runs, records, workloads = [], {}, {}
    for rate in args.rate or [None]:
        items = build_workload(args, rate)
        workloads[rate] = items

        async def go(items=items, rate=rate) -> list[st.RequestRecord]:
            client = (RestClient(args.url, timeout_s=args.timeout, seed=args.seed, prompt_seed=args.seed)
                      if args.url else
                      GrpcClient(args.grpc, timeout_s=args.timeout, seed=args.seed, prompt_seed=args.seed))
            bar = _progress(len(items), f"rate {rate}", args.progress)
            try:
                return await run_open_loop(items, client, max_retries=args.max_retries,
                                           drain_timeout_s=args.drain_timeout, progress=bar.update,
                                           request_prefix=f"lg{int(time.time())}-")
            finally:
                bar.close()
                await client.aclose()

        recs = asyncio.run(go())
        records[rate] = recs
        runs.append(st.summarize(recs, rate=rate, ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms))
        print(f"rate {rate}: {runs[-1]['num_completed']}/{len(recs)} completed, "
              f"{runs[-1]['num_rejected_429']} x 429", file=sys.stderr)
    target = args.url or f"grpc://{args.grpc}"
    rep = st.report(runs, title=f"genserve load test: {target}", config=_config(args, target=target))
    print(_write(args.out, rep, records, workloads))
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    """The same workload through the real scheduler in virtual time, one run per rate."""
    from engine.core.sim_executor import SimExecutor
    from loadgen.sim import design_config, simulate

    if args.duration is None and args.num_requests is None and not args.trace:
        raise SystemExit("give --duration or --num-requests (or a --trace)")
    config = design_config(num_blocks=args.num_blocks, block_size=args.block_size, max_rows=args.max_rows,
                           prefill_token_budget=args.prefill_token_budget, queue_budget_s=args.queue_budget_s,
                           per_key_rows=args.per_key_rows, batching=args.batching,
                           dynamic_window_s=args.dynamic_window_ms / 1000.0,
                           tpot_target_ms=args.tpot_target_ms, gap_target_ms=args.gap_target_ms)
    runs, records, workloads = [], {}, {}
    for rate in args.rate or [None]:
        items = build_workload(args, rate)
        workloads[rate] = items
        if args.cost_model is not None:
            sim = SimExecutor.from_json(args.cost_model)
        else:
            sim = SimExecutor(decode_1_ms=args.decode_1_ms, decode_32_ms=args.decode_32_ms,
                              prefill_ms_per_token=args.prefill_ms_per_token)
        bar = _progress(len(items), f"sim rate {rate}", args.progress)
        try:
            res = simulate(items, config, sim, max_retries=args.max_retries, time_limit_s=args.time_limit,
                           progress=bar.update)
        finally:
            bar.close()
        records[rate] = res.records
        runs.append(st.summarize(res.records, rate=rate, ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms,
                                 extra={"engine": res.engine_summary()}))
        if args.out is not None and args.write_steps:
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / f"steps-{rate}.csv", "w") as f:
                f.write("start_s,step_s,num_rows,num_decode_rows,num_prefill_tokens,num_running,queue_depth,"
                        "kv_blocks_free,num_preempted,decode_context,prefill_pairs\n")
                for s in res.steps:
                    f.write(f"{s.start_s:.6f},{s.step_s:.6f},{s.num_rows},{s.num_decode_rows},{s.num_prefill_tokens},"
                            f"{s.num_running},{s.queue_depth},{s.kv_blocks_free},{s.num_preempted},"
                            f"{s.decode_context},{s.prefill_pairs}\n")
        print(f"rate {rate}: {len(items)} requests, {res.virtual_s:,.0f} virtual s in {res.wall_s:.1f} s",
              file=sys.stderr)
    rep = st.report(runs, title="genserve simulated load test (virtual time)",
                    config=_config(args, engine=repr(config)))
    print(_write(args.out, rep, records, workloads))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--rate", type=_rates, default=None,
                   help="arrival rate(s), requests/s, comma separated (one run each), e.g. 0.5,1,1.5,2,2.5")
    g.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run")
    g.add_argument("--num-requests", type=int, default=None, help="most requests per run")
    g.add_argument("--arrival", choices=["poisson", "constant"], default="poisson", help="arrival process")
    g.add_argument("--trace", type=pathlib.Path, default=None,
                   help="JSONL trace (see loadgen.workload.load_trace); re-timed by --rate if given")
    g.add_argument("--scale", type=float, default=1.0,
                   help="shrink the synthetic length mix (0.064: prompts 16..512, answers 1..64 tokens)")
    g.add_argument("--api-key", action="append", default=None,
                   help="API key(s), assigned round-robin (repeat the flag); default 'loadgen'")
    g.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="share of requests that disconnect mid-stream")
    g.add_argument("--disconnect-after", type=int, default=None,
                   help="tokens received before disconnecting (default: half the answer)")
    g.add_argument("--max-retries", type=int, default=0, help="retry a 429 after Retry-After this many times")
    g.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths, prompts and sampling")
    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft-ms", type=float, default=st.DEFAULT_SLO_TTFT_MS, help="TTFT target, ms")
    r.add_argument("--slo-tpot-ms", type=float, default=st.DEFAULT_SLO_TPOT_MS, help="TPOT target, ms")
    r.add_argument("--out", type=pathlib.Path, default=None,
                   help="directory for results.json, summary.md, records.jsonl")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _check(args: argparse.Namespace) -> None:
    if args.duration is not None and not 0 < args.duration <= MAX_DURATION_S:
        raise SystemExit(f"--duration must be in (0, {MAX_DURATION_S:g}] seconds")
    if args.num_requests is not None and not 0 < args.num_requests <= MAX_REQUESTS:
        raise SystemExit(f"--num-requests must be in 1..{MAX_REQUESTS}")
    if not 0 < args.scale <= 1:
        raise SystemExit("--scale must be in (0, 1]")
    if not 0 <= args.disconnect_fraction <= 1:
        raise SystemExit("--disconnect-fraction must be in [0, 1]")
    if args.max_retries < 0:
        raise SystemExit("--max-retries must be >= 0")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `genserve-loadgen` and `python -m loadgen`."""
    parser = argparse.ArgumentParser(prog="genserve-loadgen", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="open-loop load against a live server on localhost")
    p.add_argument("--url", default=None, help="REST+SSE bridge, e.g. http://127.0.0.1:8000")
    p.add_argument("--grpc", default=None, help="gRPC engine service, e.g. 127.0.0.1:50051")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds from sending it to its last token")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds to wait for open requests after the last arrival")
    _common(p)
    p.set_defaults(func=cmd_run)

    s = sub.add_parser("sim", help="the same workload through the real scheduler in virtual time")
    e = s.add_argument_group("engine (defaults: the reference deployment of docs/design.md)")
    e.add_argument("--num-blocks", type=int, default=7152, help="KV pool, blocks")
    e.add_argument("--block-size", type=int, default=16, help="tokens per block")
    e.add_argument("--max-rows", type=int, default=32, help="row cap")
    e.add_argument("--prefill-token-budget", type=int, default=256, help="prefill tokens per step")
    e.add_argument("--queue-budget-s", type=float, default=2.0, help="device-seconds queued before 429")
    e.add_argument("--per-key-rows", type=int, default=8, help="rows per key while others wait")
    e.add_argument("--decode-1-ms", type=float, default=25.0, help="decode step of 1 row, ms")
    e.add_argument("--decode-32-ms", type=float, default=40.0, help="decode step of 32 rows, ms")
    e.add_argument("--prefill-ms-per-token", type=float, default=0.1, help="prefill cost, ms per token")
    e.add_argument("--cost-model", type=pathlib.Path, default=None,
                   help="measured cost model JSON (SimExecutor.from_json; e.g. "
                        "docs/benchmarks/scheduler/cost_model_cpu.json), replacing the three costs above")
    e.add_argument("--batching", choices=list(BATCHING_MODES), default="continuous",
                   help="batch formation (EngineConfig.batching)")
    e.add_argument("--dynamic-window-ms", type=float, default=10.0, help="dynamic batching window, ms")
    e.add_argument("--tpot-target-ms", type=float, default=EngineConfig().tpot_target_ms,
                   help="the TPOT target that sizes prefill beyond the token caps (EngineConfig), ms")
    e.add_argument("--gap-target-ms", type=float, default=EngineConfig().gap_target_ms,
                   help="the longest gap that prefill beyond the token caps may cause (EngineConfig), ms")
    e.add_argument("--time-limit", type=float, default=None, help="stop at this virtual time, s")
    e.add_argument("--write-steps", action="store_true", help="also write steps-<rate>.csv to --out")
    _common(s)
    s.set_defaults(func=cmd_sim)

    args = parser.parse_args(argv)
    _check(args)
    try:
        return args.func(args)
    except ValueError as exc:
        raise SystemExit(f"genserve-loadgen: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
