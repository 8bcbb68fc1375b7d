"""The block matrices of a 1B-class Llama step from Q4_K / Q6_K blocks (`qk_linear`) against the
same weights dequantized to bf16 on the bf16 path, in one run.

Run from the repository root::

    python -m benchmarks.kquant [--layers 16] [--rows 1,32] [--steps 15] [--threads 0] [--json PATH]

(GENSERVE_QK_PATH=avx2 or scalar runs `qk_linear`'s other paths on the same host.)

The shape is Llama 3.2 1B's: dim 2,048, 32 query heads and 8 KV heads of 64, SwiGLU 8,192, 16
layers, so per layer wqkv [3,072, 2,048], wo [2,048, 2,048], w13 [16,384, 2,048], w2 [2,048,
8,192]. The types are a Q4_K_M file's (llama.cpp's `use_more_bits` layers, 8 of 16 here, take
attn_v and ffn_down as Q6_K; every other matrix is Q4_K): wqkv is Q4_K | Q4_K | Q6_K rows there.
The blocks are random (valid: any byte of the quants and 6-bit scales, sane fp16 d and dmin); the
bf16 weights are exactly their values (`engine.model.kquant.qk_dequantize`, then bf16), packed for
the bf16 product as the engine packs a model on this CPU (`engine.model.linear.pack_weights`).

A step is every layer's four products (`engine.model.linear.linear`) on fixed random inputs of
that many rows, as a decode step runs them (attention, norms and the output projection left out):
each weight is read from memory once per step, since 16 layers do not fit in the caches. The two
kinds of step alternate, ``--steps`` times each, so load from other processes falls on both
alike; printed: the median ms per step, the ratio, and the weight bytes each reads. Other
processes on the machine distort the figures; the header prints the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.model import kquant
from engine.model.kquant import Q4_K, Q6_K
from engine.model.linear import PackedWeight, linear, pack_weights
from engine.runner.builder import set_threads

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN = 2048, 32, 8, 64, 8192


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits` (llama-quant.cpp): the layers whose attn_v and ffn_down a
    Q4_K_M file stores as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(kind: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Valid random blocks uint8 [n, k / 256 · bytes] of `kind`, file order."""
    nb = k // 256
    if kind == Q4_K:
        d = (torch.rand(n, nb, 1, generator=gen) * 2e-4 + 1e-5).half().view(torch.uint8)
        dmin = (torch.rand(n, nb, 1, generator=gen) * 2e-4).half().view(torch.uint8)
        rest = torch.randint(0, 256, (n, nb, 140), generator=gen, dtype=torch.uint8)
        return torch.cat([d, dmin, rest], -1).reshape(n, nb * 144)
    q = torch.randint(0, 256, (n, nb, 192), generator=gen, dtype=torch.uint8)
    sc = torch.randint(-64, 64, (n, nb, 16), generator=gen, dtype=torch.int8).view(torch.uint8)
    d = (torch.rand(n, nb, 1, generator=gen) * 2e-5 + 1e-6).half().view(torch.uint8)
    return torch.cat([q, sc, d], -1).reshape(n, nb * 210)


def layer_parts(i: int, n_layers: int) -> dict[str, list[tuple[int, int, int]]]:
    """Per block matrix of layer i, its row parts (kind, rows, in_features) in fused order."""
    v = Q6_K if use_more_bits(i, n_layers) else Q4_K
    return {"wqkv": [(Q4_K, HEADS * HEAD_DIM, DIM), (Q4_K, KV_HEADS * HEAD_DIM, DIM),
                     (v, KV_HEADS * HEAD_DIM, DIM)],
            "wo": [(Q4_K, DIM, HEADS * HEAD_DIM)],
            "w13": [(Q4_K, FFN, DIM), (Q4_K, FFN, DIM)],
            "w2": [(v, DIM, FFN)]}


