"""Reading a Hugging Face `config.json` into `ModelArgs`: the keys every family shares, RoPE
parameters in both of transformers' spellings, and per-layer attention kinds. The family modules
(`engine.model.llama`, `qwen2`, ...) call these and add their own options.

transformers 4.x writes `rope_theta` and `rope_scaling` at the top level; 5.x writes one
`rope_parameters` dict (with `rope_theta` inside), or for models whose layer kinds differ (Gemma 3)
one dict per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`). Both are read.
"""

from __future__ import annotations

from typing import Any

from engine.model.config import LayerAttention, ModelArgs, MoEArgs, RopeScaling

LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported(source: str, what: str) -> ValueError:
    """The error for a checkpoint option genserve cannot serve: names it, says it is refused."""
    return ValueError(f"{source}: {what} is not supported (refused rather than served with wrong numbers)")


def rope_scaling(params: dict[str, Any], config: dict[str, Any], source: str) -> RopeScaling:
    """`RopeScaling` from one RoPE parameter dict (transformers' `rope_parameters` or the older
    `rope_scaling`; `config` gives top-level fallbacks such as original_max_position_embeddings).

    A GGUF's per-pair divisors (`rope_freqs.weight`) arrive as rope_type "freq_factors" with a
    `freq_factors` list (`engine.model.gguf_config` writes them so).

    Raises:
        ValueError: a RoPE type genserve does not implement (named, with the supported ones).
    """
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "freq_factors":
        return RopeScaling(kind=kind, freq_factors=tuple(float(x) for x in params["freq_factors"]))
    if kind == "su":                      # Phi-3's first name for LongRoPE
        kind = "longrope"
    if kind not in ("default", "linear", "llama3", "yarn", "longrope"):
        raise unsupported(source, f"RoPE scaling {kind!r} (supported: default, linear, llama3, yarn, longrope)")
    if kind == "default":
        return RopeScaling()
    # transformers' order: a top-level original_max_position_embeddings (Phi-3) first, then the
    # RoPE parameters', then max_position_embeddings (modeling_rope_utils.standardize_rope_params)
    original = int(config.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings")
                   or config.get("max_position_embeddings") or 0)
    factor = params.get("factor")
    if factor is None:
        factor = (config["max_position_embeddings"] / original) if original else 1.0
    attention = params.get("attention_factor")
    if kind == "yarn" and (params.get("mscale") or params.get("mscale_all_dim")):
        raise unsupported(source, "YaRN with mscale / mscale_all_dim (DeepSeek's variant)")
    return RopeScaling(
        kind=kind, factor=float(factor), original_max_context=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention is None else float(attention),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()))


def rope_for(config: dict[str, Any], layer_type: str, source: str,
             default_theta: float = 10000.0) -> tuple[float, RopeScaling]:
    """(rope_theta, RopeScaling) of layers of `layer_type` ("full_attention" or
    "sliding_attention"), from `rope_parameters` (flat or per layer type) or the 4.x keys."""
    params = config.get("rope_parameters") or {}
    if any(t in params for t in LAYER_TYPES):      # per layer type: complete as it is
        params = params.get(layer_type) or params.get("full_attention") or {}
    else:
        legacy = config.get("rope_scaling") or {}
        if legacy and params.get("rope_type", "default") == "default":
            params = {**params, **legacy}      # a 4.x rope_scaling beside a plain rope_parameters
    theta = float(params.get("rope_theta", config.get("rope_theta", default_theta)))
    return theta, rope_scaling(params, config, source)


def layer_kinds(config: dict[str, Any], n_layers: int, source: str, window: int | None,
                default_theta: float = 10000.0, all_sliding: bool = False) -> tuple[LayerAttention, ...]:
    """Each layer's `LayerAttention`: `layer_types` when the config lists them ("full_attention"
    or "sliding_attention", the latter with `window`), else every layer sliding when
    `all_sliding` (Mistral, Phi-3 with a window) or global.

    Raises:
        ValueError: a layer type other than those two, a list of the wrong length, or a sliding
            layer without a window.
    """
    types = config.get("layer_types")
    if not types:
        types = ["sliding_attention" if all_sliding and window else "full_attention"] * n_layers
    if len(types) != n_layers:
        raise ValueError(f"{source}: {len(types)} layer_types for {n_layers} layers")
    kinds = []
    for kind in types:
        if kind not in LAYER_TYPES:
            raise unsupported(source, f"layer type {kind!r} (supported: {', '.join(LAYER_TYPES)})")
        if kind == "sliding_attention" and not window:
            raise ValueError(f"{source}: sliding_attention layers but no sliding_window")
        theta, scaling = rope_for(config, kind, source, default_theta)
        kinds.append(LayerAttention(window if kind == "sliding_attention" else None, theta, scaling))
    return tuple(kinds)


