"""A GGUF's own blocks as a model's matrix products (`--weights q4q8`): which matrices of the file
have a native product (Q4_1: `q4q8_linear`, `engine.model.quant`; Q8_0, and Q5_0 / Q4_0 converted
exactly to Q8_0 at load: `q8q8_linear`; Q4_K and Q6_K: `qk_linear`, `engine.model.kquant`), reading
their raw blocks without dequantizing, ordering them as the model's fused matrices, and attaching
them; matrices of other types keep their dequantized products.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import kernels
from engine.model.kquant import GROUP_N, KIND_NAMES, Q4_1, Q4_K, Q6_K, Q8_0, QK_K, qk_weight
from engine.model.linear import PackedWeight
from engine.model.quant import Q4Q8_PANEL_N, q4q8_pack, q8q8_pack
from engine.model.rope import interleave_rope_rows, unpermute_rope_rows
from engine.model.transformer import Transformer, block_matrices
from engine.gguf_file import open_gguf
from engine.model.weights import _GGUF_LAYER_NAMES

if TYPE_CHECKING:
    import gguf

log = logging.getLogger(__name__)

Q4_0 = 2                    # gguf.GGMLQuantizationType.Q4_0
Q5_0 = 6                    # gguf.GGMLQuantizationType.Q5_0
# types whose blocks are Q8_0 blocks in another form: ggml's block_q4_0 {fp16 d; uint8 qs[16]}
# (18 bytes / 32 weights) and block_q5_0 {fp16 d; uint8 qh[4]; uint8 qs[16]} (22 bytes)
_AS_Q8_0_BYTES = {Q4_0: 18, Q5_0: 22}
# the types `q8q8_linear` serves: Q8_0 as it is, Q4_0 / Q5_0 through `as_q8_0`
_Q8_0_LIKE = (Q8_0, Q4_0, Q5_0)


def as_q8_0(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """A GGUF matrix's Q8_0, Q4_0 or Q5_0 rows as Q8_0 blocks (uint8 [rows, K / 32 · 34], ggml's
    block_q8_0 {fp16 d; int8 q[32]}) holding exactly its weights: the same fp16 d and, per weight,
    Q4_0's q = nibble − 8 or Q5_0's q = (nibble | high bit << 4) − 16, both within int8, so d · q is
    the same product of the same two numbers (bit-identical dequantized floats; ggml's
    `dequantize_row_q4_0` / `_q5_0`: weight j < 16 from the low nibble of qs[j] and bit j of the
    little-endian qh, weight j + 16 from the high nibble and bit j + 16). Q8_0 rows come back as
    they are; the others are converted in whole-tensor torch ops.

    Args:
        blocks: uint8 [rows, K / 32 · (18 for Q4_0, 22 for Q5_0, 34 for Q8_0)] in GGUF row order.
        kind: the GGML type.
    Raises:
        ValueError: another type, or rows that are not whole blocks.
    """
    if kind == Q8_0:
        return blocks
    if kind not in _AS_Q8_0_BYTES:
        raise ValueError(f"as_q8_0: GGML type {_type_name(kind)} is not Q8_0, Q4_0 or Q5_0")
    size = _AS_Q8_0_BYTES[kind]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise ValueError(f"as_q8_0: expected uint8 [rows, K / 32 * {size}] {_type_name(kind)} blocks, "
                         f"got {blocks.dtype} {list(blocks.shape)}")
    rows, nb = blocks.shape[0], blocks.shape[1] // size
    b = blocks.contiguous().view(rows, nb, size)
    nibbles = b[..., size - 16:]                                   # qs: q[j] low, q[j + 16] high
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1)           # [rows, nb, 32] in 0..15
    if kind == Q5_0:
        bit = torch.arange(8, dtype=torch.uint8)
        high = ((b[..., 2:6, None] >> bit) & 1).reshape(rows, nb, 32)   # bit j of qh, LE
        q = (q | (high << 4)).to(torch.int16) - 16
    else:
        q = q.to(torch.int16) - 8
    out = torch.cat([b[..., 0:2], q.to(torch.int8).view(torch.uint8)], dim=-1)
    return out.reshape(rows, nb * 34).contiguous()


def attach_q4q8(model: Transformer, source: str | pathlib.Path | gguf.GGUFReader | None = None
                ) -> None:
    """Serve `model`'s matrix products from the GGUF's own blocks, exact, times inputs rounded to
    8 bits: llama.cpp's arithmetic for the file (`--weights q4q8`).

    Each block matrix whose file tensors are Q4_1 runs `torch.ops.genserve.q4q8_linear` over them
    (`PackedWeight.q4q8`: each input rounded per row and block of 32, ggml's Q4_1 x Q8_1); one
    whose tensors are Q4_K or Q6_K (a Q4_K_M file's; a fused matrix may mix the two) runs
    `torch.ops.genserve.qk_linear` (`PackedWeight.qk`: each input rounded per row and block of
    256, ggml's Q4_K / Q6_K x Q8_K, `engine.model.kquant`); one whose tensors are Q8_0, Q5_0 or
    Q4_0 (a fused one may mix them) runs `torch.ops.genserve.q8q8_linear` (`PackedWeight.q8q8`,
    ggml's Q8_0 x Q8_0; Q5_0 and Q4_0 blocks converted exactly to Q8_0 at load, `as_q8_0`); any
    other type keeps its bf16 product (`attach_gguf_blocks` decides and logs which). Where the file
    stores the output projection as Q8_0 (the embedded one does), Q5_0 or Q4_0, that product runs
    `q8q8_linear` over those blocks (`PackedWeight.q8q8`: llama.cpp's Q8_0 x Q8_0); as Q4_K or
    Q6_K, `qk_linear`. The C++
    decode loop runs the same products where every block matrix has one
    (`engine.runner.decode_loop.DecodeLoop.from_model` passes the blocks on). It reads about a
    quarter of the bf16 matrix's bytes, which is what a one-row step waits for, and its int8 sums
    outrun the bf16 product at 32 rows on AVX512-VNNI as on AVX2 (docs/benchmarks/linear.md,
    docs/benchmarks/kquant.md).

    Args:
        model: a bf16 CPU model built from `source` (packed or not).
        source: the `.gguf` file, a reader, or None for the embedded model.
    Raises:
        ValueError: the model is not bf16 on the CPU, genserve's kernels are not built, the file
            has Q4_1 matrices and `q4q8_linear` cannot run here (neither AVX512-VNNI nor AVX2),
            no block matrix of the file is Q4_1, Q8_0 / Q5_0 / Q4_0, Q4_K or Q6_K (K a multiple of
            256), or a
            block matrix of the file has another row count than the model's.
    """

    if model.dtype != torch.bfloat16 or model.output.device.type != "cpu":
        raise ValueError(f"weights 'q4q8' needs a bfloat16 model on the CPU, got {model.dtype} on "
                         f"{model.output.device.type}")
    if not kernels.available():
        raise ValueError("weights 'q4q8' needs genserve's kernels (g++)")
    import gguf

    reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    try:
        counts = attach_gguf_blocks(model, reader)
    except ValueError as exc:
        raise ValueError(f"weights 'q4q8': {exc}") from None
    if not counts["q4q8"] and not counts["qk"] and not counts["q8q8"]:
        raise ValueError("weights 'q4q8': no block matrix of the file is Q4_1, Q8_0 / Q5_0 / Q4_0, or Q4_K / Q6_K "
                         "with an input size that is a multiple of 256")



# A mixture-of-experts layer's stacked GGUF tensors -> each expert's matrix (its dense
# ffn_gate / ffn_up / ffn_down are absent).
_STACKED_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")


def _raw_rows(t: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor's rows as raw blocks: uint8 [rows, bytes per row] (a copy; a stacked
    [experts, out, in] tensor's rows expert by expert) for the types a native product takes
    (Q4_1, Q4_K, Q6_K, Q8_0, Q5_0, Q4_0; as the file holds them), uint8 [rows, 0] for any other
    (its rows counted, its bytes not read)."""
    rows = int(np.prod([int(d) for d in t.shape[1:]]))
    if int(t.tensor_type) in (Q4_1, Q4_K, Q6_K, *_Q8_0_LIKE):
        return torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True)).reshape(rows, -1)
    return torch.empty(rows, 0, dtype=torch.uint8)


def gguf_layer_blocks(reader: gguf.GGUFReader, layer_names: dict[str, str] | None = None,
                      unpermute_qk: bool | None = None) -> dict[str, tuple[int, torch.Tensor]]:
    """Every block matrix of a GGUF as (GGML type, raw blocks) under our names
    (`engine.model.weights` table: ``layers.{i}.attention.wq.weight`` ...), read from `reader`'s
    tensors without dequantizing: uint8 [out, bytes per row] (a copy) for the types a native
    product takes (Q4_1, Q4_K, Q6_K, Q8_0, Q5_0, Q4_0), uint8 [out, 0] for any other (its rows
    counted, its bytes not read). Q and K rows of a llama-architecture file are un-permuted
    (`engine.model.rope.unpermute_rope_rows`, whole rows, so exact on blocks). A
    mixture-of-experts layer (one with `ffn_gate_inp`) gives each expert's matrices
    (``layers.{i}.feed_forward.experts.{e}.w1.weight`` ...) from the stacked `ffn_*_exps`.

    Args:
        reader: the open file; layer_names: GGUF leaf → our leaf (default:
            `engine.model.weights._GGUF_LAYER_NAMES`); unpermute_qk: whether the file's Q/K
            rows are in llama.cpp's permuted order (None: where `general.architecture` is
            "llama", whose converter permutes them).
    Raises:
        ValueError: a block matrix is missing from the file (phi3 files fuse Q|K|V).
    """

    layer_names = _GGUF_LAYER_NAMES if layer_names is None else layer_names
    fields = reader.fields

    def field(key: str, default=None):
        return fields[key].contents() if key in fields else default

    arch = field("general.architecture", "llama")
    if unpermute_qk is None:
        unpermute_qk = arch == "llama"
    n_layers = int(field(f"{arch}.block_count"))
    n_heads = int(field(f"{arch}.attention.head_count"))
    n_kv_heads = int(field(f"{arch}.attention.head_count_kv", n_heads))
    tensors = {t.name: t for t in reader.tensors}
    out: dict[str, tuple[int, torch.Tensor]] = {}
    for i in range(n_layers):
        sparse = f"blk.{i}.ffn_gate_inp.weight" in tensors        # a mixture-of-experts layer
        for leaf, ours in layer_names.items():
            if ours.endswith("norm") or (sparse and leaf in _DENSE_MLP):
                continue
            name = f"blk.{i}.{leaf}.weight"
            if name not in tensors:
                raise ValueError(f"tensor {name!r} missing (a fused file, e.g. phi3's attn_qkv, keeps "
                             "its dequantized products)")
            t = tensors[name]
            w = _raw_rows(t)
            if unpermute_qk and leaf in ("attn_q", "attn_k"):
                w = unpermute_rope_rows(w, n_heads if leaf == "attn_q" else n_kv_heads)
            out[f"layers.{i}.{ours}.weight"] = (int(t.tensor_type), w)
        if sparse:
            for leaf, ours in _STACKED_EXPERTS.items():
                name = f"blk.{i}.{leaf}.weight"
                if name not in tensors:
                    raise ValueError(f"tensor {name!r} missing")
                t = tensors[name]
                n_experts = int(t.shape[-1]) if len(t.shape) == 3 else 0
                if not n_experts:
                    raise ValueError(f"tensor {name!r} is not [experts, out, in]")
                rows = _raw_rows(t)
                for e, w in enumerate(rows.reshape(n_experts, -1, rows.shape[-1]).unbind(0)):
                    out[f"layers.{i}.feed_forward.experts.{e}.{ours}.weight"] = (int(t.tensor_type), w)
    return out


def _fused_parts(blocks: dict[str, tuple[int, torch.Tensor]], model: Transformer
                 ) -> list[tuple[object, str, list[tuple[int, torch.Tensor]]]]:
    """(module, attribute, [(type, raw blocks)] row parts in the fused matrix's order) of every
    block matrix (`engine.model.transformer.block_matrices` order), the Q and K rows moved to
    interleaved-RoPE order as `fused_block_matrices` moves them."""

    args = model.args
    rot = args.rotary_dim
    prefixes: dict[int, str] = {}          # id(module) -> its names' prefix
    for i, layer in enumerate(model.layers):
        prefixes[id(layer.attention)] = f"layers.{i}.attention."
        prefixes[id(layer.feed_forward)] = f"layers.{i}.feed_forward."
        for e, expert in enumerate(getattr(layer.feed_forward, "experts", ())):
            prefixes[id(expert)] = f"layers.{i}.feed_forward.experts.{e}."
    out = []
    for module, name in block_matrices(model):
        p = prefixes[id(module)]
        if name == "wqkv":
            q, k, v = (blocks[p + f"w{c}.weight"] for c in "qkv")
            parts = [(q[0], interleave_rope_rows(q[1], args.n_heads, rot)),
                     (k[0], interleave_rope_rows(k[1], args.n_kv_heads, rot)), v]
        elif name == "wo":
            parts = [blocks[p + "wo.weight"]]
        elif name == "w13":
            parts = [blocks[p + "w1.weight"], blocks[p + "w3.weight"]]
        else:
            parts = [blocks[p + "w2.weight"]]
        out.append((module, name, parts))
    return out


def native_product(parts: list[tuple[int, torch.Tensor]], in_features: int) -> str | None:
    """Which native product serves a matrix of these row parts (GGML type, raw blocks): "q4q8"
    (every part Q4_1, `q4q8_linear`), "q8q8" (every part Q8_0, Q5_0 or Q4_0, the latter two
    converted exactly to Q8_0 by `as_q8_0`; `q8q8_linear`), "qk" (every part Q4_K or Q6_K, K a
    multiple of 256 and every part's rows a multiple of 16, `qk_linear`), or None (it keeps its
    bf16 product)."""
    kinds = {kind for kind, _ in parts}
    if kinds == {Q4_1}:
        return "q4q8"
    if kinds <= set(_Q8_0_LIKE):
        return "q8q8"
    if kinds <= {Q4_K, Q6_K} and in_features % QK_K == 0 and \
            all(b.shape[0] % GROUP_N == 0 for _, b in parts):
        return "qk"
    return None


def attach_gguf_blocks(model: Transformer, reader: gguf.GGUFReader,
                       layer_names: dict[str, str] | None = None,
                       unpermute_qk: bool | None = None) -> dict[str, int]:
    """Serve each of `model`'s block matrices from the GGUF's own blocks where a native product
    takes them, llama.cpp's arithmetic: Q4_1 matrices on `q4q8_linear` (`PackedWeight.q4q8`,
    `engine.model.quant.q4q8_pack`), Q8_0 matrices on `q8q8_linear` (`PackedWeight.q8q8`, ggml's
    Q8_0 x Q8_0), and so Q5_0 and
    Q4_0 ones (a fused one may mix the three), their blocks converted exactly to Q8_0 at load
    (`as_q8_0`: same d, q − 16 or q − 8; llama.cpp runs them as Q5_0 / Q4_0 x Q8_0, the same
    products of the same integers), Q4_K / Q6_K matrices (a fused one may mix the two) on
    `qk_linear` (`PackedWeight.qk`); any other type (Q5_1, F16 ...), another mix of types, or a
    K-quant matrix whose input is not a multiple of 256 keeps its bf16 product; so does a Q4_1
    or Q8_0-like matrix whose rows are not a multiple of 32. The output projection
    (`output.weight`, or a tied model's `token_embd.weight`) likewise: Q8_0, Q5_0 or Q4_0 on
    `q8q8_linear`, Q4_K / Q6_K on `qk_linear`. A model runner made afterwards reads the blocks
    into its C++ decode loop where every block matrix has them (`engine.runner.decode_loop`).

    Args:
        model: a bf16 CPU model built from this file (packed or not).
        reader: the open GGUF; layer_names, unpermute_qk: as `gguf_layer_blocks`.
    Returns:
        {"q4q8": matrices, "q8q8": matrices, "qk": matrices, "bf16": matrices} (block matrices
        only), also logged (with how many of the q8q8 ones hold converted Q5_0 / Q4_0 blocks).
    Raises:
        ValueError: a matrix's rows in the file are not the model's, or a native product is due
            and this build cannot run it (q4q8_linear needs AVX512-VNNI or AVX2).
        ValueError: a block matrix is missing from the file (phi3 files fuse Q|K|V).
    """

    counts = {"q4q8": 0, "q8q8": 0, "qk": 0, "bf16": 0}
    converted: dict[str, int] = {}         # q8q8 matrices with Q5_0 / Q4_0 parts: their types -> count
    left: dict[str, int] = {}
    plan = []
    for module, name, parts in _fused_parts(gguf_layer_blocks(reader, layer_names, unpermute_qk), model):
        weight = getattr(module, name)
        rows = sum(b.shape[0] for _, b in parts)
        if rows != weight.shape[0]:
            raise ValueError(f"{name}: {rows} rows of blocks in the file, the model {weight.shape[0]}")
        product = native_product(parts, weight.shape[1])
        if product in ("q4q8", "q8q8") and weight.shape[0] % Q4Q8_PANEL_N:
            product = None
        counts[product or "bf16"] += 1
        if product == "q8q8" and any(kind != Q8_0 for kind, _ in parts):
            key = "+".join(sorted({_type_name(kind) for kind, _ in parts}))
            converted[key] = converted.get(key, 0) + 1
        if product is None:          # the bf16 product stays, and so does its PackedWeight
            key = f"{name} " + "+".join(sorted({_type_name(kind) for kind, _ in parts}))
            left[key] = left.get(key, 0) + 1
        else:
            plan.append((module, name, parts, product))
    if (counts["q4q8"] or counts["q8q8"]) and not kernels.q4q8_linear_available():
        raise ValueError("the file's Q4_1 / Q8_0 / Q5_0 / Q4_0 blocks need genserve's q4q8_linear kernels "
                         "(AVX512-VNNI or AVX2, and g++)")
    for module, name, parts, product in plan:
        packed = getattr(module, name + "_packed") or PackedWeight(getattr(module, name), 0)
        if product == "q4q8":
            packed = dataclasses.replace(packed, q4q8=q4q8_pack(torch.cat([b for _, b in parts])))
        elif product == "q8q8":
            packed = dataclasses.replace(packed, q8q8=q8q8_pack(torch.cat([as_q8_0(b, kind)
                                                                           for kind, b in parts])))
        else:
            packed = dataclasses.replace(packed, qk=qk_weight(parts))
        setattr(module, name + "_packed", packed)
    output = _output_blocks(reader)
    out_kind = "unchanged (bf16)"
    if output is not None and output[1].shape[0] == model.output.shape[0]:
        kind, blocks = output
        packed = model.output_packed or PackedWeight(model.output, 0)
        if kind in _Q8_0_LIKE and blocks.shape[0] % Q4Q8_PANEL_N == 0 and kernels.q4q8_linear_available():
            model.output_packed = dataclasses.replace(packed, q8q8=q8q8_pack(as_q8_0(blocks, kind)))
            out_kind = "Q8_0 x Q8_0 (q8q8_linear)" if kind == Q8_0 else \
                f"{_type_name(kind)} as Q8_0 x Q8_0 (q8q8_linear)"
        elif native_product([output], model.output.shape[1]) == "qk":
            model.output_packed = dataclasses.replace(packed, qk=qk_weight([output]))
            out_kind = f"{KIND_NAMES[kind]} x Q8_K (qk_linear)"
    log.info("GGUF blocks served natively: %d block matrices Q4_1 x Q8_1 (q4q8_linear), %d Q8_0 x "
             "Q8_0 (q8q8_linear%s), %d Q4_K/Q6_K x Q8_K (qk_linear), %d in bf16%s; output projection %s",
             counts["q4q8"], counts["q8q8"],
             f"; converted to Q8_0: {', '.join(f'{v}x {k}' for k, v in sorted(converted.items()))}"
             if converted else "", counts["qk"],
             counts["bf16"], f" ({', '.join(f'{v}x {k}' for k, v in sorted(left.items()))})" if left else "",
             out_kind)
    return counts


def _type_name(kind: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(kind).name
    except ValueError:
        return str(kind)


def _output_blocks(reader: gguf.GGUFReader) -> tuple[int, torch.Tensor] | None:
    """(type, raw blocks uint8 [vocab, bytes]) of the output projection (`output.weight`, else
    the tied `token_embd.weight`) where it is Q8_0, Q5_0, Q4_0, Q4_K or Q6_K; None otherwise."""
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if t is None or int(t.tensor_type) not in (*_Q8_0_LIKE, Q4_K, Q6_K):
        return None
    return int(t.tensor_type), torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
