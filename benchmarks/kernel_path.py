"""genserve's CPU kernel path against the torch path on one engine, step by step.

Run from the repository root::

    python -m benchmarks.kernel_path --model <gguf or checkpoint> [--threads 1] [--steps 40] [--rows 1,32]
    python -m benchmarks.kernel_path --moe-layers 2 [--threads 1] [--steps 30]

One engine (`--model`: as `genserve serve` builds it; `--moe-layers`: `benchmarks.moe`'s
Qwen3-30B-A3B-shaped MoE of that many layers, random bf16 weights) gets `rows` greedy requests of
64 token ids and prefills them; then its pure-decode steps alternate between the kernel path
(`ModelRunner.kernels = True`: `KernelLayerOps` and the "cpu-kernels" attention backend) and the
torch path (`kernels = False`: torch ops and SDPA), one step each, `--steps` steps in all, over
the same running batch, so load from other processes weighs on both alike. Printed per row
count: the median executor time of each path's steps (forward, logits, sampling), their ratio,
and the median of the ratios of adjacent step pairs.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams


def alternate(engine: Engine, rows: int, steps: int, prompt_len: int = 64) -> dict[bool, list[float]]:
    """Executor ms of `steps` pure-decode steps at `rows` rows, alternating torch path (even
    steps) and kernel path (odd steps): {kernels on: [ms, ...]}. Leaves the kernel path on and
    the engine idle. Raises AssertionError if a counted step is not a pure-decode step of `rows`."""
    executor = engine.executor
    times: list[tuple[int, int, float]] = []

    def listen(plan, events, seconds):
        times.append((plan.num_decode_rows, plan.num_prefill_tokens, seconds))

    engine.step_listeners.append(listen)
    g = torch.Generator().manual_seed(rows)
    vocab = min(engine.executor.model.args.vocab_size, 8000)
    for i in range(rows):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        engine.submit(Request(f"kp{rows}-{i}", "bench", prompt, steps + 6,
                              SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
    while not (times and times[-1][:2] == (rows, 0)):
        engine.step()
    engine.step()
    out: dict[bool, list[float]] = {False: [], True: []}
    for k in range(steps):
        on = k % 2 == 1
        executor.kernels = on
        n = len(times)
        engine.step()
        assert times[n][:2] == (rows, 0), times[n]
        out[on].append(1000 * times[n][2])
    executor.kernels = True
    engine.run_until_idle()
    engine.step_listeners.remove(listen)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or checkpoint directory")
    p.add_argument("--moe-layers", type=int, default=0, help="benchmarks.moe's shape, this many layers")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=40, help="counted steps per row count (both paths)")
    p.add_argument("--rows", default="1,32")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows_list = [int(r) for r in a.rows.split(",")]
    if a.moe_layers:
        from benchmarks import moe

        model = moe.build_model(moe.moe_args(moe.QWEN3_30B_A3B, a.moe_layers, 8192), 0)
        engine = moe.build_engine(model, max(rows_list), 64, a.steps + 10)
    else:
        from engine.config import EngineConfig
        from engine.runner.builder import build_engine

        engine = build_engine(EngineConfig(device="cpu", num_threads=a.threads, prefix_caching=False,
                                           queue_budget_s=1e9), a.model, calibrate=False).engine
    ex = engine.executor
    print(f"default path: kernels={ex.kernels}, attention {ex.attention.name}, {ex.layer_ops.__name__}")
    for rows in rows_list:
        res = alternate(engine, rows, a.steps)
        off, on = statistics.median(res[False]), statistics.median(res[True])
        pairs = statistics.median(x / y for x, y in zip(res[False], res[True]))
        print(f"rows {rows:2d}: torch path {off:.1f} ms, kernel path {on:.1f} ms (median of "
              f"{len(res[True])} steps each, alternated): {off / on:.2f}x; adjacent pairs {pairs:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