def qwen_layers(config: dict[str, Any], source: str) -> tuple[LayerAttention, ...]:
    """Qwen2's and Qwen3's per-layer kinds: with `use_sliding_window`, layers from
    `max_window_layers` (transformers' default 28) on slide over `sliding_window`, as
    transformers' Qwen2Config and Qwen3Config derive `layer_types` when a config lists none;
    without it, every layer global. RoPE base 1,000,000 unless the config says."""
    n_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if window and not config.get("layer_types"):
        first = int(config.get("max_window_layers", 28))
        config = {**config, "layer_types": ["sliding_attention" if i >= first else "full_attention"
                                            for i in range(n_layers)]}
    return layer_kinds(config, n_layers, source, window, default_theta=1e6)


def base_args(config: dict[str, Any], source: str, **options: Any) -> ModelArgs:
    """`ModelArgs` from the keys every family shares (sizes, norm epsilon, positions, tying,
    `partial_rotary_factor`, the first architecture's name), with the family's `options` (any
    `ModelArgs` field, `layers` included) on top. When `options` gives no `layers`, every layer
    is global with the config's RoPE. Unless `options` sets the activation, `hidden_act` must
    be SiLU (the gated MLP every Llama-like family uses).

    Raises:
        KeyError: a required size is missing; ValueError: another `hidden_act`, see `rope_for`,
            `ModelArgs`.
    """
    n_heads = int(config["num_attention_heads"])
    if "activation" not in options:         # the SwiGLU families: hidden_act must be SiLU
        act = config.get("hidden_act") or "silu"
        if act not in ("silu", "swish"):
            raise unsupported(source, f"hidden_act {act!r} (supported: silu)")
    theta, scaling = rope_for(config, "full_attention", source)
    params = config.get("rope_parameters") or {}
    partial = float(config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    fields: dict[str, Any] = dict(
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_context=int(config.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        architecture=(config.get("architectures") or ["?"])[0],
        head_dim=int(config.get("head_dim") or 0),
        partial_rotary=partial,
    )
    fields.update(options)
    return ModelArgs(**fields)


def moe_args(config: dict[str, Any], source: str, expert_size: int, norm_topk_prob: bool,
             sparse_layers: tuple[bool, ...]) -> MoEArgs:
    """`MoEArgs` from a mixture-of-experts config: the expert count (`num_experts`, or
    `num_local_experts` as transformers 5 and Mixtral write it) and `num_experts_per_tok`, with
    the family's expert size, normalization and sparse layers.

    Raises:
        ValueError: no experts, or a top k outside 1..experts (named).
    """
    n_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if n_experts < 1:
        raise ValueError(f"{source}: a mixture-of-experts model with no experts (num_experts)")
    if not 0 < top_k <= n_experts:
        raise ValueError(f"{source}: num_experts_per_tok {top_k} must be 1..{n_experts}")
    return MoEArgs(n_experts, top_k, expert_size, norm_topk_prob, sparse_layers)


def expert_layer_names(n_experts: int, router: str, experts: str, leaves: dict[str, str]) -> dict[str, str]:
    """A mixture-of-experts layer's Hugging Face leaves -> the loader's: the router (`router`,
    e.g. "mlp.gate"), each expert's matrices (`experts` + ".{e}." + a key of `leaves`, e.g.
    "mlp.experts.3.gate_proj" -> "feed_forward.experts.3.w1"), and transformers 5's stacked
    tensors under `experts` ("gate_up_proj" [E, 2·F, dim], "down_proj" [E, dim, F])."""
    names = {router: "feed_forward.router",
             f"{experts}.gate_up_proj": "feed_forward.experts_w13_stacked",
             f"{experts}.down_proj": "feed_forward.experts_w2_stacked"}
    for e in range(n_experts):
        for leaf, ours in leaves.items():
            names[f"{experts}.{e}.{leaf}"] = f"feed_forward.experts.{e}.{ours}"
    return names
