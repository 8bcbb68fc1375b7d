"""Decode steps over a bf16 KV cache and over the 8-bit one (`--kv-cache-dtype int8`), in one run.

Run from the repository root::

    python -m benchmarks.kv_int8 [--rows 1,32] [--prompt-len 1250] [--steps 30] [--json PATH]

Two engines over one model (the embedded SmolLM2-135M, weights as the default engine reads them
here), identical but for `EngineConfig.kv_cache_dtype`: "auto" (bf16 pools) and "int8"
(`engine.attention.kv_quant`'s format, 66 bytes a row instead of 128). For each row count, each engine
gets `rows` greedy requests of `--prompt-len` seeded token ids (the design's prompts average
≈ 1,250 tokens) and prefills them; then the engines take one step each in turn, `--steps`
times, so load from other processes falls on both alike. Counted: pure-decode steps at that row
count, the executor's time (forward, logits, sampling); printed: the median per engine, the
ratio, and the K/V bytes a step reads at the mean context. Also printed: tokens a 2 GiB pool holds
in each format. The tokens the two engines generate differ (the 8-bit cache rounds every key and
value); tests/engine/attention/test_kv_int8.py measures by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch

from benchmarks.q4 import decode_in_turn
from engine.config import EngineConfig
from engine.gguf_file import open_gguf
from engine.model.weights import load_gguf
from engine.runner.builder import attach_weights, engine_from_model, model_from_weights, set_threads
from engine.runner.kv_cache import bytes_per_block
from genserve.common.model_source import parse_model_source

FORMATS = ("auto", "int8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,32", help="decode row counts, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="steps per engine and row count")
    parser.add_argument("--prompt-len", type=int, default=1250, help="prompt tokens per request")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the figures here")
    opts = parser.parse_args(argv)
    rows_list = [int(r) for r in opts.rows.split(",")]
    print(f"# load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    config = EngineConfig(num_threads=opts.threads)
    set_threads(config)
    args, state = load_gguf(open_gguf())
    model = model_from_weights(args, state, torch.bfloat16)
    attach_weights(config.weights, model, parse_model_source(None))     # the embedded GGUF
    # every request admitted at once, above the 5 % admission margin
    blocks = max(rows_list) * -(-(opts.prompt_len + opts.steps + 16) // 16) * 5 // 4 + 64
    engines = {fmt: engine_from_model(EngineConfig(num_blocks=blocks, max_rows=max(rows_list),
                                                   kv_cache_dtype=fmt), model)
               for fmt in FORMATS}
    per_token = {fmt: bytes_per_block(args, 16, engines[fmt].executor.kv.layers[0].dtype) / 16
                 for fmt in FORMATS}
    result: dict[str, object] = {"load_average": os.getloadavg()[0], "steps": opts.steps,
                                 "prompt_len": opts.prompt_len, "kv_bytes_per_token": per_token,
                                 "tokens_per_2gib": {f: int(2 * 1024**3 // b) for f, b in per_token.items()},
                                 "decode_ms": {}, "kv_mb_per_step": {}}
    print(f"{'rows':>4} {'bf16 KV':>10} {'int8 KV':>10}   (median ms per decode step)")
    for rows in rows_list:
        run = decode_in_turn(engines, rows, opts.steps, opts.prompt_len)
        context = statistics.mean(run.contexts)
        med = {fmt: statistics.median(ts) * 1e3 for fmt, ts in run.times.items()}
        mb = {fmt: rows * context * per_token[fmt] / 1e6 for fmt in FORMATS}
        result["decode_ms"][str(rows)] = med                              # type: ignore[index]
        result["kv_mb_per_step"][str(rows)] = mb                          # type: ignore[index]
        print(f"{rows:>4} {med['auto']:>10.2f} {med['int8']:>10.2f}   bf16/int8 "
              f"{med['auto'] / med['int8']:.2f}x; mean context {context:.0f}; K/V read per step "
              f"{mb['auto']:.1f} MB / {mb['int8']:.1f} MB", flush=True)
    print("tokens a 2 GiB pool holds: " + ", ".join(
        f"{'bf16' if f == 'auto' else f} {n:,}" for f, n in result["tokens_per_2gib"].items()))
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
