"""Decode attention microbenchmark: `torch.ops.genserve.paged_decode` over one decode step's keys
and values at long contexts, against the read bandwidth measured in the same run.

Run from the repository root::

    python -m benchmarks.decode_attention [--rows 32] [--context 1500] [--repeats 5]
                                          [--baseline PATH] [--json PATH]

`python -m benchmarks.engine` runs the same measurement (32 rows × 1,500 tokens) in every run.
Each layout is measured twice: bf16 pools, and pools in the 8-bit format (`engine.attention.kv_quant`,
66-byte rows: 0.52× the bytes; keys "..._int8").

What is measured: one step's decode attention — SmolLM2-135M's shape (30 layers, 9 query heads
over 3 KV heads of 64 dimensions, bf16, 16-token blocks), one `paged_decode` call per layer, each
layer with its own pools — `rows` rows of `context` tokens each:

    K/V bytes = layers · rows · context · kv_heads · head_dim · 2 (K and V) · 2 (bytes per bf16)
              = 30 · 32 · 1,500 · 3 · 64 · 2 · 2 = 1,105,920,000 at the default sizes

Each layer's pools hold rows · ⌈context / 16⌉ blocks plus 64 spare, handed out to the rows in a
shuffled order (a long-running server's block tables are scattered across the pool); 1.1 GB in
all at the default sizes, more than the caches hold, so every step reads from memory. Step time is
the best of `repeats` steps after one warm-up step; GB/s = K/V bytes / step time; the ratio is step
time / (K/V bytes / read bandwidth), the read bandwidth being `benchmarks._measure.read_gbps`
(best-of-10 `torch.sum` over 256 MiB) measured in the same run.

Two memory layouts: the pools as torch allocates them (4 KB pages), and the same pools advised
for transparent huge pages before first touch, as the engine's KV cache asks for them
(`engine.runner.huge_pages`; where the kernel's THP mode is "never" the line is left out). With 4 KB pages every
16-token block of a layer's pool sits in its own pages, so reading a scattered block table costs a
TLB miss every few KB (a two-level walk under a hypervisor). A third line, "resident", gives every
row the same blocks (a layer's ⌈context / 16⌉ blocks, which stay in the caches after the first
row): the kernel's arithmetic with next to no reads from memory, the floor under the other lines
(its GB/s counts the bytes the kernel consumes, not bytes read from memory).

`--baseline PATH` also builds another version of `engine/kernels/csrc/decode_attention.cpp` (e.g. the
previous commit's, from `git show REV:engine/kernels/csrc/decode_attention.cpp > /tmp/old.cpp`) as
`torch.ops.genserve_baseline.paged_decode` and measures it in the same run, on the same pools.

`--march ARCH` builds the checkout's decode_attention.cpp (and the baseline) for `-march=ARCH`
instead of this host's, and measures those builds: `--march x86-64-v3` times the AVX2 kernel on
a host with AVX512 (the 8-bit lines are left out: only AVX512-BF16 builds read that format).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks._baseline import CSRC, build_baseline
from benchmarks._measure import best_s, read_gbps
from engine.attention.kv_quant import row_bytes
from engine.runner.huge_pages import huge_page_bytes, thp_mode
from engine.runner.kv_cache import zeroed_pool

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16    # SmolLM2-135M, the engine's blocks
SPARE_BLOCKS = 64


@dataclass(frozen=True, slots=True)
class AttentionResult:
    """One layout's measurement.

    Attributes:
        step_s: best step time (all layers), seconds.
        kv_bytes: keys and values the step must read, bytes.
        gbps: kv_bytes / step_s, GB/s (10⁹ bytes).
        over_floor: step_s / (kv_bytes / read bandwidth); 1.0 = reading at the measured rate.
        huge_mb: MB of the pools backed by huge pages (from /proc/self/smaps), 0 where unknown.
    """

    step_s: float
    kv_bytes: int
    gbps: float
    over_floor: float
    huge_mb: float


def kv_bytes(rows: int, context: int, eight_bit: bool = False) -> int:
    """Keys and values one decode step reads: layers · rows · context · kv_heads · head_dim · 2 · 2
    (bf16), or layers · rows · context · kv_heads · 66 · 2 (the 8-bit format's rows)."""
    row = row_bytes(HEAD_DIM) if eight_bit else HEAD_DIM * 2
    return LAYERS * rows * context * KV_HEADS * row * 2


def make_step(rows: int, context: int, huge: bool, seed: int = 0, eight_bit: bool = False,
              resident: bool = False):
    """Pools, queries, tables and lengths of one step (module docstring), filled with N(0, 1) bf16,
    or (`eight_bit`) with rows of the 8-bit format: uniform int8 q in -127..127, scales
    2^-13 .. 2^-6. `resident`: every row's table is the pool's first ⌈context / 16⌉ blocks, in
    order (the "resident" line), instead of distinct blocks in a shuffled order.

    Returns:
        (pools: list of `LAYERS` tensors [2, blocks, 16, 3, 64] bf16 or [2, blocks, 16, 3, 66]
         int8, q [rows, 9, 64] bf16, tables int64 [rows, ⌈context / 16⌉], lens int64 [rows]).
    """
    g = torch.Generator().manual_seed(seed)
    per_row = -(-context // BLOCK)
    blocks = rows * per_row + SPARE_BLOCKS
    pools = []
    for _ in range(LAYERS):
        shape = (2, blocks, BLOCK, KV_HEADS, row_bytes(HEAD_DIM) if eight_bit else HEAD_DIM)
        dtype = torch.int8 if eight_bit else torch.bfloat16
        # Huge pages exactly as the KV cache gets them (its zeroed pool, then filled in place).
        pool = zeroed_pool(shape, dtype, "cpu") if huge else torch.empty(shape, dtype=dtype)
        if eight_bit:
            pool[..., :HEAD_DIM] = torch.randint(-127, 128, (2, blocks, BLOCK, KV_HEADS, HEAD_DIM),
                                                 generator=g, dtype=torch.int8)
            exponents = torch.randint(127 - 7, 127, (2, blocks, BLOCK, KV_HEADS, 2), generator=g)
            pool[..., HEAD_DIM:] = exponents.to(torch.uint8).view(torch.int8)
        else:
            pool.normal_(generator=g)
        pools.append(pool)
    if resident:
        tables = torch.arange(per_row).repeat(rows, 1)
    else:
        tables = torch.randperm(blocks, generator=g)[:rows * per_row].view(rows, per_row).contiguous()
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).bfloat16()
    return pools, q, tables, torch.full((rows,), context, dtype=torch.long)


def time_step(op: Callable, pools, q, tables, lens, repeats: int) -> float:
    """Best-of-`repeats` time of one step (one `op` call per layer) after a warm-up step, seconds."""
    scale = HEAD_DIM ** -0.5

    def step() -> None:
        for pool in pools:
            op(q, pool[0], pool[1], tables, lens, scale)

    return best_s(step, repeats)


def baseline_op(path: str | pathlib.Path, library: str = "genserve_baseline",
                march: str | None = None) -> Callable:
    """Build another version of decode_attention.cpp as `torch.ops.<library>.paged_decode`.

    The source's op registration and its `genserve::paged_decode` definition are renamed; it is
    compiled with the flags of `engine.kernels` (with `march`: for `-march=<march>` instead of this
    host) against the current headers of engine/kernels/csrc (`benchmarks._baseline.build_baseline`).

    Raises:
        ValueError: the source does not define and register `paged_decode` the way the renaming
            expects.
        RuntimeError: the build failed (from torch.utils.cpp_extension).
    """
    build_baseline(path, [("TORCH_LIBRARY(genserve, m)", f"TORCH_LIBRARY({library}, m)"),
                          ("TORCH_LIBRARY_IMPL(genserve, CPU, m)",
                           f"TORCH_LIBRARY_IMPL({library}, CPU, m)"),
                          ("genserve::paged_decode", f"{library}_paged_decode")],
                   march=march)
    return getattr(torch.ops, library).paged_decode


def measure(read_gbps: float, rows: int = 32, context: int = 1500, repeats: int = 5,
            baseline: Callable | None = None, op: Callable | None = None) -> dict[str, AttentionResult]:
    """Time `torch.ops.genserve.paged_decode` (or `op`, another build of it; then without the
    8-bit lines) and `baseline`, on the same pools, per layout.

    Args:
        read_gbps: the read bandwidth measured in this run, GB/s.
        rows, context: rows of the step and tokens of each row's context.
        repeats: timed steps per kernel and layout (best taken).
        baseline: another build of the op (`baseline_op`), or None.
        op: the build measured as the checkout's (`baseline_op` of the checkout's source for
            another target); None: `torch.ops.genserve.paged_decode`.

    Returns:
        {"4k": ..., "thp": ... (where the kernel's THP mode is not "never"), "resident" (every
        row reading the same blocks), each with "_baseline" (with a baseline), "4k_int8",
        "thp_int8", "resident_int8" (genserve's op over pools in the 8-bit format, which its
        AVX512-BF16 build alone reads)}: `AttentionResult` each.

    Raises:
        RuntimeError: genserve's kernels are not available (`engine.kernels.available()`).
    """
    from engine import kernels

    if not kernels.available():
        raise RuntimeError("genserve's CPU kernels are not available; nothing to measure")
    layouts = ([("4k", False, False)] + ([("thp", True, False)] if thp_mode() not in ("never", "") else [])
               + [("resident", False, True)])
    ops = [("", op or torch.ops.genserve.paged_decode)] + ([("_baseline", baseline)] if baseline else [])
    eight_bit_too = op is None and kernels.int8_kv_decode_available()
    results = {}
    for name, huge, resident in layouts:
        for eight_bit in (False, True) if eight_bit_too else (False,):
            total = kv_bytes(rows, context, eight_bit)
            floor_s = total / (read_gbps * 1e9)
            before = huge_page_bytes() / 1e6
            step = make_step(rows, context, huge, eight_bit=eight_bit, resident=resident)
            huge_mb = max(0.0, huge_page_bytes() / 1e6 - before)
            for suffix, op in (ops[:1] if eight_bit else ops):
                t = time_step(op, *step, repeats)
                key = name + suffix + ("_int8" if eight_bit else "")
                results[key] = AttentionResult(t, total, total / t / 1e9, t / floor_s, huge_mb)
            del step
    return results


def main(argv: list[str] | None = None) -> int:
    from engine.config import EngineConfig
    from engine.runner.builder import set_threads

    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_attention",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", metavar="PATH", help="another decode_attention.cpp to measure beside")
    ap.add_argument("--march", metavar="ARCH", help="build the checkout's kernel and the baseline "
                                                    "for -march=ARCH (e.g. x86-64-v3: AVX2)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    opts = ap.parse_args(argv)
    threads = set_threads(EngineConfig())
    base = baseline_op(opts.baseline, march=opts.march) if opts.baseline else None
    checkout = (baseline_op(CSRC / "decode_attention.cpp", "genserve_checkout", opts.march)
                if opts.march else None)
    load = os.getloadavg()[0]
    bw = read_gbps(256, 10)
    results = measure(bw, opts.rows, opts.context, opts.repeats, base, checkout)
    built = f"built for -march={opts.march}" if opts.march else "this host's build"
    print(f"decode attention ({built}), {opts.rows} rows × {opts.context} tokens, {LAYERS} layers, "
          f"{threads} threads; read bandwidth {bw:.1f} GB/s; THP mode {thp_mode() or '?'}; 1-min load "
          f"average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    for name, r in results.items():
        print(f"  {name:<13} {1000 * r.step_s:8.1f} ms  {r.kv_bytes / 1e9:.3f} GB  {r.gbps:6.1f} GB/s  "
              f"{r.over_floor:5.2f} × bytes/read bw   (huge pages {r.huge_mb:.0f} MB)")
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(
            {"read_gbps": bw, "rows": opts.rows, "context": opts.context, "threads": threads,
             "march": opts.march, "results": {k: vars_of(r) for k, r in results.items()}}, indent=2))
    return 0


def vars_of(r: AttentionResult) -> dict[str, float]:
    """An `AttentionResult` as a dict (slots dataclasses have no __dict__)."""
    return {f: getattr(r, f) for f in r.__slots__}


if __name__ == "__main__":
    sys.exit(main())
