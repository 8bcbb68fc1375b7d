"""The matrix-product paths of a CPU without bf16 arithmetic (AVX2 alone) against each other, the
engine on the embedded model, all measured in one run.

Run from the repository root::

    python -m benchmarks.avx2_products              # the engine on each path
    python -m benchmarks.avx2_products --matrices   # one layer's products, per call

Four paths, one engine each:

* `q4q8`: the GGUF's Q4_1 blocks times inputs rounded to 8 bits per row and block of 32
  (llama.cpp's arithmetic, engine/kernels/csrc/q4q8_linear.cpp on vpmaddubsw), which
  `--weights auto` takes there (`EngineConfig()`);
* `fma_linear`: genserve's kernel over the bf16 weights in panels, which `pack_weights` takes
  there for `--weights bf16`, the exact products (engine/kernels/csrc/fma_linear.cpp);
* fp32 copies: `engine.model.linear.fp32_linear` (the BLAS over fp32 copies of the weights), its
  fallback where the kernels are not built, got by reporting `fma_linear` unavailable;
* bf16: torch's bf16 `F.linear`, the path before both, got by reporting bf16 arithmetic.

Each engine times, from `Engine.step_listeners` (the executor's time): one 512-token prompt's
prefill (`max_tokens` 1), the median 1-row decode step of 64 greedy tokens, and the median 32-row
decode step of 32 greedy streams of 32 tokens. On a CPU with bf16 arithmetic all engines take the
same bf16 path. `--matrices` times single products of the embedded model's
shapes on each path instead (random bf16 operands, median of 0.3 s of calls). Figures:
docs/benchmarks/linear.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import EngineConfig
from engine.core.request import Request, SamplingParams
from engine.model import linear, quant
from engine.model.weights import Q4_1_BLOCK_BYTES
from engine.runner.builder import build_engine


def measure(weights: str = "bf16") -> dict[str, float]:
    """The three step times, ms, of a fresh engine with `--weights weights` on the path
    `pack_weights` takes now."""
    engine = build_engine(EngineConfig(weights=weights), None, calibrate=False).engine
    steps: list[tuple[int, int, float]] = []
    engine.step_listeners.append(lambda plan, _, s: steps.append(
        (plan.num_prefill_tokens, plan.num_decode_rows, s)))
    words = list(range(1000, 1512))

    def run(prompts: list[list[int]], tokens: int) -> None:
        steps.clear()
        for i, prompt in enumerate(prompts):
            engine.submit(Request(f"r{time.monotonic_ns()}-{i}", "", list(prompt), tokens,
                                  SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
        engine.run_until_idle()

    run([words[:100]], 4)                                          # warm-up
    run([[7] + words[:511]], 1)
    prefill = sum(s for p, _, s in steps if p > 0)
    run([words[:16]], 64)
    one = statistics.median(s for p, d, s in steps if p == 0 and d == 1)
    run([[i + 1] + words[:15] for i in range(32)], 32)
    rows32 = statistics.median(s for p, d, s in steps if p == 0 and d == 32)
    return {"prefill_512_ms": 1e3 * prefill, "decode_1_row_ms": 1e3 * one, "decode_32_rows_ms": 1e3 * rows32}


# The embedded model's (SmolLM2-135M's) matrix shapes [out, in]: fused QKV, fused gate-up, down
# projection, LM head.
SHAPES = {"wqkv": (960, 576), "w13": (3072, 576), "w2": (576, 1536), "LM head": (49152, 576)}


def random_blocks(n: int, k: int, block_bytes: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k / 32 · block_bytes]: random ggml blocks whose fp16 scale (and Q4_1's minimum)
    is 0.00706 (and -0.0078125) in every block, so the products stay in range."""
    blocks = torch.randint(0, 256, (n, k // 32, block_bytes), generator=gen, dtype=torch.uint8)
    head = [0x3C, 0x1F, 0x00, 0xA0] if block_bytes == Q4_1_BLOCK_BYTES else [0x3C, 0x1F]
    blocks[..., :len(head)] = torch.tensor(head, dtype=torch.uint8)
    return blocks.view(n, -1)


def _per_call_ms(fn) -> float:
    """Median time of one call of `fn`, ms, over 0.3 s of calls after one warm-up call."""
    fn()
    times = []
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def matrices(rows: tuple[int, ...] = (1, 32, 512)) -> None:
    """Print one product's time per path, shape and row count (ms)."""
    gen = torch.Generator().manual_seed(0)
    print(f"  {'matrix':<8} {'rows':>5} {'bf16':>9} {'fp32 copies':>12} {'fma_linear':>11} "
          f"{'q4q8':>9}")
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        panels, f32 = linear.panel_pack(w), linear._fp32_copy(w, {})
        # random Q4_1 blocks of the same shape (the LM head is not a Q4_1 matrix in the file,
        # but its shape times the same op shows what the op does at N = 49,152)
        q4q8 = quant.q4q8_pack(random_blocks(n, k, Q4_1_BLOCK_BYTES, gen))
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            bf16 = _per_call_ms(lambda: F.linear(torch.cat([x, x]) if m == 1 else x, w))
            fp32 = _per_call_ms(lambda: linear.fp32_linear(x, f32.f32, f32.call_rows))
            fma = _per_call_ms(lambda: torch.ops.genserve.fma_linear(x, panels))
            q = _per_call_ms(lambda: torch.ops.genserve.q4q8_linear(x, q4q8, n))
            print(f"  {name:<8} {m:5d} {bf16:9.3f} {fp32:12.3f} {fma:11.3f} {q:9.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrices", action="store_true",
                        help="time single products of the model's shapes instead of the engine")
    if parser.parse_args().matrices:
        if not (kernels.fma_linear_available() and kernels.q4q8_linear_available()):
            print("fma_linear and q4q8_linear are not both built on this CPU (they need AVX2, FMA "
                  "and g++)")
            return 1
        matrices()
        return 0
    q4q8 = measure("q4q8")
    fma = measure()
    with mock.patch.object(kernels, "fma_linear_available", lambda: False):
        fp32 = measure()
    with mock.patch.object(linear, "bf16_arithmetic", lambda: True):
        bf16 = measure()
    print(f"CPU without bf16 arithmetic: {not linear.bf16_arithmetic()}; "
          f"fma_linear built: {kernels.fma_linear_available()}")
    print(f"  {'ms':<18} {'bf16':>9} {'fp32 copies':>12} {'fma_linear':>11} {'q4q8':>9} "
          f"{'fma/bf16':>9} {'fma/fp32':>9} {'q4q8/fma':>9}")
    for key in fma:
        print(f"  {key:<18} {bf16[key]:9.1f} {fp32[key]:12.1f} {fma[key]:11.1f} {q4q8[key]:9.1f} "
              f"{bf16[key] / fma[key]:8.2f}x {fp32[key] / fma[key]:8.2f}x "
              f"{fma[key] / q4q8[key]:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
