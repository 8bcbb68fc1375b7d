"""Model-family benchmark: one engine step per family at a 1B-class shape, and the embedded
model's step times before and after a change, measured in one run.

Run from the repository root::

    python -m benchmarks.families --families [--json PATH]
    python -m benchmarks.families --smollm2-ab OLD_TREE [--rounds 3] [--json PATH]

* `--families`: for each family a Hugging Face style config of a 1B-class published shape
  (`SHAPES`; Phi-4-mini cut to 8 layers, Mistral's smallest is 7B so a 1B shape of its layout),
  turned into `ModelArgs` by the family's own module (`engine.model.registry`), random bf16
  weights, the real engine on the CPU: tokens/s of pure-decode steps at 1 and 32 rows (64-token
  prompts; median executor time of the steps that hold exactly that many decode rows), and the KV
  bytes a token costs: every layer holding every token, and what a request at 8,192 tokens holds
  in genserve's pool, where sliding layers keep only their windows (at its last step, and the
  most while its prompt was prefilled; the real scheduler over the SimExecutor).
* `--smollm2-ab OLD_TREE`: the embedded SmolLM2-135M (default weights) on the code of OLD_TREE (a
  checkout, e.g. `git worktree add /tmp/old HEAD~1`) and on this tree, alternately, `--rounds`
  times each: one 512-token prefill (executor time summed over its steps), and pure-decode step
  times at 1 and 32 rows. Each measurement is a fresh process (`--smollm2`), so both trees see
  the same machine state; only engine APIs both trees have are used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT_TOKENS = 64
DECODE_STEPS = 12          # counted pure-decode steps per row count
CONTEXT = 8192             # context of the KV-per-token comparison

# 1B-class shapes, as config.json would hold them (sizes from the published configs).
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=True, rms_norm_eps=1e-5,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192),
                         rope_theta=500000.0),
    "mistral-1b-layout": dict(architectures=["MistralForCausalLM"], hidden_size=2048, num_hidden_layers=16,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              intermediate_size=8192, vocab_size=131072, max_position_embeddings=32768,
                              sliding_window=4096, rope_theta=1e6),
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                         vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3-1.7b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=2048, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                       vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
                       rope_theta=1e6, rms_norm_eps=1e-6),
    "gemma-2-2b": dict(architectures=["Gemma2ForCausalLM"], hidden_size=2304, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, intermediate_size=9216,
                       vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
                       query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, rms_norm_eps=1e-6),
    "gemma-3-1b": dict(architectures=["Gemma3ForCausalLM"], hidden_size=1152, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=6912,
                       vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
                       sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1e6,
                       rope_local_base_freq=10000.0, rms_norm_eps=1e-6),
    "phi-4-mini-8-layers": dict(architectures=["Phi3ForCausalLM"], hidden_size=3072, num_hidden_layers=8,
                                num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
                                vocab_size=200064, max_position_embeddings=131072,
                                original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                                tie_word_embeddings=True, rope_theta=10000.0,
                                rope_scaling=dict(rope_type="longrope",
                                                  short_factor=[1.0] * 48, long_factor=[2.0] * 48)),
}


def decode_tokens_per_s(engine, rows: int) -> float:
    """Tokens/s of pure-decode steps at `rows` rows: `rows` requests of PROMPT_TOKENS tokens, the
    median executor time of the DECODE_STEPS steps that hold exactly `rows` decode rows."""
    from engine.core.request import Request, SamplingParams

    times: list[float] = []

    def listen(plan, events, seconds) -> None:
        if plan.num_decode_rows == rows and plan.num_prefill_tokens == 0:
            times.append(seconds)

    engine.step_listeners.append(listen)
    for i in range(rows):
        prompt = [(13 * i + 7 * j) % 1000 + 10 for j in range(PROMPT_TOKENS)]
        engine.submit(Request(f"bench-{rows}-{i}", "bench", prompt, DECODE_STEPS + 3,
                              SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
    engine.run_until_idle()
    engine.step_listeners.pop()
    return rows / statistics.median(times[1:] or times)


def prefill_ms(engine, tokens: int = 512) -> float:
    """Executor time of prefilling one `tokens`-token prompt, summed over its steps, ms."""
    from engine.core.request import Request, SamplingParams

    times: list[float] = []
    engine.step_listeners.append(lambda plan, ev, s: times.append(s) if plan.num_prefill_tokens else None)
    prompt = [(11 * j) % 1000 + 10 for j in range(tokens)]
    engine.submit(Request("bench-prefill", "bench", prompt, 1,
                          SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
    engine.run_until_idle()
    engine.step_listeners.pop()
    return 1000 * sum(times)


def smollm2() -> dict:
    """The embedded model's step times on this process's code (see the module docstring)."""
    from engine.config import EngineConfig
    from engine.runner.builder import build_engine

    # no prefix caching: the measured prompt would otherwise find the warm-up's blocks
    engine = build_engine(EngineConfig(device="cpu", num_blocks=1024, prefix_caching=False), None,
                          calibrate=False).engine
    prefill_ms(engine)                       # warm-up: kernels, allocations
    out = {"prefill_512_ms": prefill_ms(engine)}
    for rows in (1, 32):
        out[f"decode_{rows}_ms"] = 1000 * rows / decode_tokens_per_s(engine, rows)
    return out


def kv_blocks_held(windows: tuple[int | None, ...], layers_per_block: int, context: int = CONTEXT,
                   answer: int = 64) -> tuple[int, int]:
    """Layer-blocks (blocks × the layers a block holds) one request of `context` tokens holds in a
    pool of KV groups `windows` (`engine.core.kv_groups`), run through the real scheduler over the
    SimExecutor (a prompt of context − `answer` tokens, then `answer` decode steps, with the default
    step budgets): (at its last decode step, the most at any step)."""
    from engine.config import EngineConfig
    from engine.core.engine import Engine
    from engine.core.request import Request, SamplingParams
    from engine.core.sim_executor import SimExecutor

    config = EngineConfig(num_blocks=4 * context, max_context=context, prefix_caching=False)
    engine = Engine(config, SimExecutor(), config.num_blocks, kv_windows=windows)
    req = Request("kv", "", [1 + i % 1000 for i in range(context - answer)], answer,
                  SamplingParams(), 0.0, 0.0)
    held: list[int] = []
    engine.step_listeners.append(
        lambda plan, events, s: held.append(len(engine.pool.held_blocks("kv")) * layers_per_block))
    engine.submit(req)
    engine.run_until_idle()
    engine.pool.check_all_free()
    return held[-2], max(held)             # the last step ends the request: nothing held after


def kv_bytes_per_token(args, context: int = CONTEXT) -> tuple[int, float, float]:
    """(bytes one token's K and V take with every layer holding every token (bf16); the bytes per
    token a request at `context` tokens holds in genserve's pool, and the most it held while its
    prompt was prefilled: sliding layers keep only their windows, `kv_blocks_held`)."""
    from engine.runner.kv_cache import kv_groups

    per_layer = 2 * args.n_kv_heads * args.head_dim * 2
    groups = kv_groups(args.replace(max_context=context))
    at_end, peak = kv_blocks_held(groups.windows, groups.group_size, context)
    per_layer_block = per_layer * 16 / context
    return per_layer * args.n_layers, at_end * per_layer_block, peak * per_layer_block


def families() -> list[dict]:
    """One row per shape of `SHAPES` (see the module docstring)."""
    import torch

    from engine.config import EngineConfig
    from engine.model.registry import family_for_config
    from engine.model.weights import random_weights
    from engine.runner.builder import engine_from_weights

    rows = []
    for name, config in SHAPES.items():
        args = family_for_config(config, name).module.config_from_hf(config, name)
        args = args.replace(max_context=min(args.max_context, CONTEXT))
        state = random_weights(args, torch.bfloat16, seed=0)
        engine = engine_from_weights(EngineConfig(device="cpu", dtype="bfloat16", num_blocks=512,
                                                  queue_budget_s=1e9), args, state)
        del state
        storages = {p.untyped_storage().data_ptr(): p.numel() for p in engine.executor.model.parameters()}
        params = sum(storages.values())                # a tied output matrix counted once
        full, windowed, peak = kv_bytes_per_token(args)
        decode_tokens_per_s(engine, 1)                           # warm-up
        row = dict(shape=name, architecture=args.architecture, params_b=params / 1e9,
                   kernel_path=engine.executor.kernels,
                   tokens_per_s_1=decode_tokens_per_s(engine, 1),
                   tokens_per_s_32=decode_tokens_per_s(engine, 32),
                   kv_bytes_per_token=full, kv_bytes_per_token_held_8k=windowed,
                   kv_bytes_per_token_held_8k_prefill_peak=peak)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del engine
    return rows


def smollm2_ab(old_tree: str, rounds: int) -> dict:
    """`smollm2()` in fresh processes on `old_tree`'s code and this tree's, alternately."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    # this file run as a script from outside both trees (its own folder first on sys.path would
    # make `engine` this folder's engine.py)
    script = os.path.join(tempfile.mkdtemp(), "smollm2_steps.py")
    shutil.copy(os.path.abspath(__file__), script)
    for _ in range(rounds):
        for label, tree in (("old", old_tree), ("new", here)):
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, script, "--smollm2"], cwd=tree,
                                 env=env, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(label, runs[label][-1], flush=True)
    summary = {}
    for key in runs["old"][0]:
        old = statistics.median(r[key] for r in runs["old"])
        new = statistics.median(r[key] for r in runs["new"])
        summary[key] = dict(old=old, new=new, new_over_old=new / old)
    return dict(runs=runs, median=summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", action="store_true")
    parser.add_argument("--smollm2", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smollm2-ab", metavar="OLD_TREE")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    a = parser.parse_args()
    if a.smollm2:
        print(json.dumps(smollm2()))
        return
    result = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if a.families:
        result["families"] = families()
    if a.smollm2_ab:
        result["smollm2_ab"] = smollm2_ab(a.smollm2_ab, a.rounds)
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
