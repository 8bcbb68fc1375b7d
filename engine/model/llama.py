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
from engine.model.hf_config import base_args, layer_kinds, unsupported

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
GGUF_ARCHITECTURES = ("llama",)

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
