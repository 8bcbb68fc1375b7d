"""Every registered model family against transformers' own forward, on tiny random checkpoints
that transformers builds and saves inside the test (tests/engine/hf_families.py: every
parameter, norms and biases included, redrawn; windows shorter than the prompts; RoPE scaling
active at the tested positions).

Checked per family:
* fp32 logits of a 40-token sequence, computed as the engine computes it (two 16-token prefill
  pieces over the paged pool, then one-token decode steps), within 1e-4 of transformers';
* through the real engine (scheduler, paged KV, sampler), greedy tokens with their logprobs equal
  to transformers' teacher-forced scores (1e-4), in a batch with other prompts, past the window;
  the same tokens and logprobs again after a prefix-cache hit, after preemption and in n = 2
  forked samples (windowed families keep only their windows' blocks: engine/core/kv_groups.py);
* bf16 greedy tokens close to transformers' under vLLM's `check_logprobs_close` rule;
* seeded sampling repeats alone and in a batch.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.model.layer_ops import KernelLayerOps, TorchLayerOps
from engine.model.transformer import Transformer
from engine.model.weights import load_safetensors
from engine.runner.builder import engine_from_weights
from engine.runner.kv_cache import KVCache
from tests.engine.attention_oracle import step_metadata
from tests.engine.conftest import new_request
from tests.engine.hf_families import FAMILIES, build_checkpoint, reference_logits

PROMPT_LEN = 70          # > the windows (12) and > one 64-token cacheable prefill piece
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, pathlib.Path]:
    """(family, checkpoint directory) of one tiny random checkpoint per family."""
    return request.param, build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    """`n` random token ids in [3, vocab) (no special tokens)."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(directory: pathlib.Path, dtype: str = "float32", **config) -> Engine:
    """A stopped engine over the checkpoint, stepped by hand (`run_until_idle`)."""
    args, state = load_safetensors(directory, getattr(torch, dtype))
    settings = dict(device="cpu", dtype=dtype, num_blocks=64, queue_budget_s=1e6) | config
    return engine_from_weights(EngineConfig(**settings), args, state)


@dataclass
class Answer:
    """What one request's token events said: its tokens, their logprobs and top alternatives,
    and the prompt tokens it took from the prefix cache."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    num_cached: int


def run(e: Engine, prompts: list[list[int]], max_tokens: int = NEW_TOKENS, loras: list | None = None,
        **sampling) -> list[Answer]:
    """Submit every prompt at once (greedy, logprobs on, unless `sampling` says), each on its
    LoRA adapter in `loras` (`LoraRequest` or None; default: all on the base model), step until
    idle; each request's `Answer`. The pool ends with every block free."""
    sampling = dict(temperature=0.0, logprobs=True, ignore_eos=True) | sampling
    events: list[list] = [[] for _ in prompts]
    loras = loras or [None] * len(prompts)
    reqs = [new_request(p, max_tokens, ev, lora=lora, **sampling)
            for p, ev, lora in zip(prompts, events, loras)]
    for r in reqs:
        e.submit(r)
    e.run_until_idle()
    e.pool.check_all_free()
    answers = []
    for ev in events:
        toks = [x for x in ev if x.token_id is not None]
        answers.append(Answer([x.token_id for x in toks], [x.logprob for x in toks],
                              [dict(x.top_logprobs) for x in toks], ev[-1].num_cached_tokens))
    return answers


def max_logit_difference_over_pieces_and_decode_steps(directory, kernels: bool = False) -> float:
    """Max |logit difference| against transformers' forward over 40 positions of the fp32
    checkpoint in `directory`: two 16-token prefill pieces, then 8 decode steps, on shuffled
    blocks of a KV pool; with `kernels`, the CPU kernel path (`KernelLayerOps`, the kernels'
    metadata), else the torch ops."""
    args, state = load_safetensors(directory, torch.float32)
    model = Transformer.from_state_dict(args, state, torch.float32)
    ids = torch.tensor(tokens(40, seed=1))
    kv = KVCache(args, 8, 16, torch.float32, "cpu")
    table = [3, 1, 5]                                    # shuffled block ids
    ops = KernelLayerOps if kernels else TorchLayerOps
    rows = []
    with torch.inference_mode():
        for start, length in [(0, 16), (16, 16)] + [(p, 1) for p in range(32, 40)]:
            meta = step_metadata([(start, length, table, length == 1)], 16, kernels=kernels, num_blocks=8)
            hidden = model(ids[start:start + length], torch.arange(start, start + length), kv.layers,
                           meta, ops)
            rows.append(model.logits(hidden))
    return (torch.cat(rows) - reference_logits(directory, ids.tolist())).abs().max().item()


