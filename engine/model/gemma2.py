"""Gemma 2 (`Gemma2ForCausalLM`): the shared network with Gemma's options —

* norms stored as w of (1 + w)·x̂ (`norm_offset` 1, folded in at load), in fp32;
* sandwich norms: `post_attention_layernorm` on the attention output and
  `post_feedforward_layernorm` on the MLP's, before each residual add
  (`pre_feedforward_layernorm` is the usual pre-MLP norm);
* GeGLU (`hidden_activation` gelu_pytorch_tanh), embeddings × √hidden_size;
* score scale `query_pre_attn_scalar`^-½, attention softcap (50) and final-logit softcap (30);
* sliding and global layers alternating (`layer_types`; window 4096).
"""

from __future__ import annotations

import math
from typing import Any

from engine.model.config import ModelArgs
from engine.model.gguf_config import GGUFMetadata
from engine.model.hf_config import base_args, layer_kinds, unsupported
from engine.model.llama import HF_LAYER_NAMES as LLAMA_NAMES

ARCHITECTURES = ("Gemma2ForCausalLM",)
GGUF_ARCHITECTURES = ("gemma2",)
HF_LAYER_NAMES = {**LLAMA_NAMES,
                  "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffn_norm"}


def activation(config: dict[str, Any], source: str) -> str:
    """The MLP gate of a Gemma config: "gelu_tanh" for gelu_pytorch_tanh (every release).

    Raises:
        ValueError: any other activation.
    """
    name = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if name not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise unsupported(source, f"hidden_activation {name!r} (supported: gelu_pytorch_tanh)")
    return "gelu_tanh"


def gemma_options(config: dict[str, Any], source: str, default_theta: float,
                  softcaps: tuple[float | None, float | None]) -> dict[str, Any]:
    """The options Gemma 2 and 3 share, as `ModelArgs` fields; a key the config lacks takes
    transformers' default (sliding_window 4096, query_pre_attn_scalar 256, the softcaps
    `softcaps` = (attention, final)).

    Raises:
        ValueError: `use_bidirectional_attention` (EmbeddingGemma's encoder), an unsupported
            activation or layer type.
    """
    if config.get("use_bidirectional_attention"):
        raise unsupported(source, "use_bidirectional_attention (an encoder, not a causal LM)")
    n_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window", 4096)
    if "layer_types" not in config and window:
        config = {**config, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(n_layers)]}
    scalar = config.get("query_pre_attn_scalar", 256)
    return dict(norm_offset=1.0, sandwich_norm=True, activation=activation(config, source),
                embedding_scale=math.sqrt(int(config["hidden_size"])),
                query_scale=float(scalar) ** -0.5 if scalar else 0.0,
                attn_softcap=config.get("attn_logit_softcapping", softcaps[0]),
                final_softcap=config.get("final_logit_softcapping", softcaps[1]),
                layers=layer_kinds(config, n_layers, source, window, default_theta),
                tie_embeddings=bool(config.get("tie_word_embeddings", True)))


def config_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` from a `Gemma2Config` dict.

    Raises:
        ValueError: an unsupported activation, RoPE scaling or layer type (named).
    """
    return base_args(config, source, **gemma_options(config, source, default_theta=10000.0,
                                                     softcaps=(50.0, 30.0)))


def gguf_layer_types(meta: GGUFMetadata, n_layers: int, default_pattern: int) -> list[str]:
    """Gemma's layer kinds as llama.cpp reads them from a GGUF: `attention.sliding_window_pattern`
    as a per-layer bool array, or as a period n (layer i slides unless i % n == n - 1; 0: every
    layer slides), else `default_pattern` (llama.cpp's `load_swa_pattern` and
    `llama_hparams::set_swa_pattern`)."""
    pattern = meta.arch_get("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (list, tuple)):
        sliding = [bool(x) for x in pattern][:n_layers]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def gguf_query_scalar(config: dict[str, Any], big_layers: int) -> float:
    """`query_pre_attn_scalar` as llama.cpp sets it (a GGUF does not store it): hidden / heads
    for the 27B model (`big_layers` layers), the head size otherwise (llama.cpp's
    `f_attention_scale`, after gemma_pytorch's config)."""
    if int(config["num_hidden_layers"]) == big_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return int(config.get("head_dim") or 256)


def gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A gemma2 GGUF's options on top of `common_config`'s, with llama.cpp's defaults where the
    file is silent: window 4096, every other layer sliding, the softcaps (50, 30), the local
    layers' RoPE base equal to the global one. Norm weights in the file already hold 1 + w
    (llama.cpp's converter adds the 1)."""
    n_layers = int(config["num_hidden_layers"])
    config["sliding_window"] = int(meta.arch_get("attention.sliding_window", 4096))
    config["layer_types"] = gguf_layer_types(meta, n_layers, 2)
    config["attn_logit_softcapping"] = float(meta.arch_get("attn_logit_softcapping", 50.0))
    config["final_logit_softcapping"] = float(meta.arch_get("final_logit_softcapping", 30.0))
    config["query_pre_attn_scalar"] = gguf_query_scalar(config, big_layers=46)
    local = meta.arch_get("rope.freq_base_swa", None)
    if local is not None and float(local) != float(config.get("rope_theta", 10000.0)):
        raise ValueError(f"{meta.source}: a separate RoPE base for Gemma 2's sliding layers is not supported")
    return config