def build(n_layers: int) -> tuple[list[tuple[torch.Tensor, PackedWeight]],
                                  list[tuple[torch.Tensor, PackedWeight]], dict[str, int]]:
    """(bf16 matrices, K-quant matrices, bytes) for `n_layers` layers: each a list of (weight,
    PackedWeight) in step order; bytes: the weight bytes each kind reads per step."""
    gen = torch.Generator().manual_seed(0)
    weights, quants = [], []
    for i in range(n_layers):
        for name, parts in layer_parts(i, n_layers).items():
            blocks = [(kind, random_blocks(kind, rows, k, gen)) for kind, rows, k in parts]
            weights.append(torch.cat([kquant.qk_dequantize(b, kind) for kind, b in blocks]
                                     ).to(torch.bfloat16))
            quants.append(kquant.qk_weight(blocks))
    packed = pack_weights(weights)
    bf16 = [(w, p) for w, p in zip(weights, packed)]
    qk = [(w, PackedWeight(w[:0], 0, qk=q)) for w, q in zip(weights, quants)]   # the bf16 copy is not read
    nbytes = {"bf16": sum(w.numel() * 2 for w in weights), "qk": sum(q.nbytes for q in quants)}
    return bf16, qk, nbytes


def step(matrices: list[tuple[torch.Tensor, PackedWeight]], inputs: dict[int, torch.Tensor]) -> None:
    for weight, packed in matrices:
        linear(inputs[weight.shape[1]], weight, packed)


def describe(packed: PackedWeight) -> str:
    """Which product the bf16 path runs, in words."""
    if packed is None:
        return "F.linear"
    if packed.fma:
        return "fma_linear"
    if packed.f32 is not None:
        return "fp32 copies"
    if packed.tile_rows:
        return f"oneDNN in {packed.tile_rows}-row calls"
    if packed.k_chunk:
        return f"packed_linear up to {packed.max_rows} rows, oneDNN above"
    return "oneDNN"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="layers (Llama 3.2 1B: 16)")
    parser.add_argument("--rows", default="1,32", help="rows per step, comma-separated")
    parser.add_argument("--steps", type=int, default=15, help="steps of each kind per row count")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the figures here")
    opts = parser.parse_args(argv)
    if not kernels.available():
        print("genserve's kernels did not build here; qk_linear needs them", file=sys.stderr)
        return 1
    set_threads(EngineConfig(num_threads=opts.threads))
    forced = kquant.qk_path_from_env()                   # GENSERVE_QK_PATH, for the other paths
    path = forced if forced >= 0 else max(kernels.qk_paths())
    print(f"# load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs, {torch.get_num_threads()} "
          f"torch threads; qk_linear path {kernels.QK_PATH_NAMES[path]} (others' load distorts "
          "the figures)", flush=True)
    t0 = time.perf_counter()
    bf16, qk, nbytes = build(opts.layers)
    print(f"# {opts.layers} layers built in {time.perf_counter() - t0:.0f} s; bf16 product: "
          f"{describe(bf16[0][1])}", flush=True)
    result: dict[str, object] = {"layers": opts.layers, "threads": torch.get_num_threads(),
                                 "path": kernels.QK_PATH_NAMES[path],
                                 "load_average_start": os.getloadavg()[0], "steps": opts.steps,
                                 "weight_mb_per_step": {k: v / 1e6 for k, v in nbytes.items()},
                                 "step_ms": {}}
    print(f"{'rows':>4} {'bf16 ms':>9} {'Q4_K/Q6_K ms':>13} {'speed-up':>9}   (median of "
          f"{opts.steps} steps each, in turn)")
    for rows in (int(r) for r in opts.rows.split(",")):
        gen = torch.Generator().manual_seed(rows)
        inputs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in (DIM, FFN)}
        times: dict[str, list[float]] = {"bf16": [], "qk": []}
        for kind in times:                                   # warm-up: allocation, kernel choice
            step(bf16 if kind == "bf16" else qk, inputs)
        for _ in range(opts.steps):
            for kind, matrices in (("bf16", bf16), ("qk", qk)):
                t = time.perf_counter()
                step(matrices, inputs)
                times[kind].append(time.perf_counter() - t)
        med = {kind: statistics.median(ts) * 1e3 for kind, ts in times.items()}
        result["step_ms"][str(rows)] = med                                       # type: ignore[index]
        print(f"{rows:>4} {med['bf16']:>9.1f} {med['qk']:>13.1f} {med['bf16'] / med['qk']:>8.2f}x",
              flush=True)
    result["load_average_end"] = os.getloadavg()[0]
    print(f"weight MB read per step: bf16 {nbytes['bf16'] / 1e6:.0f}, Q4_K/Q6_K {nbytes['qk'] / 1e6:.0f}"
          f" ({nbytes['bf16'] / nbytes['qk']:.2f}x fewer); load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
