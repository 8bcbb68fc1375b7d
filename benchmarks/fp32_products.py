"""The fp32 copies against torch's bf16 `F.linear` on a CPU without bf16 arithmetic (AVX2 alone),
the engine on the embedded model, both measured in one run.

Run from the repository root::

    python -m benchmarks.fp32_products

For each path (the fp32 copies `engine.model.linear.fp32_linear`, which `pack_weights` takes
there, and the bf16 path before them, got by reporting bf16 arithmetic to `pack_weights`), one
engine (`EngineConfig()`) is built and times, from `Engine.step_listeners` (the executor's time):
one 512-token prompt's prefill (`max_tokens` 1), the median 1-row decode step of 64 greedy tokens,
and the median 32-row decode step of 32 greedy streams of 32 tokens. On a CPU with bf16
arithmetic both engines take the same path and the ratios are 1. Figures: docs/benchmarks/linear.md.
"""

from __future__ import annotations

import statistics
import time
from unittest import mock

from engine.config import EngineConfig
from engine.core.request import Request, SamplingParams
from engine.model import linear
from engine.runner.builder import build_engine


def measure() -> dict[str, float]:
    """The three step times, ms, of a fresh engine on the path `pack_weights` takes now."""
    engine = build_engine(EngineConfig(), None, calibrate=False).engine
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


def main() -> int:
    fp32 = measure()
    with mock.patch.object(linear, "bf16_arithmetic", lambda: True):
        bf16 = measure()
    print(f"fp32 copies taken on this CPU: {not linear.bf16_arithmetic()}")
    for key in fp32:
        print(f"  {key:<18} bf16 {bf16[key]:9.1f}  fp32 copies {fp32[key]:9.1f}  "
              f"speed-up {bf16[key] / fp32[key]:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
