"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama with biases on the Q, K and V projections
(never on the output projection), RoPE base 1,000,000, and, when `use_sliding_window` is set,
sliding layers from `max_window_layers` on (transformers' `layer_types`)."""

from __future__ import annotations

from typing import Any

from engine.model.config import ModelArgs
from engine.model.hf_config import base_args, qwen_layers
from engine.model.llama import HF_LAYER_NAMES  # Llama's names; the q/k/v biases come with them

ARCHITECTURES = ("Qwen2ForCausalLM",)
GGUF_ARCHITECTURES = ("qwen2",)


def config_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` from a `Qwen2Config` dict (qkv_bias always on).

    Raises:
        ValueError: an unsupported RoPE scaling or layer type (named).
    """
    layers = qwen_layers(config, source)
    return base_args(config, source, qkv_bias=True, layers=layers)
