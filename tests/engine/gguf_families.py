"""Tiny GGUF files of every family, written from the tiny Hugging Face checkpoints of
`tests.engine.hf_families` the way llama.cpp's converter (`convert_hf_to_gguf.py`, its
`conversion/` modules) writes a real model:

* metadata under the GGUF architecture's prefix (`llama`, `qwen2`, `qwen3`, `gemma2`, `gemma3`,
  `phi3`), with `attention.key_length` where the config states a head size;
* llama files: Q and K rows permuted into interleaved pairs (`LlamaModel.permute`), Llama 3's RoPE
  scaling as the tensor `rope_freqs.weight` (the converter's `generate_extra_tensors` formula);
* Gemma files: every `*norm.weight` stored as 1 + w (`norm_shift`); Gemma 3's RoPE base the global
  layers', its linear scaling as `rope.scaling.*`, the sliding window as metadata (the layer
  pattern and the local base are not written: llama.cpp hard-codes them);
* Phi-3 files: `attn_qkv` and the gate|up `ffn_up` kept fused, LongRoPE as the tensors
  `rope_factors_long/short.weight` with `rope.scaling.original_context_length` and
  `rope.scaling.attn_factor`;
* mixture-of-experts files (qwen3moe; Mixtral under `llama`): `expert_count`, `expert_used_count`
  (qwen3moe: `expert_feed_forward_length`), the router as `ffn_gate_inp` (F32: llama-quantize
  leaves it unquantized) and the experts stacked as `ffn_{gate,up,down}_exps` [experts, out, in];
* matrices in `qtype` (any type `gguf.quants.quantize` writes), 1-D tensors in F32, as llama.cpp
  keeps norms and biases.

What a GGUF cannot express is overridden in the checkpoint first (`GGUF_OVERRIDES`): llama.cpp
serves Mistral files without their window and Gemma with its hard-coded score scale, so those
checkpoints are built that way and transformers on the directory stays the exact reference.
"""

from __future__ import annotations

import json
import math
import pathlib

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file

from tests.engine.hf_families import build_checkpoint

GGUF_ARCH = {"llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "phi3_partial": "phi3",
             "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# checkpoint settings a GGUF cannot state, set to what llama.cpp serves instead
GGUF_OVERRIDES = {"mistral": dict(sliding_window=None), "gemma2": dict(query_pre_attn_scalar=16),
                  "gemma3": dict(query_pre_attn_scalar=16), "mixtral": dict(sliding_window=None),
                  "qwen3_moe": dict(norm_topk_prob=True)}
_ROUTERS = ("mlp.gate", "block_sparse_moe.gate")
_EXPERTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
            "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate_up_proj": "ffn_up"}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rotate-half rows -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The converter's `rope_freqs` (Llama 3.1+): per-pair divisors of θ_j."""
    base, factor = rope.get("rope_theta", 10000.0), rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for j in range(0, head_dim, 2):
        freq = 1.0 / (base ** (j / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(family: str, directory: pathlib.Path, path: pathlib.Path,
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32, **overrides) -> pathlib.Path:
    """Build `family`'s tiny checkpoint in `directory` (with `GGUF_OVERRIDES`) and write it as a
    GGUF at `path`, matrices in `qtype`. For a quantized `qtype` the checkpoint's matrices are
    replaced by their quantize-dequantize round trip (what the file holds), so the directory
    stays the file's exact reference. `overrides` set further config attributes. Returns `path`."""
    build_checkpoint(family, directory, **GGUF_OVERRIDES.get(family, {}), **overrides)
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    if qtype != gguf.GGMLQuantizationType.F32:
        # the checkpoint becomes the file's exact twin: each matrix as the quantized file holds
        # it, so transformers on the directory is the reference for the quantized file
        tensors = {name: (gguf.quants.dequantize(gguf.quants.quantize(t, qtype), qtype).reshape(t.shape)
                          if t.ndim == 2 and not name.endswith(tuple(r + ".weight" for r in _ROUTERS))
                          else t) for name, t in tensors.items()}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    arch = GGUF_ARCH[family]
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    rope = config.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    if "head_dim" in config and arch != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    extra: dict[str, np.ndarray] = {}
    if family == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(config["sliding_window"])
    else:
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if family == "gemma2":
        w.add_sliding_window(config["sliding_window"])
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        if rope.get("rope_type") == "llama3":
            extra["rope_freqs.weight"] = _llama3_rope_freqs(rope, head_dim)
    if arch == "phi3":
        partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        w.add_rope_dimension_count(int(partial * head_dim))
        orig = config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    n_experts = config.get("num_experts") or config.get("num_local_experts")
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_file_type(int(qtype) if qtype != gguf.GGMLQuantizationType.F32 else 0)

    gemma = arch.startswith("gemma")
    names = {**_LAYER, **(_GEMMA_LAYER if gemma else {"post_attention_layernorm": "ffn_norm"})}

    def add(name: str, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.float32)
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    stacked: dict[str, dict[int, np.ndarray]] = {}      # blk.{i}.ffn_*_exps -> expert -> matrix
    for hf_name, data in tensors.items():
        if gemma and hf_name.endswith("norm.weight"):
            data = data + 1.0                      # norm_shift: the file holds 1 + w
        if hf_name == "model.embed_tokens.weight":
            add("token_embd.weight", data)
        elif hf_name == "model.norm.weight":
            add("output_norm.weight", data)
        elif hf_name == "lm_head.weight":
            if not config.get("tie_word_embeddings"):
                add("output.weight", data)
        else:
            parts = hf_name.split(".")             # model.layers.{i}.<leaf...>.<weight|bias>
            i, leaf, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            if leaf in _ROUTERS:
                w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", np.ascontiguousarray(data, dtype=np.float32))
                continue
            if ".experts." in leaf:                # <mlp|block_sparse_moe>.experts.{e}.<matrix>
                e, matrix = int(parts[-3]), parts[-2]
                stacked.setdefault(f"blk.{i}.{_EXPERTS[matrix]}.weight", {})[e] = data
                continue
            gg = names[leaf]
            if arch == "llama" and gg in ("attn_q", "attn_k"):
                data = _permute(data, n_heads if gg == "attn_q" else n_kv)
            add(f"blk.{i}.{gg}.{kind}", data)
    for name, experts in stacked.items():
        add(name, np.stack([experts[e] for e in sorted(experts)]))
    for name, data in extra.items():
        add(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
