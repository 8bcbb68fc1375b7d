"""Decode step time by the thread that runs it: why the engine is built on a thread that ends.

Run from the repository root::

    python -m benchmarks.openmp_pool [--rows 32] [--context 500] [--steps 20]

One engine (the default weights, no calibration) is built on a helper thread, which stays alive
until told to end; `--rows` requests with `--context`-token prompts are prefilled. Then pure
decode steps are timed (median of `--steps`, the executor's time from `Engine.step_listeners`):

1. on the helper thread, the one that built the engine;
2. on the main thread while the helper thread is still alive;
3. on the main thread after the helper thread has ended.

The kernels' parallel regions are OpenMP (libgomp) regions, and libgomp keeps a pool of worker
threads for every thread that has run one. Case 2 has two pools on the machine's cores; libgomp
then stops spin-waiting between regions and every region pays a futex wake-up. The figures and
what the server does about it: benchmarks/results/kernels/history.md, "One OpenMP pool" (summed up
in docs/benchmarks/kernels.md, "What later measurements settled").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading

from engine.config import EngineConfig
from engine.core.request import Request, SamplingParams
from engine.runner.builder import build_engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.openmp_pool", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=500, help="prompt tokens of every row")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per case")
    opts = p.parse_args(argv)

    built: dict = {}
    work: list = []                              # callables the helper thread runs, in order
    ready, done, leave = threading.Event(), threading.Event(), threading.Event()

    def helper() -> None:
        built["engine"] = build_engine(EngineConfig(max_rows=max(32, opts.rows)), calibrate=False).engine
        ready.set()
        while not leave.is_set():
            if work:
                work.pop(0)()
                done.set()
            leave.wait(0.01)

    thread = threading.Thread(target=helper, name="builder")
    thread.start()
    ready.wait()
    engine = built["engine"]
    times: list[float] = []
    engine.step_listeners.append(lambda plan, events, s: times.append(s) if not plan.num_prefill_tokens
                                 and plan.num_decode_rows == opts.rows else None)
    rng = random.Random(0)
    for i in range(opts.rows):
        engine.submit(Request(f"r{i}", "", [rng.randrange(1000, 40000) for _ in range(opts.context)],
                              10_000, SamplingParams(temperature=0, ignore_eos=True), 0.0, 0.0))

    def timed() -> float:
        times.clear()
        while len(times) < opts.steps:
            engine.step()
        return statistics.median(times) * 1000.0

    results: dict[str, float] = {}

    def on_helper() -> None:
        while not times:                          # prefill the rows first
            engine.step()
        results["on the thread that built the engine"] = timed()

    done.clear()
    work.append(on_helper)
    done.wait()
    results["on the main thread, the building thread alive"] = timed()
    leave.set()
    thread.join()
    results["on the main thread, the building thread ended"] = timed()
    print(f"{opts.rows} rows, {opts.context}-token prompts, median of {opts.steps} decode steps:")
    for case, ms in results.items():
        print(f"  {case}: {ms:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
