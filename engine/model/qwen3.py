"""Qwen3 (`Qwen3ForCausalLM`): Llama with a per-head RMSNorm of q and k before RoPE (weights
[head_dim], `self_attn.q_norm` / `k_norm`), a head_dim independent of the width (128 at every
size), biases on all four attention projections only when `attention_bias` is set, and, with
`use_sliding_window`, sliding layers from `max_window_layers` on (as Qwen2)."""

from __future__ import annotations

from typing import Any

from engine.model.config import ModelArgs
from engine.model.gguf_config import GGUFMetadata
from engine.model.hf_config import base_args, qwen_layers
from engine.model.llama import HF_LAYER_NAMES as LLAMA_NAMES

ARCHITECTURES = ("Qwen3ForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3",)
HF_LAYER_NAMES = {**LLAMA_NAMES, "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm"}


def config_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` from a `Qwen3Config` dict.

    Raises:
        ValueError: an unsupported RoPE scaling or layer type (named).
    """
    layers = qwen_layers(config, source)
    bias = bool(config.get("attention_bias", False))
    return base_args(config, source, qkv_bias=bias, o_bias=bias, qk_norm=True, layers=layers)


def gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A qwen3 GGUF's options on top of `common_config`'s (which reads the head size from
    `attention.key_length`): attention biases when the file has them."""
    config["attention_bias"] = "blk.0.attn_q.bias" in meta.tensor_shapes
    return config
