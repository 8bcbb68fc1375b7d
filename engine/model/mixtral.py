"""Mixtral (`MixtralForCausalLM`: Mixtral-8x7B, 8x22B): Mistral's attention with a
mixture-of-experts MLP in every layer (`engine.model.mlp.MoEFeedForward`): a softmax router over
`num_local_experts` (8), the top `num_experts_per_tok` (2) SwiGLU experts of `intermediate_size`,
their weights always divided by their sum (transformers' `MixtralSparseMoeBlock`); a sliding
window on every layer when `sliding_window` is set.

GGUF: llama.cpp writes Mixtral under the `llama` architecture with `expert_count` set and the
experts stacked (`ffn_{gate,up,down}_exps`), Q/K rows permuted as for Llama;
`engine.model.llama.gguf_config` sends such a file here.
"""

from __future__ import annotations

from typing import Any

from engine.model.config import ModelArgs
from engine.model.hf_config import base_args, expert_layer_names, layer_kinds, moe_args, unsupported
from engine.model.llama import HF_LAYER_NAMES as LLAMA_NAMES

ARCHITECTURES = ("MixtralForCausalLM",)
GGUF_ARCHITECTURES = ()            # served from `llama` files (module docstring)
GGUF_PERMUTED_QK = True
_EXPERT_LEAVES = {"w1": "w1", "w3": "w3", "w2": "w2"}
_ATTENTION_NAMES = {k: v for k, v in LLAMA_NAMES.items() if not k.startswith("mlp.")}


def config_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` from a `MixtralConfig` dict (every layer sparse).

    Raises:
        ValueError: an unsupported RoPE scaling, no experts, a top k outside 1..experts, or
            `attention_bias` (named).
    """
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise unsupported(source, "Mixtral with attention_bias / mlp_bias")
    n_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    layers = layer_kinds(config, n_layers, source, window, default_theta=1e6, all_sliding=True)
    moe = moe_args(config, source, int(config["intermediate_size"]), True, (True,) * n_layers)
    return base_args(config, source, layers=layers, moe=moe)


def hf_layer_names(args: ModelArgs, i: int) -> dict[str, str]:
    """Layer i's Hugging Face leaves -> the loader's: Llama's attention and norms, the router
    (`block_sparse_moe.gate`, or transformers 5's `mlp.gate`) and the experts
    (`block_sparse_moe.experts.{e}.w{1,3,2}`, or stacked under `mlp.experts`)."""
    n = args.moe.n_experts
    return {**_ATTENTION_NAMES,
            **expert_layer_names(n, "block_sparse_moe.gate", "block_sparse_moe.experts", _EXPERT_LEAVES),
            **expert_layer_names(n, "mlp.gate", "mlp.experts", _EXPERT_LEAVES)}
