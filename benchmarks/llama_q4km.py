"""A 1B-class Llama 3 GGUF with random weights, written as llama.cpp's converter writes a real
Llama 3.2 1B (F16 matrices), for llama.cpp's own `llama-quantize` to turn into Q4_K_M:

    python -m benchmarks.llama_q4km --out /tmp/llama1b/f16.gguf
    llama-quantize /tmp/llama1b/f16.gguf /tmp/llama1b/q4km.gguf Q4_K_M

The Q4_K_M file is then what `benchmarks.peer --model` serves to genserve and llama.cpp's server
alike (docs/benchmarks/llama1b_q4km.md). No Llama weights are on this machine, and speed does not
depend on the values, so the weights are random:

* shape: Llama 3.2 1B's — width 2,048, 16 layers, 32 query heads and 8 KV heads of 64, SwiGLU
  8,192, RMSNorm ε 1e-5, context 131,072, RoPE θ 500,000 with Llama 3.1's scaling (factor 32, low 1,
  high 4, original context 8,192) written as llama.cpp's converter writes it: the tensor
  `rope_freqs.weight` of per-pair divisors (`tests.engine.gguf_families._llama3_rope_freqs`), no
  scaling keys; tied embeddings (no `output.weight`);
* weights N(0, 0.02) in F16, norms 1 in F32; Q and K rows permuted into interleaved pairs
  (`LlamaModel.permute`, as the converter does with a checkpoint's rows: for random rows it only
  keeps the file honest);
* vocabulary: **not Llama 3's** (128,256 tokens, not on this machine). Both servers need a real
  byte-level BPE tokenizer, so the embedded SmolLM2 GGUF's `tokenizer.ggml.*` metadata is copied
  (49,152 tokens, model gpt2, pre smollm) and the embedding / output matrix has 49,152 rows. With
  Llama 3's vocabulary the tied output matrix would be 2.6× larger (263 M weights instead of 101 M),
  which weighs on a one-stream decode step.

Tensors are generated and written one at a time (the writer is given each tensor's shape first,
then the data in the same order), so the memory held is one matrix, not the 2.1 GB file.
"""

from __future__ import annotations

import argparse
import pathlib

import gguf
import numpy as np

from tests.engine.gguf_families import _llama3_rope_freqs, _permute

ARCH = "llama"
SHAPE = dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, context=131072,
             eps=1e-5, theta=500000.0)
ROPE = dict(rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)
STD = 0.02


def tokenizer_fields(source: pathlib.Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """Every `tokenizer.*` key of `source` as (key, value, type, array item type)."""
    out = []
    for key, field in gguf.GGUFReader(str(source)).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        out.append((key, value, vtype, sub))
    return out


def tensor_plan(vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) in file order; kind is 'norm', 'rope', 'q', 'k' or 'matrix'."""
    h, f, hd = SHAPE["hidden"], SHAPE["ffn"], SHAPE["head_dim"]
    q, kv = SHAPE["heads"] * hd, SHAPE["kv_heads"] * hd
    plan = [("token_embd.weight", (vocab, h), "matrix"), ("rope_freqs.weight", (hd // 2,), "rope")]
    for i in range(SHAPE["layers"]):
        plan += [(f"blk.{i}.attn_norm.weight", (h,), "norm"),
                 (f"blk.{i}.attn_q.weight", (q, h), "q"),
                 (f"blk.{i}.attn_k.weight", (kv, h), "k"),
                 (f"blk.{i}.attn_v.weight", (kv, h), "matrix"),
                 (f"blk.{i}.attn_output.weight", (h, q), "matrix"),
                 (f"blk.{i}.ffn_norm.weight", (h,), "norm"),
                 (f"blk.{i}.ffn_gate.weight", (f, h), "matrix"),
                 (f"blk.{i}.ffn_up.weight", (f, h), "matrix"),
                 (f"blk.{i}.ffn_down.weight", (h, f), "matrix")]
    plan.append(("output_norm.weight", (h,), "norm"))
    return plan


def tensor_data(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "norm":
        return np.ones(shape, dtype=np.float32)
    if kind == "rope":
        return _llama3_rope_freqs(ROPE, SHAPE["head_dim"])
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= STD
    if kind in ("q", "k"):
        w = _permute(w, SHAPE["heads"] if kind == "q" else SHAPE["kv_heads"])
    return w.astype(np.float16)


def write(out: pathlib.Path, tokenizer_source: pathlib.Path, seed: int = 0) -> pathlib.Path:
    fields = tokenizer_fields(tokenizer_source)
    vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_name("Llama-3.2-1B-shape random (genserve benchmark)")
    w.add_context_length(SHAPE["context"])
    w.add_embedding_length(SHAPE["hidden"])
    w.add_block_count(SHAPE["layers"])
    w.add_feed_forward_length(SHAPE["ffn"])
    w.add_head_count(SHAPE["heads"])
    w.add_head_count_kv(SHAPE["kv_heads"])
    w.add_rope_freq_base(SHAPE["theta"])
    w.add_layer_norm_rms_eps(SHAPE["eps"])
    w.add_key_length(SHAPE["head_dim"])
    w.add_value_length(SHAPE["head_dim"])
    w.add_rope_dimension_count(SHAPE["head_dim"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub)
    plan = tensor_plan(vocab)
    for name, shape, kind in plan:
        dtype = np.float32 if kind in ("norm", "rope") else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for n, (name, shape, kind) in enumerate(plan):
        w.write_tensor_data(tensor_data(shape, kind, rng))
        if kind == "matrix" and name.endswith("ffn_down.weight"):
            print(f"  {name} ({n + 1}/{len(plan)})", flush=True)
    w.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/llama1b/f16.gguf"))
    p.add_argument("--tokenizer-from", type=pathlib.Path, default=None,
                   help="GGUF whose tokenizer.* metadata is copied (default: the embedded SmolLM2)")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    if opts.tokenizer_from is None:
        from engine.gguf_file import default_gguf_path
        opts.tokenizer_from = pathlib.Path(default_gguf_path())
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    write(opts.out, opts.tokenizer_from, opts.seed)
    print(f"wrote {opts.out} ({opts.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
