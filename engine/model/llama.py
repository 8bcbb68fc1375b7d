"""The Llama family (Llama 1–3.3, Mistral, SmolLM2, and other `LlamaForCausalLM` checkpoints):
the shared network (`engine.model.transformer`) with no extra option but these:

* Llama 3.1+: RoPE scaling "llama3" (`rope_parameters` / `rope_scaling`); Llama 3.2 ties the
  embeddings.
* `attention_bias` (some Llama derivatives): biases on all four attention projections.
* Mistral: a sliding window on every layer when `sliding_window` is set; Mistral-Nemo's
  `head_dim` (128) is not hidden_size / heads.

`mlp_bias` and `pretraining_tp` > 1 are refused.
"""

from __future__ import annotations

from typing import Any

from engine.model.config import ModelArgs
from engine.model.gguf_config import GGUFMetadata
from engine.model.hf_config import base_args, layer_kinds, unsupported

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
GGUF_ARCHITECTURES = ("llama",)
# llama.cpp's converter permutes a llama-architecture file's Q and K rows (weights and biases)
# from rotate-half into interleaved pairs; the loader permutes them back.
GGUF_PERMUTED_QK = True

# Hugging Face leaf name -> the loader's, per layer (`model.layers.{i}.<leaf>.weight` / `.bias`).
HF_LAYER_NAMES = {
    "input_layernorm": "attention_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}


def config_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` from a `LlamaConfig` / `MistralConfig` dict.

    Raises:
        ValueError: `mlp_bias`, `pretraining_tp` > 1, or an unsupported RoPE scaling (named).
    """
    if config.get("mlp_bias"):
        raise unsupported(source, "mlp_bias")
    if int(config.get("pretraining_tp") or 1) != 1:
        raise unsupported(source, f"pretraining_tp {config['pretraining_tp']}")
    bias = bool(config.get("attention_bias", False))
    mistral = "MistralForCausalLM" in (config.get("architectures") or []) or config.get("model_type") == "mistral"
    # transformers: MistralConfig's sliding_window defaults to 4096 (v0.1); LlamaConfig has none
    window = config.get("sliding_window", 4096) if mistral else None
    layers = layer_kinds(config, int(config["num_hidden_layers"]), source, window, all_sliding=True)
    return base_args(config, source, qkv_bias=bias, o_bias=bias, layers=layers)


def gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A llama-architecture GGUF's options on top of `common_config`'s: attention biases when
    the file has them, and Llama 3.1+'s RoPE scaling, which llama.cpp's converter writes as the
    tensor `rope_freqs.weight` (per-pair divisors of θ_j, computed from the checkpoint's llama3
    parameters) rather than as metadata. llama.cpp serves Mistral files under this architecture
    too, without their sliding window; so does genserve. A file with `expert_count` is Mixtral
    (its config is marked `MixtralForCausalLM`, which `engine.model.mixtral` serves).

    Raises:
        ValueError: RoPE over part of a head (`rope.dimension_count` below the head size).
    """
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    rope_dims = int(meta.arch_get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"{meta.source}: RoPE over {rope_dims} of {head_dim} head dims is not supported")
    config["attention_bias"] = "blk.0.attn_q.bias" in meta.tensor_shapes
    if int(meta.arch_get("expert_count", 0) or 0):       # Mixtral: engine.model.mixtral serves it
        config["architectures"] = ["MixtralForCausalLM"]
        config["num_local_experts"] = int(meta.arch_get("expert_count"))
        config["num_experts_per_tok"] = int(meta.arch_get("expert_used_count"))
    if "rope_freqs.weight" in meta.tensor_shapes:
        config["rope_scaling"] = {"rope_type": "freq_factors",
                                  "freq_factors": meta.read_tensor("rope_freqs.weight").tolist()}
    return config
