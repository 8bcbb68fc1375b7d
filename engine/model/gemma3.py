"""Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text): Gemma 2's options
(`engine.model.gemma2`) without the softcaps, plus per-head q/k RMSNorm stored as (1 + w), five
sliding (local) layers to one global, and two RoPE bases: 10,000 on the local layers, 1,000,000
(linear ×8 on the 4B and larger) on the global ones. transformers 5 writes `rope_parameters` per
layer type; 4.x wrote `rope_theta`, `rope_local_base_freq` and `rope_scaling` (global only)."""

from __future__ import annotations

from typing import Any

from engine.model.config import ModelArgs
from engine.model.gemma2 import HF_LAYER_NAMES as GEMMA2_NAMES, gemma_options, gguf_layer_types, gguf_query_scalar
from engine.model.gguf_config import GGUFMetadata, f32_metadata
from engine.model.hf_config import base_args

ARCHITECTURES = ("Gemma3ForCausalLM",)
GGUF_ARCHITECTURES = ("gemma3",)
HF_LAYER_NAMES = {**GEMMA2_NAMES, "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm"}


def config_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` from a `Gemma3TextConfig` dict (either transformers spelling of its RoPE).

    Raises:
        ValueError: an unsupported activation, RoPE scaling or layer type (named).
    """
    config = dict(config)
    n_layers = int(config["num_hidden_layers"])
    if "layer_types" not in config:
        pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
        config["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                 for i in range(n_layers)]
    params = config.get("rope_parameters") or {}
    if not any(t in params for t in ("full_attention", "sliding_attention")):
        # 4.x: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        full = {**(config.get("rope_scaling") or {}), **params,
                "rope_theta": params.get("rope_theta", config.get("rope_theta", 1e6))}
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}
        config["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    config.pop("rope_scaling", None)          # 4.x: the global layers' only, folded in above
    options = gemma_options(config, source, default_theta=1e6, softcaps=(None, None))
    return base_args(config, source, qk_norm=True, **options)


def gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A gemma3 GGUF's options on top of `common_config`'s (RoPE base and linear scaling there
    are the global layers'), as llama.cpp reads them: without `attention.sliding_window` every
    layer is global; with it five sliding layers to one global unless
    `attention.sliding_window_pattern` says otherwise, the sliding layers' RoPE base
    `rope.freq_base_swa` or 10,000 and never scaled. No softcaps unless the file states a final
    one. Norm weights in the file already hold 1 + w."""
    n_layers = int(config["num_hidden_layers"])
    window = int(meta.arch_get("attention.sliding_window", 0) or 0)
    if window > 0:
        config["sliding_window"] = window
        config["layer_types"] = gguf_layer_types(meta, n_layers, 6)
    else:
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * n_layers
    config["rope_local_base_freq"] = f32_metadata(meta.arch_get("rope.freq_base_swa", 10000.0))
    config["rope_theta"] = config.get("rope_theta", 1e6)
    config["query_pre_attn_scalar"] = gguf_query_scalar(config, big_layers=62)
    softcap = meta.arch_get("final_logit_softcapping", None)
    if softcap:
        config["final_logit_softcapping"] = float(softcap)
    return config
