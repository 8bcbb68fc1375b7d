"""Multi-LoRA decode step cost on the embedded model (SmolLM2-135M-Instruct, bf16 on the CPU).

Run from the repository root (docs/benchmarks/lora.md has the runs and figures)::

    python -m benchmarks.lora [--adapters 8] [--rank 16] [--rows 32,1] [--steps 40] [--lora-dtype auto]
                              [--model-dtype-pairs] [--python-loop] [--json PATH]

Two engines over the one embedded network (`engine_from_model` twice: the same weights, a KV pool
each): "base" runs every row on the base model, "lora" runs them on `--adapters` random rank
`--rank` adapters on every projection (q, k, v, o, gate, up, down of all 30 layers; written as PEFT
directories, `write_adapter`, and loaded through the engine's `LoraRegistry`), row r on adapter
r mod N. With `--python-loop`, two more: "base_python" and "lora_python", the same without the
C++ decode loop (the model's Python block loop, which prefill and mixed steps take). For each row
count the engines take one decode step each in turn (`benchmarks._measure.step_in_turn`, so load
from other processes weighs on all), counting pure-decode steps at that many rows (the executor's
time: forward, logits, sampling). Printed: the median step of each and lora / base, and the
fastest step of each and their ratio (the steps least disturbed on a loaded host). Targets
(docs/benchmarks/lora.md): 32 rows over 8 adapters ≤ 1.15× the base step; one row on an adapter
≤ 1.10× one base row.

`--lora-dtype` is `EngineConfig.lora_dtype` ("auto": int8 pairs where the base's products are
8-bit, as `q4q8` is on a CPU with AVX512-VNNI and no AMX); `--model-dtype-pairs` adds an engine
with the same adapters in bf16, so both kinds of pairs are measured in the same turns.

Pure-decode steps run genserve's C++ decode loop, with adapter rows too where the adapters' deltas
run `lora_delta_` (bf16 on a CPU with AVX512-BF16): each product of the loop adds the rows' deltas
(`engine.model.lora`). Other processes on the machine distort
the figures: the load average is printed and recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import tempfile

import torch

from benchmarks._measure import step_in_turn
from engine.config import EngineConfig
from engine.core.request import Request, SamplingParams
from engine.model.config import ModelArgs
from engine.runner.builder import build_engine, engine_from_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: pathlib.Path, args: ModelArgs, rank: int, seed: int) -> pathlib.Path:
    """A random PEFT LoRA directory of rank `rank` on every projection of the Llama-family model
    `args` (lora_A and lora_B N(0, 0.02) fp32, alpha = 2·rank)."""
    from safetensors.torch import save_file

    hd = args.head_dim
    shapes = {"self_attn.q_proj": (args.dim, args.n_heads * hd), "self_attn.k_proj": (args.dim, args.n_kv_heads * hd),
              "self_attn.v_proj": (args.dim, args.n_kv_heads * hd), "self_attn.o_proj": (args.n_heads * hd, args.dim),
              "mlp.gate_proj": (args.dim, args.intermediate_size), "mlp.up_proj": (args.dim, args.intermediate_size),
              "mlp.down_proj": (args.intermediate_size, args.dim)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(args.n_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", default="32,1", help="decode row counts, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="counted steps per engine and row count")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--lora-dtype", default="auto", choices=("auto", "model", "int8"),
                        help="EngineConfig.lora_dtype: how the adapters' pairs are stored and multiplied")
    parser.add_argument("--model-dtype-pairs", action="store_true",
                        help="one more engine: the adapters with their pairs in the model dtype "
                             "(--lora-dtype model), stepped in turn with the others")
    parser.add_argument("--python-loop", action="store_true",
                        help="two more engines: the base model and the adapters through the Python block loop "
                             "(no C++ decode loop)")
    args = parser.parse_args(argv)
    config = EngineConfig(dtype="bfloat16", num_blocks=1024, queue_budget_s=1e6, max_loras=args.adapters,
                          lora_dtype=args.lora_dtype)
    loaded = build_engine(config, calibrate=False)
    base = loaded.engine
    engines = {"base": base, "lora": engine_from_model(config, base.executor.model)}
    if args.model_dtype_pairs:        # the same adapters, bf16 pairs, in the same turns
        engines["lora_model"] = engine_from_model(dataclasses.replace(config, lora_dtype="model"),
                                                  base.executor.model)
    if args.python_loop:              # both through the Python block loop (prefill and mixed steps take it)
        for name in ("base_python", "lora_python"):
            engines[name] = engine_from_model(config, base.executor.model)
            engines[name].executor.decode_loop = None
    names = [f"adapter{a}" for a in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for a, name in enumerate(names):
            path = write_adapter(pathlib.Path(tmp) / name, loaded.args, args.rank, seed=a)
            for engine_name, engine in engines.items():
                if engine_name.startswith("lora"):
                    engine.executor.adapters.load(name, path)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.args.vocab_size
    int8 = engines["lora"].executor.loras.int8
    print(f"adapters' pairs: {'int8' if int8 else 'model dtype'} (--lora-dtype {args.lora_dtype})", flush=True)
    results = {"adapters": args.adapters, "rank": args.rank, "load_average_before": os.getloadavg(),
               "kernels": base.executor.kernels, "lora_dtype": args.lora_dtype, "int8_pairs": int8, "rows": {}}

    def submit_for(rows: int, max_tokens: int):
        def submit(name: str, engine) -> None:
            for i in range(rows):
                ids = torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
                lora_request = (engine.executor.adapters.request(names[i % len(names)])
                                if name.startswith("lora") else None)
                engine.submit(Request(f"{name}-{rows}-{i}-{len(results['rows'])}", "bench", ids, max_tokens,
                                      SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0,
                                      lora=lora_request))
        return submit

    step_in_turn(engines, 4, 4, submit_for(4, 12))                     # warm-up: every path
    for rows in (int(r) for r in args.rows.split(",")):
        times = step_in_turn(engines, rows, args.steps, submit_for(rows, args.steps + 8))
        med = {name: statistics.median(t) * 1000 for name, t in times.items()}
        least = {name: min(t) * 1000 for name, t in times.items()}
        ratio = med["lora"] / med["base"]
        results["rows"][rows] = {**{f"{name}_ms": v for name, v in med.items()}, "ratio": ratio,
                                 **{f"{name}_min_ms": v for name, v in least.items()},
                                 "ratio_of_min": least["lora"] / least["base"],
                                 "steps": {name: len(t) for name, t in times.items()}}
        python = (f"; through the Python block loop: base {med['base_python']:.2f} ms, lora {med['lora_python']:.2f} ms"
                  if "base_python" in med else "")
        if "lora_model" in med:
            results["rows"][rows]["ratio_model_dtype_pairs"] = med["lora_model"] / med["base"]
            python += (f"; bf16 pairs: lora {med['lora_model']:.2f} ms, ratio {med['lora_model'] / med['base']:.3f}")
        print(f"{rows:3d} rows over {min(rows, args.adapters)} adapters (rank {args.rank}, all projections): "
              f"base {med['base']:.2f} ms, lora {med['lora']:.2f} ms, ratio {ratio:.3f}{python} "
              f"(fastest steps: base {least['base']:.2f} ms, lora {least['lora']:.2f} ms, "
              f"ratio {least['lora'] / least['base']:.3f})", flush=True)
    results["load_average_after"] = os.getloadavg()
    print(f"load average before {results['load_average_before']}, after {results['load_average_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
