"""Reading a GGUF's metadata as the `config.json` dict its family module reads.

A GGUF (llama.cpp's file format) keeps a model's hyperparameters as metadata keys prefixed by its
`general.architecture` (`qwen3.block_count`, `gemma3.attention.sliding_window`, ...), and some
options as tensors (Llama 3.1's RoPE scaling as `rope_freqs.weight`, Phi-3's LongRoPE as
`rope_factors_long/short.weight`). `common_config` maps the shared keys to transformers' names;
a family module's optional `gguf_config(meta, config)` adds what its files differ in, including
what llama.cpp's converter leaves out and llama.cpp hard-codes (Gemma 3's layer pattern and local
RoPE base). The result goes through the same `config_from_hf` as a checkpoint directory, so one
code path decides every option.

Tensor names (llama.cpp's `gguf-py/gguf/constants.py`) map to the loader's by `GGUF_LAYER_NAMES`
(a family may override leaves: Phi-3's fused `attn_qkv` and gate|up `ffn_up`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF per-layer leaf (`blk.{i}.<leaf>.weight|bias`) -> the loader's (`layers.{i}.<ours>`).
GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "attn_q_norm": "attention.q_norm",
    "attn_k_norm": "attention.k_norm",
    "post_attention_norm": "post_attention_norm",     # Gemma's sandwich norms
    "ffn_norm": "ffn_norm",                           # Gemma: pre_feedforward_layernorm
    "post_ffw_norm": "post_ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "ffn_gate_inp": "feed_forward.router",            # mixture-of-experts layers
    "ffn_gate_exps": "feed_forward.experts_w1_stacked",
    "ffn_up_exps": "feed_forward.experts_w3_stacked",
    "ffn_down_exps": "feed_forward.experts_w2_stacked",
}

_MISSING = object()


@dataclass(frozen=True, slots=True)
class GGUFMetadata:
    """A GGUF's metadata and tensor reader, with the file's name for error messages.

    Attributes:
        fields: metadata key -> value (`gguf.ReaderField.contents()`).
        arch: `general.architecture`.
        source: the file's name.
        tensor_shapes: GGUF tensor name -> numpy-order shape ([rows, columns] for a matrix).
        read_tensor: name -> the tensor dequantized to float32 numpy (numpy order).
    """

    fields: Mapping[str, Any]
    arch: str
    source: str
    tensor_shapes: Mapping[str, tuple[int, ...]]
    read_tensor: Callable[[str], np.ndarray]

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of `key`; `default` when absent.

        Raises:
            KeyError: absent and no default (the message names the key and the file).
        """
        if key in self.fields:
            return self.fields[key]
        if default is _MISSING:
            raise KeyError(f"{self.source}: metadata key {key!r} missing")
        return default

    def arch_get(self, key: str, default: Any = _MISSING) -> Any:
        """`get(f"{arch}.{key}")`: a key under the file's architecture prefix."""
        return self.get(f"{self.arch}.{key}", default)


def f32_metadata(value: float) -> float:
    """A float32 GGUF value as the shortest decimal that round-trips in float32.

    GGUF stores e.g. ``rms_norm_eps`` as float32, which reads back as 9.999999747378752e-06; this
    gives 1e-05, the value the model was trained with (and the one its config.json states)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def common_config(meta: GGUFMetadata, hf_architecture: str) -> dict[str, Any]:
    """The `config.json` keys every family's GGUF states (llama.cpp's `LLM_KV_*` names):
    sizes, context, RoPE base, norm epsilon, head size (`attention.key_length` where the head is
    not width / heads), tying (no `output.weight`), and RoPE scaling given as metadata
    (`rope.scaling.type` linear or yarn, with `rope.scaling.factor` and
    `rope.scaling.original_context_length`).

    Raises:
        KeyError: a required key or `token_embd.weight` is missing.
        ValueError: a RoPE scaling type other than none, linear or yarn.
    """
    if "token_embd.weight" not in meta.tensor_shapes:
        raise KeyError(f"{meta.source}: tensor 'token_embd.weight' missing")
    n_heads = int(meta.arch_get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [hf_architecture],
        "hidden_size": int(meta.arch_get("embedding_length")),
        "num_hidden_layers": int(meta.arch_get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.arch_get("attention.head_count_kv", n_heads)),
        "intermediate_size": int(meta.arch_get("feed_forward_length")),
        "vocab_size": int(meta.tensor_shapes["token_embd.weight"][0]),   # vocab_size key is optional
        "max_position_embeddings": int(meta.arch_get("context_length")),
        "rms_norm_eps": f32_metadata(meta.arch_get("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in meta.tensor_shapes,
    }
    theta = meta.arch_get("rope.freq_base", None)
    if theta is not None:
        config["rope_theta"] = f32_metadata(theta)
    key_length = meta.arch_get("attention.key_length", None)
    if key_length is not None:
        config["head_dim"] = int(key_length)
    kind = meta.arch_get("rope.scaling.type", "none") or "none"
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"{meta.source}: RoPE scaling type {kind!r} in the metadata is not supported "
                         "(supported: none, linear, yarn)")
    if kind != "none":
        scaling: dict[str, Any] = {"rope_type": kind,
                                   "factor": f32_metadata(meta.arch_get("rope.scaling.factor"))}
        original = meta.arch_get("rope.scaling.original_context_length", None)
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = scaling
    return config
