"""The products against the host's own instruction rate: how far the 8-bit products
(`q4q8_linear`, `q8q8_linear`) and PyTorch's bf16 linear are from the ceiling of the unit each
runs on, measured on the same cores in the same run.

Run from the repository root (an AVX512-VNNI + AVX512-BF16 host)::

    python -m benchmarks.unit_rate [--rows 32,256,1024] [--rounds 5] [--json FILE]

First the ceilings: `benchmarks/unit_rate.cpp`, built here as a torch extension, runs 12
independent `vpdpbusd` (64 int8 multiply-adds each), `vdpbf16ps` (32 bf16 ones) or `vfmadd231ps`
zmm (16 fp32 ones) on every torch thread at once; the best of `rounds` runs, summed over the
threads, in G instructions and G multiply-adds a second. A fourth loop runs 12 `vpdpbusd` (as many
chains as the plain loop) beside 6 `vfmadd231ps`: its `vpdpbusd` rate over the plain one is
12 / 18 ≈ 0.67 where the two share the host's units and 1 where they do not.

That matters for `q4q8_linear`: per tile of 4 rows × 32 columns and block of 32 k its AVX512
loop (`panel_tile` in engine/kernels/csrc/q4q8_linear.cpp) issues 64 `vpdpbusd` and, for Q4_1 ×
Q8_1's per-block scales, 8 `vmulps` and 16 `vfmadd` (the block's scale product and its minimum
term, per row and 16 columns). Where those share the units, no schedule of that arithmetic runs
faster than 64 / 88 ≈ 0.73 of the `vpdpbusd` rate: the "Q4_1 bound" column.

Then the products, at each row count: `q4q8_linear` over one layer's block matrices of the
embedded SmolLM2-135M (wqkv 960 × 576, wo 576 × 576, w13 3,072 × 576, w2 576 × 1,536; random
Q4_1 blocks), `q8q8_linear` over the output projection (49,152 × 576, Q8_0), and
`torch.nn.functional.linear` in bf16 over the same block matrices (dense N(0, 1) weights;
PyTorch's CPU path, oneDNN on this kind of host). Each the best of `rounds` rounds of 3 passes,
the three timed in turn in every round, in G multiply-adds a second (rows · N · K summed over
the shapes) and as a share of its unit's ceiling (`vpdpbusd` for the 8-bit ones, `vdpbf16ps` for
bf16).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import zlib
from typing import Any, Callable

import torch

from benchmarks.avx2_products import random_blocks
from engine import kernels
from engine.model import quant
from engine.model.weights import Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES

SOURCE = pathlib.Path(__file__).resolve().parent / "unit_rate.cpp"
ITERS = 20_000_000                    # loop iterations of 12 instructions: ≈ 0.1 s at 3 G/s
MACS = {"vpdpbusd": 64, "vdpbf16ps": 32, "vfmadd": 16, "mix": 64}   # multiply-adds an instruction
SHARED_UNITS = 12 / 18        # "mix" over "vpdpbusd" where the two share the units
# One layer's block matrices (N, K) and the output projection, of the embedded SmolLM2-135M
BLOCK_SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536)}
OUTPUT_SHAPE = (49152, 576)
# q4q8_linear's AVX512 tile (4 rows x 32 columns, one block of 32 k): vpdpbusd, and the
# vmulps + vfmadd231ps of the per-block scales (see the module docstring)
TILE_VPDPBUSD, TILE_FMA_UNIT_OPS = 64, 8 + 16


def build() -> Any:
    """Build benchmarks/unit_rate.cpp (engine.kernels' compiler flags, `-march=native`) and return
    `torch.ops.genserve_unit_rate`. The build is named by the source and this CPU's flags, so a
    home directory shared between hosts never loads another CPU's binary.

    Raises:
        RuntimeError: the build failed (from torch.utils.cpp_extension).
    """
    from torch.utils import cpp_extension

    kernels.put_ninja_on_path()
    tag = zlib.crc32(SOURCE.read_bytes() + " ".join(sorted(kernels.cpu_flags())).encode())
    cpp_extension.load(name=f"genserve_unit_rate_{tag:08x}", sources=[str(SOURCE)],
                       extra_cflags=kernels.CFLAGS, is_python_module=False, verbose=False)
    return torch.ops.genserve_unit_rate


def instruction_rates(ops: Any, rounds: int) -> dict[str, float]:
    """Best-of-`rounds` instructions per second of each kind, summed over torch's threads (all
    running at once): {"vpdpbusd", "vdpbf16ps", "vfmadd", "mix"} -> instructions/s ("mix": its
    vpdpbusd)."""
    best = {kind: 0.0 for kind in MACS}
    for _ in range(rounds):
        for kind in MACS:
            best[kind] = max(best[kind], float(ops.instruction_rate(kind, ITERS).sum()))
    return best


def best_of(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Best-of-`rounds` seconds of one call of each of `fns` (3 calls a round, the fns in turn)."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(3):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / 3)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,256,1024", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the figures here too")
    opts = parser.parse_args(argv)
    try:
        rows_list = [int(r) for r in opts.rows.split(",")]
    except ValueError:
        parser.error(f"--rows takes comma-separated whole numbers, got {opts.rows!r}")
    if opts.rounds < 1 or any(r < 1 for r in rows_list):
        parser.error("--rounds and every --rows value must be >= 1")
    if not {"avx512_vnni", "avx512_bf16"} <= kernels.cpu_flags() or not kernels.q4q8_linear_available():
        print("this benchmark needs AVX512-VNNI and AVX512-BF16 (and genserve's kernels built)",
              file=sys.stderr)
        return 1
    ops = build()
    rates = instruction_rates(ops, opts.rounds)
    threads = torch.get_num_threads()
    print(f"the host's units, {threads} threads at once (best of {opts.rounds}):")
    for kind, rate in rates.items():
        label = "vpdpbusd beside vfmadd 12:6" if kind == "mix" else kind
        print(f"  {label:<28} {rate / 1e9:6.2f} G instructions/s  {rate * MACS[kind] / 1e9:7.1f} G multiply-adds/s")
    shared = rates["mix"] / rates["vpdpbusd"]
    int8_peak = rates["vpdpbusd"] * MACS["vpdpbusd"]
    bf16_peak = rates["vdpbf16ps"] * MACS["vdpbf16ps"]
    bound = TILE_VPDPBUSD / (TILE_VPDPBUSD + TILE_FMA_UNIT_OPS)
    print(f"  vpdpbusd beside vfmadd / vpdpbusd alone: {shared:.2f} ({SHARED_UNITS:.2f}: one set of units; 1: separate)")
    print(f"  Q4_1 bound (where they share): {bound:.2f} of vpdpbusd's rate = {bound * int8_peak / 1e9:.1f} G/s")

    gen = torch.Generator().manual_seed(0)
    q4 = [(quant.q4q8_pack(random_blocks(n, k, Q4_1_BLOCK_BYTES, gen)), n, k) for n, k in BLOCK_SHAPES.values()]
    bf = [(torch.randn(n, k, generator=gen).bfloat16(), n, k) for n, k in BLOCK_SHAPES.values()]
    q8 = quant.q8q8_pack(random_blocks(*OUTPUT_SHAPE, Q8_0_BLOCK_BYTES, gen))
    block_macs = sum(n * k for n, k in BLOCK_SHAPES.values())
    results: list[dict] = []
    print(f"\n{'rows':>5} {'q4q8 G/s':>9} {'of vpdpbusd':>12} {'of Q4_1 bound':>14} {'q8q8 G/s':>9} "
          f"{'of vpdpbusd':>12} {'bf16 linear G/s':>16} {'of vdpbf16ps':>13} {'q4q8 / bf16':>12}")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in BLOCK_SHAPES.values()}
        x_out = torch.randn(rows, OUTPUT_SHAPE[1], generator=gen).bfloat16()
        fns = {
            "q4q8": lambda: [torch.ops.genserve.q4q8_linear(xs[k], w, n) for w, n, k in q4],
            "q8q8": lambda: torch.ops.genserve.q8q8_linear(x_out, q8, OUTPUT_SHAPE[0]),
            "bf16": lambda: [torch.nn.functional.linear(xs[k], w) for w, n, k in bf],
        }
        secs = best_of(fns, opts.rounds)
        row = {"rows": rows,
               "q4q8_gmacs": rows * block_macs / secs["q4q8"] / 1e9,
               "q8q8_gmacs": rows * OUTPUT_SHAPE[0] * OUTPUT_SHAPE[1] / secs["q8q8"] / 1e9,
               "bf16_gmacs": rows * block_macs / secs["bf16"] / 1e9}
        results.append(row)
        print(f"{rows:5d} {row['q4q8_gmacs']:9.1f} {row['q4q8_gmacs'] * 1e9 / int8_peak:12.2f} "
              f"{row['q4q8_gmacs'] * 1e9 / (bound * int8_peak):14.2f} {row['q8q8_gmacs']:9.1f} "
              f"{row['q8q8_gmacs'] * 1e9 / int8_peak:12.2f} {row['bf16_gmacs']:16.1f} "
              f"{row['bf16_gmacs'] * 1e9 / bf16_peak:13.2f} {row['q4q8_gmacs'] / row['bf16_gmacs']:12.2f}")
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(
            {"threads": threads, "instructions_per_s": rates, "multiply_adds_per_instruction": MACS,
             "q4_1_bound": bound, "products": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
