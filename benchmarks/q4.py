"""Decode steps with the block matrices read as bf16 or as the GGUF's 4-bit blocks, in one run.

Run from the repository root::

    python -m benchmarks.q4 [--rows 1,32] [--steps 40] [--prompt-len 64] [--json PATH]

Engines over the embedded SmolLM2-135M, built from one load of the GGUF:

* ``bf16``: `EngineConfig.weights` "bf16", the default engine of this CPU;
* ``q4``: `EngineConfig.weights` "q4" (`engine.model.quant.attach_q4`);
* ``bf16-twin``, only where the 4-bit products do not reproduce the default engine's bits on this
  CPU (`engine.model.quant` says when): bf16 weights run by exactly the products they do reproduce
  (`engine.model.quant.bf16_twin`, genserve's own layout).

For each row count, each engine gets that many requests (``--prompt-len``-token prompts, greedy,
``ignore_eos``) and prefills them; then the engines take one step each in turn, ``--steps``
times, so load from other processes falls on all of them alike. Counted: pure-decode steps at that
row count, the executor's time (`Engine.step_listeners`: forward, logits, sampling); printed: the
median and the ratio to ``bf16``. Weight bytes per step: the block matrices (2 bytes per weight in
bf16, 20 per 32 in Q4_1) plus the output projection (bf16, or 34 bytes per 32 in Q8_0 where q4
reads its blocks), each read once per step.
``q4`` must produce the tokens of the bf16 engine whose bits it reproduces (``bf16-twin`` where
built, else ``bf16``); the run fails otherwise.

Other processes on the machine distort the figures; the header prints the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks._measure import step_in_turn, submit_random_prompts
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request
from engine.model.linear import ANY_ROWS
from engine.model.transformer import Transformer, block_matrices
from engine.model.quant import attach_q4, bf16_twin
from engine.gguf_file import open_gguf
from engine.model.weights import Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, load_gguf
from engine.runner.builder import engine_from_model, model_from_weights, set_threads



def weight_bytes(model: Transformer, q4: bool) -> int:
    """Bytes of the matrices one decode step reads once: block matrices (bf16, or Q4_1 blocks)
    and the output projection (bf16, or its Q8_0 blocks where the model reads them)."""
    blocks = sum(getattr(m, n).numel() for m, n in block_matrices(model))
    per_weight = Q4_1_BLOCK_BYTES / 32 if q4 else 2
    q8 = model.output_packed is not None and model.output_packed.q8 is not None
    return int(blocks * per_weight + model.output.numel() * (Q8_0_BLOCK_BYTES / 32 if q8 else 2))


def build_models(threads: int) -> dict[str, Transformer]:
    """The engines' models (module docstring), from one load of the embedded GGUF."""
    set_threads(EngineConfig(num_threads=threads))
    reader = open_gguf()
    args, state = load_gguf(reader)
    models = {name: model_from_weights(args, state, torch.bfloat16) for name in ("bf16", "q4")}
    attach_q4(models["q4"], reader)
    first = models["q4"].layers[0].attention.wqkv_packed
    if first.k_chunk and first.max_rows == ANY_ROWS:      # not the default engine's bits here
        twin = models["bf16-twin"] = model_from_weights(args, state, torch.bfloat16)
        for (module, name), (q_module, _) in zip(block_matrices(twin),
                                                 block_matrices(models["q4"])):
            setattr(module, name + "_packed",
                    bf16_twin(getattr(q_module, name + "_packed"), getattr(module, name)))
    return models


def submit(engine: Engine, rows: int, prompt_len: int, max_tokens: int, tag: str
           ) -> list[Request]:
    """`rows` greedy requests of `prompt_len` seeded token ids, `max_tokens` each, submitted."""
    return submit_random_prompts(engine, rows, prompt_len, max_tokens, f"q4-{tag}-{rows}",
                                 torch.Generator().manual_seed(rows))


