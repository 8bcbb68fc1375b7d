"""Tiny, fully random Hugging Face checkpoints for parity tests of genserve's model families.

`build_checkpoint` writes a checkpoint (config.json + model.safetensors) with transformers' own
config/model classes, offline, for each family in `FAMILIES`; every parameter, norms and biases
included, is redrawn from a seeded generator so a loader that drops or misreads any tensor shows.
Each config exercises the family's awkward corner at short lengths: Llama 3 RoPE scaling in
all three frequency bands, Phi-3 LongRoPE with a 16-token original context, sliding windows of
12, Gemma soft-capping and `query_pre_attn_scalar`, head dims independent of the width, partial
rotary.
`reference_logits` is the transformers (eager attention, fp32) teacher-forced forward to compare to.

Run `python -m tests.engine.hf_families` (from the repository root) for a self-check that also
prints the attention-relevant keys of each written config.json.
"""

from __future__ import annotations

import json
import pathlib

import torch
import transformers as tf

FAMILIES: tuple[str, ...] = ("llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                             "phi3_partial", "qwen3_moe", "mixtral")

# Shared shape: hidden 64, 4 query heads over 2 KV heads (GQA), vocab 320 (the test tokenizer's
# 269 tokens fit, tests/engine/checkpoint.py's `sentencepiece_tokenizer`).
_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
_GEMMA_NORMS = ("gemma2", "gemma3")  # RMSNorm computes x * (1 + w): w is drawn around 0
_NORM_STD, _BIAS_STD, _MATRIX_STD = 0.2, 0.1, 0.08


def _factors(n: int, seed: int) -> list[float]:
    """`n` distinct LongRoPE rescale factors in [1, 4], as plain floats (config.json lists)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return [round(1.0 + 3.0 * float(v), 4) for v in torch.rand(n, generator=g)]


def _config_and_class(family: str, seed: int) -> tuple[tf.PreTrainedConfig, type]:
    """The transformers config and CausalLM class of `family` (see `FAMILIES`)."""
    c = dict(_COMMON)
    if family == "llama3":  # Llama 3.2 style, tied. llama3 RoPE scaling is position-independent;
        # original 64 puts head_dim-16 frequency pairs in all three bands: kept, smoothed, /8.
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64)
        return tf.LlamaConfig(**c, rope_parameters=rope, attention_bias=False, mlp_bias=False,
                              tie_word_embeddings=True), tf.LlamaForCausalLM
    if family == "mistral":  # Nemo style: head_dim 32 != 64 // 4
        return tf.MistralConfig(**c, head_dim=32, sliding_window=12, tie_word_embeddings=False,
                                rope_parameters=dict(rope_type="default", rope_theta=1e6)), \
            tf.MistralForCausalLM
    if family == "qwen2":  # q/k/v biases are implicit in Qwen2
        return tf.Qwen2Config(**c, tie_word_embeddings=False, use_sliding_window=False,
                              rope_parameters=dict(rope_type="default", rope_theta=1e6)), \
            tf.Qwen2ForCausalLM
    if family == "qwen3":  # q/k RMSNorm per head, head_dim 32 independent of width, tied (0.6B)
        return tf.Qwen3Config(**c, head_dim=32, attention_bias=False, tie_word_embeddings=True,
                              use_sliding_window=False,
                              rope_parameters=dict(rope_type="default", rope_theta=1e6)), \
            tf.Qwen3ForCausalLM
    if family == "gemma2":
        c.update(head_dim=16)
        return tf.Gemma2Config(**c, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0, sliding_window=12,
                               layer_types=["sliding_attention", "full_attention"],
                               hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                               rope_parameters=dict(rope_type="default", rope_theta=10000.0)), \
            tf.Gemma2ForCausalLM
    if family == "gemma3":  # 5 local : 1 global, two RoPE bases, linear x8 on global layers
        c.update(head_dim=16, num_hidden_layers=6)
        rope = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6)}
        return tf.Gemma3TextConfig(**c, query_pre_attn_scalar=24, sliding_window=12,
                                   layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                   hidden_activation="gelu_pytorch_tanh", rope_parameters=rope,
                                   tie_word_embeddings=True), tf.Gemma3ForCausalLM
    if family in ("phi3", "phi3_partial"):  # LongRoPE: long factors once seq_len > 16
        partial = 0.75 if family == "phi3_partial" else 1.0
        half = int(c["hidden_size"] // c["num_attention_heads"] * partial) // 2
        rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=partial,
                    short_factor=_factors(half, seed), long_factor=_factors(half, seed + 1),
                    original_max_position_embeddings=16)
        return tf.Phi3Config(**c, original_max_position_embeddings=16, sliding_window=None,
                             rope_parameters=rope, partial_rotary_factor=partial,
                             tie_word_embeddings=family == "phi3_partial"), tf.Phi3ForCausalLM
    if family == "qwen3_moe":  # 3 layers, the middle one dense; top-2 of 8 not renormalized
        c.update(num_hidden_layers=3)
        return tf.Qwen3MoeConfig(**c, head_dim=32, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                                 mlp_only_layers=[1], tie_word_embeddings=False, use_sliding_window=False,
                                 rope_parameters=dict(rope_type="default", rope_theta=1e6)), \
            tf.Qwen3MoeForCausalLM
    if family == "mixtral":  # top-2 of 4 (renormalized), a window of 12 on every layer
        c.update(intermediate_size=32)
        return tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
                                tie_word_embeddings=False,
                                rope_parameters=dict(rope_type="default", rope_theta=1e6)), \
            tf.MixtralForCausalLM
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


@torch.no_grad()
def _randomize(model: torch.nn.Module, family: str, seed: int) -> None:
    """Redraw every parameter in place from a generator seeded by `seed` (tied ones once)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(0.0 if family in _GEMMA_NORMS else 1.0, _NORM_STD, generator=g)
        elif name.endswith(".bias"):
            p.normal_(0.0, _BIAS_STD, generator=g)
        else:
            p.normal_(0.0, _MATRIX_STD, generator=g)


def build_checkpoint(family: str, directory: pathlib.Path, seed: int = 0, **overrides) -> pathlib.Path:
    """Write a random fp32 checkpoint of `family` into `directory` and return `directory`.

    The directory gets transformers' config.json, a single model.safetensors (fp32; tied
    checkpoints omit lm_head.weight) and a Llama-2-style tokenizer.json of 269 tokens (so
    `genserve serve --model DIR` can serve it). Same `family` and `seed` give identical weights.
    `overrides` set config attributes after the family's (e.g. `sliding_window=None`).
    """
    from tests.engine.checkpoint import sentencepiece_tokenizer

    directory = pathlib.Path(directory)
    config, cls = _config_and_class(family, seed)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.dtype = torch.float32
    torch.manual_seed(seed)  # transformers' own init, overwritten below, stays reproducible too
    model = cls(config).to(torch.float32).eval()
    _randomize(model, family, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    sentencepiece_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


# Loaded reference models, keyed by (resolved directory, mtime_ns of model.safetensors) so a
# checkpoint rebuilt at the same path is reloaded. Test-process lifetime only.
_MODEL_CACHE: dict[tuple[str, int], torch.nn.Module] = {}


def reference_logits(directory: pathlib.Path, token_ids: list[int]) -> torch.Tensor:
    """Transformers' logits for `token_ids` teacher-forced as one sequence (batch 1, no cache).

    Loads `directory` with AutoModelForCausalLM in fp32 and eager attention. Phi-3 LongRoPE picks
    long factors for *all* positions once len(token_ids) > original_max_position_embeddings, so
    a prefix's logits depend on the total length there. Returns an fp32
    tensor [len(token_ids), vocab_size]: row i scores the token after token_ids[: i + 1].
    """
    path = pathlib.Path(directory).resolve()
    key = (str(path), (path / "model.safetensors").stat().st_mtime_ns)
    model = _MODEL_CACHE.get(key)
    if model is None:
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()  # v5: not torch_dtype
        _MODEL_CACHE[key] = model
    ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].float()


_ATTENTION_KEYS = ("architectures", "model_type", "hidden_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "sliding_window", "use_sliding_window",
                   "max_window_layers", "layer_types", "rope_theta", "rope_parameters",
                   "rope_scaling", "rope_local_base_freq", "partial_rotary_factor",
                   "original_max_position_embeddings", "max_position_embeddings",
                   "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                   "attention_bias", "mlp_bias", "hidden_act", "hidden_activation",
                   "rms_norm_eps", "tie_word_embeddings", "torch_dtype", "dtype")


def _self_check() -> None:
    """Build, reload and run every family; print the config.json keys a loader must parse."""
    import tempfile

    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, _COMMON["vocab_size"], (40,), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            d = build_checkpoint(family, pathlib.Path(tmp) / family, seed=3)
            cfg = json.loads((d / "config.json").read_text())
            print(f"=== {family}: files {sorted(p.name for p in d.iterdir())}")
            for k in _ATTENTION_KEYS:
                if k in cfg:
                    print(f"  {k}: {json.dumps(cfg[k])}")
            print(f"  (other keys: {sorted(set(cfg) - set(_ATTENTION_KEYS))})")
            tensors = load_file(d / "model.safetensors")
            layer0 = sorted(n.split(".", 3)[3] for n in tensors if n.startswith("model.layers.0."))
            top = sorted(n for n in tensors if ".layers." not in n)
            print(f"  tensors: {top} + layer0 {layer0}")
            again = load_file(build_checkpoint(family, pathlib.Path(tmp) / "again", 3)
                              / "model.safetensors")
            assert all(torch.equal(tensors[n], again[n]) for n in tensors), "not reproducible"
            norms = [n for n in tensors if "norm" in n]
            biases = [n for n in tensors if n.endswith(".bias")]
            for n in norms + biases:
                t = tensors[n]
                assert t.dtype == torch.float32 and t.std() > 0.05, n
                assert not torch.all(t == 1) and not torch.all(t == 0), n
            print(f"  randomized: {len(norms)} norms (e.g. {norms[0]} mean "
                  f"{tensors[norms[0]].mean():.3f} std {tensors[norms[0]].std():.3f}), "
                  f"{len(biases)} biases")
            logits = reference_logits(d, ids)
            assert logits.shape == (40, _COMMON["vocab_size"]) and logits.dtype == torch.float32
            assert torch.isfinite(logits).all() and logits.std() > 1e-3
            assert not torch.allclose(logits[0], logits[-1])
            loaded = _MODEL_CACHE[next(k for k in _MODEL_CACHE if k[0] == str(d.resolve()))]
            state = loaded.state_dict()
            assert all(torch.equal(state[n], t) for n, t in tensors.items()), "reload differs"
            prefix_same = torch.allclose(reference_logits(d, ids[:16]), logits[:16], atol=1e-5)
            far = reference_logits(d, [(ids[0] + 1) % _COMMON["vocab_size"]] + ids[1:])[-1]
            print(f"  reload == file; logits[:16] same when run alone: {prefix_same}; "
                  f"last logits depend on token 0: {not torch.allclose(far, logits[-1])}")
            print(f"  logits {tuple(logits.shape)} std {logits.std():.3f} "
                  f"min {logits.min():.2f} max {logits.max():.2f}")


if __name__ == "__main__":
    _self_check()
