"""The machine-limit measurements the benchmarks share: best-of-N timing, the bf16/fp32 GEMM
rate, and memory read and copy bandwidth, all with torch on this process's threads.

`benchmarks.engine` prints them as the machine's limits, `benchmarks.decode_attention` measures its
kernel against `read_gbps`, and `benchmarks.peer` records `gemm_gflops` and `read_gbps` before and
after its run. This module imports nothing else of the repository, so any benchmark can import it
at the top.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch


def best_s(fn: Callable[[], object], repeats: int) -> float:
    """The shortest wall time of `repeats` calls of `fn`, in seconds (`time.perf_counter`), after
    one untimed warm-up call (allocation, kernel choice)."""
    fn()                                            # warm-up: allocation, kernel choice
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Best-of-`repeats` n³ `torch.matmul` rate in GFLOP/s (2·n³ FLOPs per product)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_s(lambda: torch.matmul(a, b), repeats) / 1e9


def read_gbps(mib: int, repeats: int) -> float:
    """Best-of-`repeats` read bandwidth of `torch.sum` over `mib` MiB of fp32, bytes read, GB/s
    (10⁹ bytes per second)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return src.numel() * src.element_size() / best_s(lambda: src.sum(), repeats) / 1e9


def copy_gbps(mib: int, repeats: int) -> float:
    """Best-of-`repeats` bandwidth of `dst.copy_(src)` over `mib` MiB, bytes read + written, GB/s
    (10⁹ bytes per second)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / best_s(lambda: dst.copy_(src), repeats) / 1e9


def submit_random_prompts(engine, rows: int, prompt_len: int, max_tokens: int, request_prefix: str,
                          generator: torch.Generator) -> list:
    """Submit `rows` greedy `ignore_eos` requests of `prompt_len` token ids drawn from
    [10, vocab) by `generator` (the engine's model's vocabulary), `max_tokens` each, ids
    `{request_prefix}-{i}`; returns the requests (`engine.core.request.Request`)."""
    from engine.core.request import Request, SamplingParams

    vocab = engine.executor.model.args.vocab_size
    reqs = []
    for i in range(rows):
        ids = torch.randint(10, vocab, (prompt_len,), generator=generator).tolist()
        reqs.append(Request(f"{request_prefix}-{i}", "bench", ids, max_tokens,
                            SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
        engine.submit(reqs[-1])
    return reqs


def decoding(engine, rows: int) -> bool:
    """Whether `engine` runs `rows` requests and every one has sampled a token (past prefill)."""
    running = engine.scheduler.running
    return len(running) == rows and all(r.generated for r in running)


def step_in_turn(engines: dict, rows: int, steps: int, submit: Callable[[str, object], object],
                 before_step: Callable[[str], None] | None = None,
                 on_step: Callable[[object], None] | None = None) -> dict[str, list[float]]:
    """The in-turn decode schedule: `submit(name, engine)` gives each engine its `rows` requests,
    each prefills until every row decodes, then the engines take one step each in turn, `steps`
    times (so load from other processes falls on all alike), and run to the end. Returns, per
    engine, the executor's seconds of each counted pure-decode step at `rows` rows
    (`Engine.step_listeners`); `on_step(plan)` sees each counted step's plan, `before_step(name)`
    is called before each of engine `name`'s steps until the counted phase ends."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, engine in engines.items():
        submit(name, engine)
        while engine.scheduler.has_work and not decoding(engine, rows):
            if before_step:
                before_step(name)
            engine.step()                      # prefill (and the first decode steps)

    def listener(name: str):
        def record(plan, events, step_s: float) -> None:
            if plan.num_decode_rows == rows and plan.num_prefill_tokens == 0:
                times[name].append(step_s)
                if on_step:
                    on_step(plan)
        return record

    hooks = {name: listener(name) for name in engines}
    for name, engine in engines.items():
        engine.step_listeners.append(hooks[name])
    try:
        for _ in range(steps):
            for name, engine in engines.items():
                if before_step:
                    before_step(name)
                engine.step()
    finally:
        for name, engine in engines.items():
            engine.step_listeners.remove(hooks[name])
    for engine in engines.values():
        engine.run_until_idle()
    return times
