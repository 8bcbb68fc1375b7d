"""The model registry: which module serves a checkpoint's architecture (the shape of vLLM's
`model_executor/models/registry.py` and mini-sglang's `models/register.py`).

A name from `config.json`'s `architectures` (or a GGUF's `general.architecture`) maps to a family
module of `engine.model`, imported only when a checkpoint asks for it; several names may share
one module (Mistral is Llama with a window). Every family module provides:

* `ARCHITECTURES`, `GGUF_ARCHITECTURES`: the names it serves;
* `config_from_hf(config: dict, source: str) -> ModelArgs`: the checkpoint's options, every one
  explicit, refusing (ValueError naming it) any it cannot serve;
* `HF_LAYER_NAMES`: Hugging Face leaf names of a layer (`model.layers.{i}.<leaf>`) → the
  loader's (`engine.model.weights`), or `hf_layer_names(args, i)` where layers differ (the
  mixture-of-experts families: a sparse layer's router and experts);
* optionally `split_fused(state, args)`: turns fused checkpoint tensors into the loader's;
* for GGUF files, optionally `gguf_config(meta, config) -> config` (its options on top of
  `engine.model.gguf_config.common_config`), `GGUF_LAYER_NAMES` (leaf overrides) and
  `GGUF_PERMUTED_QK` (llama.cpp permuted the Q/K rows).

The network itself is shared (`engine.model.transformer.Transformer`): the families differ in
options, not in code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

# architectures name -> family module (engine.model.<module>)
_HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# config.json model_type -> architectures name, for a config that lists no architectures
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
}
# GGUF general.architecture -> family module
_GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
    "phi3": "phi3", "qwen3moe": "qwen3_moe",
}


@dataclass(frozen=True, slots=True)
class Family:
    """A registered family: its module name and the loaded module."""

    name: str
    module: ModuleType


def supported_architectures() -> tuple[str, ...]:
    """Every `architectures` name the registry serves, sorted."""
    return tuple(sorted(_HF_ARCHITECTURES))


def family_modules() -> tuple[str, ...]:
    """The family modules' full names (`engine.model.llama` ...), sorted."""
    return tuple(sorted({f"engine.model.{m}" for m in (*_HF_ARCHITECTURES.values(), *_GGUF_ARCHITECTURES.values())}))


def supported_gguf_architectures() -> tuple[str, ...]:
    """Every GGUF `general.architecture` the registry serves, sorted."""
    return tuple(sorted(_GGUF_ARCHITECTURES))


def family_for(architectures: list[str] | tuple[str, ...], source: str) -> Family:
    """The family serving the first of `architectures` that is registered (imported lazily).

    Raises:
        ValueError: none is registered; the message names them and lists the supported ones.
    """
    for name in architectures:
        if name in _HF_ARCHITECTURES:
            module = _HF_ARCHITECTURES[name]
            return Family(module, importlib.import_module(f"engine.model.{module}"))
    raise ValueError(f"{source}: architecture {', '.join(architectures) or '(none)'} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")


def family_for_config(config: dict, source: str) -> Family:
    """The family serving a `config.json` dict: by its `architectures`, else its `model_type`.

    Raises:
        ValueError: not registered (see `family_for`).
    """
    names = list(config.get("architectures") or [])
    if not names and config.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[config["model_type"]]]
    if not names:
        names = [f"model_type {config.get('model_type')!r}"]
    return family_for(names, source)


def family_for_gguf(architecture: str, source: str) -> Family:
    """The family serving a GGUF's `general.architecture` (imported lazily).

    Raises:
        ValueError: not registered; the message lists the supported ones.
    """
    if architecture not in _GGUF_ARCHITECTURES:
        raise ValueError(f"{source}: GGUF architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(supported_gguf_architectures())}")
    module = _GGUF_ARCHITECTURES[architecture]
    return Family(module, importlib.import_module(f"engine.model.{module}"))