def test_logits_match_transformers_over_pieces_and_decode_steps(family):
    name, directory = family
    diff = max_logit_difference_over_pieces_and_decode_steps(directory)
    print(f"{name}: max |logit difference| over 40 positions = {diff:.2e}")
    assert diff < 1e-4, diff


def test_engine_greedy_tokens_and_logprobs_match_teacher_forced_transformers(family):
    name, directory = family
    prompt = tokens(PROMPT_LEN, seed=2)
    others = [tokens(n, seed=10 + n) for n in (5, 33, 90)]       # a mixed batch around it
    e = engine(directory)
    first = run(e, [prompt] + others)[0]
    generated, logprobs = first.tokens, first.logprobs
    assert len(generated) == NEW_TOKENS
    ref = torch.log_softmax(reference_logits(directory, prompt + generated), dim=-1)
    positions = range(PROMPT_LEN - 1, PROMPT_LEN - 1 + NEW_TOKENS)
    assert generated == [int(ref[p].argmax()) for p in positions]
    want = [ref[p, t].item() for p, t in zip(positions, generated)]
    assert max(abs(a - b) for a, b in zip(logprobs, want)) < 1e-4, (logprobs, want)
    # Again on the same engine: the prompt's first 64 tokens come from the prefix cache.
    again = run(e, [prompt])[0]
    assert again.num_cached >= 64
    assert again.tokens == generated
    assert max(abs(a - b) for a, b in zip(again.logprobs, logprobs)) < 1e-5
    # Pools just big enough to hold the request alone (what any request of its length takes in
    # every KV group at the prefill's peak: a sliding group only its window's blocks plus a
    # step's 16 prompt tokens), growing a block at a time until one is outgrown by the three
    # requests and preempts: the recomputed answer is the same in every pool.
    step = dict(prefill_token_budget=16, prefill_token_budget_few_rows=16, prefill_piece=16)
    need = e.pool.blocks_to_compute(None, PROMPT_LEN + NEW_TOKENS, 16)
    for num_blocks in range(need + 1, need + 16):
        small = engine(directory, num_blocks=num_blocks, free_margin=0.0, **step)
        assert small.config.max_context >= PROMPT_LEN + NEW_TOKENS
        assert run(small, [prompt] + others[:2])[0].tokens == generated, num_blocks
        if small.scheduler.num_preemptions:
            break
    else:
        pytest.fail(f"no pool of {need + 1}..{need + 15} blocks preempted")
    # n = 2 greedy samples fork from the one prefilled prompt (its blocks shared, the partly
    # filled last one copied on write in every KV group): both give the same answer.
    forked = new_request(prompt, NEW_TOKENS, [], temperature=0.0, ignore_eos=True)
    forked.fork(2, [None, None])
    e.submit(forked)
    e.run_until_idle()
    e.pool.check_all_free()
    assert [forked.generated, forked.children[0].generated] == [generated, generated]