@dataclass(frozen=True, slots=True)
class InTurn:
    """What `decode_in_turn` measured.

    Attributes:
        times: per engine, the executor's seconds of each counted step (pure decode at `rows`).
        contexts: the context length (tokens) of every row of every counted step, all engines.
        requests: per engine, its requests (run to their end).
    """

    times: dict[str, list[float]]
    contexts: list[int]
    requests: dict[str, list[Request]]


def decode_in_turn(engines: dict[str, Engine], rows: int, steps: int, prompt_len: int) -> InTurn:
    """Give each engine the same `rows` greedy requests of `prompt_len` seeded token ids
    (`submit`), prefill them, then let the engines take one step each in turn, `steps` times (so
    load from other processes falls on all alike), and run them to the end. Counted: the
    pure-decode steps at `rows` rows (`Engine.step_listeners`: the executor's time)."""
    contexts: list[int] = []
    submitted: dict[str, list[Request]] = {}

    def give(name: str, engine: Engine) -> None:
        submitted[name] = submit(engine, rows, prompt_len, steps + 8, name)

    times = step_in_turn(engines, rows, steps, give,
                         on_step=lambda plan: contexts.extend(seg.end for seg in plan.segments))
    return InTurn(times, contexts, submitted)


def measure(engines: dict[str, Engine], rows: int, steps: int, prompt_len: int
            ) -> dict[str, list[float]]:
    """Per engine, the executor's seconds of each pure-decode step at `rows` rows, the engines
    stepping in turn (`decode_in_turn`); asserts that q4 generated the tokens of the bf16 engine
    it reproduces."""
    run = decode_in_turn(engines, rows, steps, prompt_len)
    outputs = {name: [r.generated for r in reqs] for name, reqs in run.requests.items()}
    same = "bf16-twin" if "bf16-twin" in outputs else "bf16"
    if outputs["q4"] != outputs[same]:
        raise AssertionError(f"{rows} rows: q4 and {same} generated different tokens")
    return run.times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,32", help="decode row counts, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="steps per engine and row count")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the figures here")
    opts = parser.parse_args(argv)
    rows_list = [int(r) for r in opts.rows.split(",")]
    print(f"# load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (others' load "
          "distorts the figures)", flush=True)
    t0 = time.perf_counter()
    models = build_models(opts.threads)
    print(f"# models built in {time.perf_counter() - t0:.0f} s", flush=True)
    blocks = max(64, max(rows_list) * -(-(opts.prompt_len + opts.steps + 16) // 16) * 2)
    engines = {name: engine_from_model(EngineConfig(num_blocks=blocks, max_rows=max(rows_list),
                                                    device="cpu", weights="q4" if name == "q4"
                                                    else "bf16"), model)
               for name, model in models.items()}
    megabytes = {name: weight_bytes(model, name == "q4") / 1e6 for name, model in models.items()}
    result: dict[str, object] = {"load_average": os.getloadavg()[0], "steps": opts.steps,
                                 "prompt_len": opts.prompt_len, "weight_mb_per_step": megabytes,
                                 "decode_ms": {}}
    print(f"{'rows':>4} " + " ".join(f"{name:>10}" for name in engines) + "   (median ms per "
          "decode step; ratio to bf16)")
    for rows in rows_list:
        times = measure(engines, rows, opts.steps, opts.prompt_len)
        med = {name: statistics.median(ts) * 1e3 for name, ts in times.items() if ts}
        result["decode_ms"][str(rows)] = med                              # type: ignore[index]
        print(f"{rows:>4} " + " ".join(f"{med.get(n, float('nan')):>10.2f}" for n in engines)
              + "   " + " ".join(f"{n} {med['bf16'] / med[n]:.2f}x" for n in engines
                                 if n != "bf16" and n in med and "bf16" in med), flush=True)
    print("weight MB read per step: " + ", ".join(f"{n} {mb:.0f}" for n, mb in megabytes.items()))
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
