"""genserve configurations against each other on the goodput benchmark's arrivals, no peer: for
choosing scheduler defaults quickly.

Run from the repository root::

    python -m benchmarks.policy_sweep --rates 3,4 --serve-args '' --serve-args '--prefill-token-budget 1024'

Every configuration runs as its own `genserve serve` (all up at once, the ones not measured idle),
gets a short warm-up, then the same Poisson arrivals of `--mix` (`benchmarks.goodput.arrivals`)
at each rate, the first configuration rotating from rate to rate. Goodput, TTFT and TPOT as
`benchmarks.goodput` counts them (`summarize_rate`); one line per (rate, configuration) on
stdout. Figures from different runs are not comparable (the host's speed drifts); compare the
lines of one run. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time

from benchmarks import goodput
from benchmarks.peer import GENSERVE, prompt_texts, run_round


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.policy_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--mix", choices=tuple(goodput.MIXES), default="design")
    p.add_argument("--rates", default="3,4", help="comma-separated req/s")
    p.add_argument("--requests", type=int, default=None, help="requests a rate (default: the mix's)")
    p.add_argument("--serve-args", action="append", required=True,
                   help="flags for genserve serve, one string per configuration ('' = the defaults)")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    try:
        rates = [float(x) for x in opts.rates.split(",") if x.strip()]
    except ValueError:
        p.error(f"--rates takes comma-separated numbers, got {opts.rates!r}")
    if not rates or min(rates) <= 0 or max(rates) > 100:
        p.error(f"--rates must be in (0, 100] req/s, got {opts.rates!r}")

    from engine.gguf_file import default_gguf_path
    from engine.tokenizer import Tokenizer
    from loadgen.live_server import LiveServer

    tokenizer = Tokenizer.from_gguf(default_gguf_path())
    mix = goodput.MIXES[opts.mix]
    requests = opts.requests or mix.requests
    base = ["--threads", "2", "--ready-timeout-s", "900"]
    variants = opts.serve_args
    with contextlib.ExitStack() as stack:
        urls = {v: stack.enter_context(LiveServer(queue_budget_s=None, extra_args=[*base, *shlex.split(v)],
                                                  start_timeout_s=900)).url for v in variants}
        for v in variants:
            run_round(GENSERVE, urls[v], prompt_texts(tokenizer, goodput.WARMUP_STREAMS, goodput.WARMUP_PROMPT,
                                                      f"sweep-warm-{v}"), goodput.WARMUP_TOKENS, 0)
        for i, rate in enumerate(rates):
            items = goodput.arrivals(mix, rate, requests, tokenizer, opts.seed)
            for v in variants[i % len(variants):] + variants[:i % len(variants)]:
                outcomes = goodput.run_rate(urls[v], items, mix.output_tokens, True)
                row = goodput.summarize_rate(outcomes, items, mix.output_tokens, opts.ttft_slo_ms, opts.tpot_slo_ms)
                print(f"{mix.name} {rate:g} req/s [{v or 'defaults'}]: goodput {row['goodput']:.2f}, met "
                      f"{row['met']}/{row['requests']}, 429 {row['rejected_429']}, TTFT p50 / p95 "
                      f"{goodput._f(row['ttft_ms_p50'])} / {goodput._f(row['ttft_ms_p95'])} ms, TPOT p95 "
                      f"{goodput._f(row['tpot_ms_p95'], 1)} ms", flush=True)
                time.sleep(2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