def check_logprobs_close(ours: list[int], ours_top: list[dict[int, float]], ref: list[int],
                         ref_top: list[dict[int, float]]) -> None:
    """vLLM's rule (tests/models/utils.py `check_logprobs_close`): the greedy sequences agree
    until they first differ; there each side's token must be among the other's top logprobs,
    and the comparison stops (what follows is conditioned on different text)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert a in ref_top[i] and b in ours_top[i], (i, a, b, ours_top[i], ref_top[i])
            return


def test_bf16_greedy_is_close_to_transformers(family):
    name, directory = family
    prompt = tokens(PROMPT_LEN, seed=3)
    answer = run(engine(directory, "bfloat16"), [prompt], top_logprobs=5)[0]
    ours, ours_top = answer.tokens, answer.top
    ref_ids = list(prompt)                       # transformers' own greedy continuation (fp32)
    ref_top = []
    for _ in range(NEW_TOKENS):
        logits = torch.log_softmax(reference_logits(directory, ref_ids)[-1], dim=-1)
        top = logits.topk(5)
        ref_top.append(dict(zip(top.indices.tolist(), top.values.tolist())))
        ref_ids.append(int(top.indices[0]))
    check_logprobs_close(ours, ours_top, ref_ids[PROMPT_LEN:], ref_top)
    assert all(math.isfinite(v) for t in ours_top for v in t.values())


def test_seeded_sampling_repeats_alone_and_in_a_batch(family):
    _, directory = family
    e = engine(directory)
    prompt = tokens(20, seed=4)
    alone = run(e, [prompt], temperature=1.0, seed=7)[0]
    batch = run(e, [tokens(9, seed=5), prompt, tokens(40, seed=6)], temperature=1.0, seed=7)[1]
    other = run(e, [prompt], temperature=1.0, seed=8)[0]
    assert alone.tokens == batch.tokens
    assert alone.tokens != other.tokens


def test_an_architecture_or_option_outside_the_registry_is_refused_by_name(tmp_path):
    """A checkpoint genserve cannot serve fails at load with the name of what it lacks and the
    list of what it serves, never a silent load with wrong numbers."""
    import json
    import shutil

    source = build_checkpoint("gemma3", tmp_path / "gemma3")
    cases = [({"architectures": ["GPTNeoXForCausalLM"]},
              r"architecture GPTNeoXForCausalLM is not supported; supported: Gemma2ForCausalLM, "
              r"Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, "
              r"Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"),
             ({"hidden_activation": "relu"}, r"hidden_activation 'relu' .*supported: gelu_pytorch_tanh"),
             ({"layer_types": ["chunked_attention"] * 6}, r"layer type 'chunked_attention'"),
             ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
              r"RoPE scaling 'dynamic'")]
    for i, (change, message) in enumerate(cases):
        directory = shutil.copytree(source, tmp_path / f"case{i}")
        config = json.loads((directory / "config.json").read_text()) | change
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_safetensors(directory)


def test_config_spellings_and_defaults_follow_transformers():
    """What configs say in ways the tiny checkpoints do not: transformers 4.x spellings, keys
    left out (transformers' defaults), options a family reads from other keys."""
    from engine.model.registry import family_for_config

    def args(config: dict):
        return family_for_config(config, "config.json").module.config_from_hf(config, "config.json")

    base = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=320, max_position_embeddings=128)
    # Gemma 3 in transformers 4.x: rope_scaling is the global layers' only; local base separate
    gemma3 = args(dict(base, architectures=["Gemma3ForCausalLM"], head_dim=16, sliding_window=12,
                       rope_theta=1e6, rope_local_base_freq=1e4,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}))
    local, glob = gemma3.layer(0), gemma3.layer(5)
    assert (local.sliding_window, local.rope_theta, local.rope_scaling.kind) == (12, 1e4, "default")
    assert (glob.sliding_window, glob.rope_theta, glob.rope_scaling.kind, glob.rope_scaling.factor) == \
        (None, 1e6, "linear", 8.0)
    assert gemma3.scale == 256 ** -0.5 and gemma3.attn_softcap is None       # defaults: 256, none
    # Gemma 2 without its softcap keys: transformers' 50 and 30; alternating sliding from layer 0
    gemma2 = args(dict(base, architectures=["Gemma2ForCausalLM"], head_dim=16))
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
    assert gemma2.sliding_windows == (4096, None) * 3
    # Qwen: use_sliding_window makes layers from max_window_layers on sliding (Qwen2 and Qwen3)
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        qwen = args(dict(base, architectures=[arch], use_sliding_window=True, sliding_window=8,
                         max_window_layers=4))
        assert qwen.sliding_windows == (None,) * 4 + (8, 8), arch
    # Mistral's window defaults to 4096 when the key is absent; Llama never has one
    assert set(args(dict(base, architectures=["MistralForCausalLM"])).sliding_windows) == {4096}
    assert set(args(dict(base, architectures=["LlamaForCausalLM"], sliding_window=8)).sliding_windows) == {None}
    # Phi-3's "yarn" is LongRoPE; the top-level original context wins over the RoPE dict's
    factors = [1.0] * 8
    phi3 = args(dict(base, architectures=["Phi3ForCausalLM"], original_max_position_embeddings=16,
                     rope_scaling={"type": "yarn", "short_factor": factors, "long_factor": factors,
                                   "original_max_position_embeddings": 32}))
    assert (phi3.rope_scaling.kind, phi3.rope_scaling.original_max_context) == ("longrope", 16)
    with pytest.raises(ValueError, match="hidden_act 'gelu' .*supported: silu"):
        args(dict(base, architectures=["LlamaForCausalLM"], hidden_act="gelu"))


def test_longrope_serves_its_short_factors_within_the_original_context(family):
    """Phi-3 served with --max-context 16 (its original context): the short factors, as
    transformers uses for a sequence of at most 16 tokens."""
    from engine.runner.builder import build_engine

    name, directory = family
    if not name.startswith("phi3"):
        pytest.skip("LongRoPE is Phi-3's")
    loaded = build_engine(EngineConfig(device="cpu", dtype="float32", num_blocks=16, max_context=16,
                                       queue_budget_s=1e6), str(directory), calibrate=False)
    assert loaded.engine.executor.model.args.max_context == 16
    prompt = tokens(8, seed=11)
    answer = run(loaded.engine, [prompt], max_tokens=8)[0]
    assert len(answer.tokens) == 8                              # 8 + 8 = the whole context
    ref = torch.log_softmax(reference_logits(directory, prompt + answer.tokens), dim=-1)
    positions = range(7, 15)
    assert answer.tokens == [int(ref[p].argmax()) for p in positions]
    assert max(abs(a - ref[p, t].item()) for a, p, t in zip(answer.logprobs, positions, answer.tokens)) < 1e-4
