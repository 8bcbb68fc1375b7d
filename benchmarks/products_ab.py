"""The 8-bit products of the checkout (`q4q8_linear`, `q8q8_linear`) against another version of
engine/kernels/csrc/q4q8_linear.cpp, on the same operands in the same run.

Run from the repository root, e.g. against the previous commit's source::

    git show HEAD~1:engine/kernels/csrc/q4q8_linear.cpp > /tmp/old.cpp
    python -m benchmarks.products_ab --baseline /tmp/old.cpp [--rows 1,32,274,1024] [--rounds 7]
    python -m benchmarks.products_ab --baseline /tmp/old.cpp --rows 1,4 --copies 30   # from memory
    python -m benchmarks.products_ab --march x86-64-v3     # this host's build against the AVX2 one

`--march ARCH` (instead of `--baseline`) builds the checkout's own q4q8_linear.cpp for
`-march=ARCH` as the baseline: `--march x86-64-v3` on an AVX512-VNNI host times the AVX2 kernels
against the AVX512 ones and checks that the two give the same bits, as they must.

The baseline is built as `torch.ops.genserve_baseline.*` (`benchmarks._baseline`). Operands: the
embedded SmolLM2-135M's block matrices (`q4q8_linear` at wqkv 960 × 576, w13 3,072 × 576 and
w2 576 × 1,536: one layer's products) and its output projection (`q8q8_linear` at 49,152 × 576),
random Q4_1 / Q8_0 blocks of those shapes (`--copies` distinct ones of each block-matrix shape,
default 1, so one layer's 2.5 MB stay in cache between calls unless more are asked for) and
N(0, 1) bf16 inputs of each row count. Both builds
must give the same bits (the products' arithmetic is fixed; only the schedule may change), and the
run stops if they do not.

Per row count and op: `rounds` rounds, each timing 3 calls of the checkout's op and then 3 of the
baseline's over all of the op's shapes; the best round of each (so load from other processes, which
moves this machine's speed by 2× within an hour, weighs on both alike), in ms and GMAC/s
(multiply-accumulates: rows · N · K summed over the shapes), and the ratio checkout / baseline.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import torch

from benchmarks._baseline import CSRC, build_baseline
from benchmarks.avx2_products import SHAPES, random_blocks
from engine import kernels
from engine.model import quant
from engine.model.weights import Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES

# (N, K) of the embedded model's products, as `benchmarks.avx2_products` times them
Q4_SHAPES = [SHAPES[name] for name in ("wqkv", "w13", "w2")]   # the block matrices (Q4_1)
Q8_SHAPES = [SHAPES["LM head"]]                                 # the output projection (Q8_0)


def renames(library: str) -> list[tuple[str, str]]:
    """The replacements that make q4q8_linear.cpp register its ops as `torch.ops.<library>.*`
    (and define them in a namespace of that name), for `benchmarks._baseline.build_baseline`."""
    return [("TORCH_LIBRARY_FRAGMENT(genserve, m)", f"TORCH_LIBRARY({library}, m)"),
            ("TORCH_LIBRARY_IMPL(genserve, CPU, m)", f"TORCH_LIBRARY_IMPL({library}, CPU, m)"),
            ("namespace genserve {", f"namespace {library} {{"),
            ("&genserve::", f"&{library}::")]


RENAMES = renames("genserve_baseline")


def build_variant(path: str | pathlib.Path = CSRC / "q4q8_linear.cpp",
                  library: str = "genserve_baseline", march: str | None = None) -> Any:
    """Build a q4q8_linear.cpp (default: the checkout's) as `torch.ops.<library>`, for this host or
    (`march`) for `-march=<march>`; returns that op namespace (`.q4q8_linear`, `.q8q8_linear`).

    Raises:
        ValueError: the source does not register its ops the way `renames` expects.
        RuntimeError: the build failed (from torch.utils.cpp_extension).
    """
    build_baseline(path, renames(library), march=march)
    return getattr(torch.ops, library)


def time_pair(ops: tuple, operands: list[tuple], rounds: int) -> tuple[float, float]:
    """Best-of-`rounds` seconds for one pass over `operands` ((x, packed, n) each) of ops[0] and
    of ops[1], the two timed alternately in every round."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, op in enumerate(ops):
            start = time.perf_counter()
            for _ in range(3):
                for x, packed, n in operands:
                    op(x, packed, n)
            best[i] = min(best[i], (time.perf_counter() - start) / 3)
    return best[0], best[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another q4q8_linear.cpp")
    parser.add_argument("--march", metavar="ARCH",
                        help="instead of --baseline: the checkout's source built for -march=ARCH "
                             "(e.g. x86-64-v3: AVX2)")
    parser.add_argument("--rows", default="1,32,274,1024", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--copies", type=int, default=1,
                        help="distinct weights per shape: 30 (the model's layers) puts the block "
                             "matrices' 80 MB beyond the last-level cache, as in a decode step")
    opts = parser.parse_args(argv)
    if bool(opts.baseline) == bool(opts.march):
        parser.error("give --baseline (another source) or --march (another target), one of them")
    if not kernels.q4q8_linear_available():
        print("q4q8_linear is not built on this CPU (it needs AVX2 and FMA, or AVX512-VNNI)")
        return 1
    build_variant(opts.baseline or CSRC / "q4q8_linear.cpp", march=opts.march)
    gen = torch.Generator().manual_seed(0)
    packs = {"q4q8_linear": [(quant.q4q8_pack(random_blocks(n, k, Q4_1_BLOCK_BYTES, gen)), n, k)
                             for _ in range(opts.copies) for n, k in Q4_SHAPES],
             "q8q8_linear": [(quant.q8q8_pack(random_blocks(n, k, Q8_0_BLOCK_BYTES, gen)), n, k)
                              for n, k in Q8_SHAPES]}
    print(f"{'op':<12} {'rows':>5} {'checkout ms':>12} {'GMAC/s':>7} {'baseline ms':>12} "
          f"{'GMAC/s':>7} {'checkout / baseline':>20}")
    for rows in (int(r) for r in opts.rows.split(",")):
        for name, shapes in packs.items():
            ops = (getattr(torch.ops.genserve, name), getattr(torch.ops.genserve_baseline, name))
            inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, _, k in shapes}
            operands = [(inputs[k], packed, n) for packed, n, k in shapes]
            for x, packed, n in operands:
                if not torch.equal(ops[0](x, packed, n), ops[1](x, packed, n)):
                    print(f"{name} at {rows} rows: the two builds give different bits")
                    return 1
            ours, theirs = time_pair(ops, operands, opts.rounds)
            macs = rows * sum(n * k for _, n, k in shapes)
            print(f"{name:<12} {rows:5d} {ours * 1e3:12.2f} {macs / ours / 1e9:7.1f} "
                  f"{theirs * 1e3:12.2f} {macs / theirs / 1e9:7.1f} {ours / theirs:20.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
