"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's
attention (per-head q/k RMSNorm, head_dim 128) with mixture-of-experts MLPs
(`engine.model.mlp.MoEFeedForward`): a softmax router over `num_experts` (128), the top
`num_experts_per_tok` (8) SwiGLU experts of `moe_intermediate_size` (768), their weights divided
by their sum where `norm_topk_prob` is set. Layer i is sparse unless it is in `mlp_only_layers`
or (i + 1) is not a multiple of `decoder_sparse_step`; other layers keep the dense MLP of
`intermediate_size` (transformers' `Qwen3MoeDecoderLayer`).

GGUF (`qwen3moe`): the experts stacked as `ffn_{gate,up,down}_exps`, the router `ffn_gate_inp`;
llama.cpp normalizes the top-k weights for this architecture (its converter writes no flag), and a
layer without `ffn_gate_inp` is dense.
"""

from __future__ import annotations

from typing import Any

from engine.model.config import ModelArgs
from engine.model.gguf_config import GGUFMetadata
from engine.model.hf_config import expert_layer_names, moe_args
from engine.model.qwen3 import HF_LAYER_NAMES
from engine.model.qwen3 import config_from_hf as qwen3_config

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3moe",)
_EXPERT_LEAVES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def config_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` from a `Qwen3MoeConfig` dict.

    Raises:
        ValueError: an unsupported RoPE scaling or layer type, no experts, or a top k outside
            1..experts (named).
    """
    n_layers = int(config["num_hidden_layers"])
    dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    step = int(config.get("decoder_sparse_step") or 1)
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    moe = moe_args(config, source, int(config["moe_intermediate_size"]),
                   bool(config.get("norm_topk_prob", False)), sparse)
    return qwen3_config(config, source).replace(moe=moe)


def hf_layer_names(args: ModelArgs, i: int) -> dict[str, str]:
    """Layer i's Hugging Face leaves -> the loader's: Qwen3's, with the router (`mlp.gate`) and
    experts (`mlp.experts.{e}.{gate,up,down}_proj`, or stacked) in a sparse layer."""
    if not args.is_sparse(i):
        return HF_LAYER_NAMES
    dense_mlp = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    return {**{k: v for k, v in HF_LAYER_NAMES.items() if k not in dense_mlp},
            **expert_layer_names(args.moe.n_experts, "mlp.gate", "mlp.experts", _EXPERT_LEAVES)}


def gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A qwen3moe GGUF's options on top of `common_config`'s: the experts (`expert_count`,
    `expert_used_count`, `expert_feed_forward_length`), top-k normalization on (llama.cpp's rule
    for qwen3moe), dense layers where the file has no router, and attention biases when present."""
    config["attention_bias"] = "blk.0.attn_q.bias" in meta.tensor_shapes
    config["num_experts"] = int(meta.arch_get("expert_count"))
    config["num_experts_per_tok"] = int(meta.arch_get("expert_used_count"))
    config["moe_intermediate_size"] = int(meta.arch_get("expert_feed_forward_length"))
    config["norm_topk_prob"] = True
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = [i for i in range(config["num_hidden_layers"])
                                 if f"blk.{i}.ffn_gate_inp.weight" not in meta.tensor_shapes]
    return config
