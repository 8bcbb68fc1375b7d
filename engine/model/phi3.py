"""Phi-3, Phi-3.5 and Phi-4 (`Phi3ForCausalLM`): Llama with fused projections in the checkpoint
(`self_attn.qkv_proj` = Q | K | V rows, `mlp.gate_up_proj` = gate | up rows, split at load),
LongRoPE (`rope_type` longrope, or su) for the 128k-context models, a partial rotary share
(Phi-4-mini: 0.75), and a sliding window on every layer when `sliding_window` is set."""

from __future__ import annotations

from typing import Any

import torch

from engine.model.config import ModelArgs
from engine.model.gguf_config import GGUFMetadata, f32_metadata
from engine.model.hf_config import base_args, layer_kinds
from engine.model.llama import HF_LAYER_NAMES as LLAMA_NAMES

ARCHITECTURES = ("Phi3ForCausalLM",)
GGUF_ARCHITECTURES = ("phi3",)
# A phi3 GGUF keeps the checkpoint's fused tensors: `attn_qkv` (Q | K | V rows) and `ffn_up`
# (gate | up rows); `split_fused` splits them as it splits the Hugging Face ones.
GGUF_LAYER_NAMES = {"attn_qkv": "attention.wqkv_checkpoint", "ffn_up": "feed_forward.w13_checkpoint"}
HF_LAYER_NAMES = {**{k: v for k, v in LLAMA_NAMES.items()
                     if not k.startswith(("self_attn.q_", "self_attn.k_", "self_attn.v_", "mlp.gate_", "mlp.up_"))},
                  "self_attn.qkv_proj": "attention.wqkv_checkpoint",
                  "mlp.gate_up_proj": "feed_forward.w13_checkpoint"}


def config_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` from a `Phi3Config` dict.

    Raises:
        ValueError: an unsupported RoPE scaling (named).
    """
    for key in ("rope_parameters", "rope_scaling"):      # transformers' Phi3Config: "yarn" is LongRoPE
        params = config.get(key) or {}
        if params.get("rope_type", params.get("type")) == "yarn":
            config = {**config, key: {**params, "rope_type": "longrope"}}
    window = config.get("sliding_window")
    layers = layer_kinds(config, int(config["num_hidden_layers"]), source, window, all_sliding=True)
    bias = bool(config.get("attention_bias", False))
    return base_args(config, source, qkv_bias=bias, o_bias=bias, layers=layers)


def split_fused(state: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """Split the checkpoint's fused projections into the loader's names, in place:
    `attention.wqkv_checkpoint` [(H + 2·KVH)·hd, dim] into wq, wk, wv (rows) and
    `feed_forward.w13_checkpoint` [2·ffn, dim] into w1 (gate) and w3 (up); biases alike."""
    hd = args.head_dim
    sizes = [args.n_heads * hd, args.n_kv_heads * hd, args.n_kv_heads * hd]
    for name in [n for n in state if "_checkpoint." in n]:
        tensor = state.pop(name)
        prefix, leaf = name.split("_checkpoint.")
        if prefix.endswith("attention.wqkv"):
            base = prefix.removesuffix("wqkv")
            for part, piece in zip(("wq", "wk", "wv"), tensor.split(sizes)):
                state[f"{base}{part}.{leaf}"] = piece
        else:
            base = prefix.removesuffix("w13")
            gate, up = tensor.chunk(2)
            state[f"{base}w1.{leaf}"], state[f"{base}w3.{leaf}"] = gate, up


def gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A phi3 GGUF's options on top of `common_config`'s: the rotary share from
    `rope.dimension_count`, LongRoPE from the tensors `rope_factors_long/short.weight` with
    `rope.scaling.original_context_length` and `rope.scaling.attn_factor`, and no sliding window
    (llama.cpp disables Phi-3's: its converter does not write the pattern)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rope_dims = int(meta.arch_get("rope.dimension_count", head_dim))
    config["partial_rotary_factor"] = rope_dims / head_dim
    config["attention_bias"] = "blk.0.attn_qkv.bias" in meta.tensor_shapes
    config.pop("sliding_window", None)
    if "rope_factors_long.weight" in meta.tensor_shapes:
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": meta.read_tensor("rope_factors_long.weight").tolist(),
            "short_factor": meta.read_tensor("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": int(meta.arch_get("rope.scaling.original_context_length")),
        }
        attention = meta.arch_get("rope.scaling.attn_factor", None)
        if attention is not None:
            scaling["attention_factor"] = f32_metadata(attention)
        config["rope_scaling"] = scaling
    return config
