"""Serving the GGUF's 4-bit weights as they are (`EngineConfig.weights` "q4").

The embedded SmolLM2 GGUF stores every block matrix in Q4_1 blocks (32 weights along the input
dimension: fp16 scale d, fp16 min m, 4-bit q; weight = d · q + m). The bf16 engine dequantizes them
at load (`weights.load_gguf`) and reads 2 bytes per weight in every decode step; here the blocks
stay as they are, 20 bytes per 32 weights, and genserve's kernels (engine/kernels/csrc/q4_linear.cpp,
engine/kernels/csrc/amx_linear.cpp) decode them in registers to the very bf16 values the bf16 engine holds and sum them exactly as
the bf16 engine's product does: the same bits, 3.2× fewer weight bytes per product.

`attach_q4` gives each block matrix's `PackedWeight` its blocks (`q4_pack`'s layout for
`q4_linear`, `amx_pack`'s for `q4_amx_linear`) and the product they reproduce:

* where the model packed with oneDNN's copies and a k chunk (`packed_linear` up to
  `PACKED_LINEAR_MAX_ROWS` rows, oneDNN's same bits above), `q4_linear` replaces `packed_linear`
  below the limit and oneDNN still runs above: the bf16 engine's bits at every row count;
* where the model runs genserve's own layout (`packed_linear` on every product), `q4_linear` runs
  every product: again the bf16 engine's bits;
* where the model runs oneDNN in fixed-size calls (a CPU whose oneDNN rounds rows by the row
  count; seen with AMX, where oneDNN's bf16 kernel is AMX's), `q4_amx_linear` runs every
  product where a load check finds it gives oneDNN's bits (one AMX TDPBF16PS chain over k,
  `amx_matches_onednn`): the bf16 engine's bits, now at any row count;
* otherwise (no AMX, or the check fails) `q4_linear` runs every product with one chain over k,
  which gives the bits of the own-layout bf16 engine (`linear.vnni_pack`): batch-invariant, but
  not the bits of that CPU's bf16 default, which `attach_q4` then logs.

The output projection (Q8_0 in the embedded file, tied to the embedding) reads its Q8_0 blocks
with `q8_amx_linear` where `q4_amx_linear` runs the block matrices (the same AMX summation,
checked the same way); elsewhere it keeps its bf16 path.
Memory: the blocks are 0.31× the bf16 matrices (66 MB for SmolLM2-135M's block matrices; the
output's Q8_0 blocks 0.53×, 30 MB) and come on top of them; the bf16 copies stay for the oneDNN
products above the row limit and for the checks.

`q4q8_pack`, `q8_1_round`, `q4_1_dequantize` and `q4q8_linear_reference` serve
`torch.ops.genserve.q4q8_linear` (engine/kernels/csrc/q4q8_linear.cpp: the same Q4_1 blocks times
activations rounded to int8 per block of 32, llama.cpp's arithmetic, on AVX512-VNNI or AVX2),
which `attach_q4q8` gives the model; it also gives the output projection its Q8_0 blocks for
`torch.ops.genserve.q8q8_linear` (`q8q8_pack`, the same file: llama.cpp's Q8_0 × Q8_0), and the
file's Q4_K / Q6_K matrices (a Q4_K_M file's) to `torch.ops.genserve.qk_linear`
(`engine.model.kquant`: llama.cpp's Q4_K / Q6_K × Q8_K), so `--weights q4q8` is llama.cpp's
arithmetic for every product it serves (a matrix of another type keeps its bf16 product).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine import kernels
from engine.model.transformer import Transformer, block_matrices, fused_block_matrices
from engine.model.linear import ANY_ROWS, PACKED_LINEAR_MAX_ROWS, PackedWeight, onednn_tiled, vnni_pack
from engine.model.weights import (Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, load_gguf_output_q8_0,
                                  load_gguf_q4_1)

if TYPE_CHECKING:
    import gguf

log = logging.getLogger(__name__)

BLOCK_N = 64        # output columns per block of `q4_linear`'s layout
QK = 32             # weights per Q4_1 block


def _check_blocks(name: str, blocks: torch.Tensor, block_bytes: int,
                  multiple: int = BLOCK_N) -> None:
    """Raises ValueError (naming `name`) unless `blocks` is uint8 [N, K / 32 · `block_bytes`]
    with K a positive multiple of 32 and N a positive multiple of `multiple`."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % block_bytes \
            or blocks.shape[1] == 0:
        raise ValueError(f"{name}: expected uint8 [N, K / 32 * {block_bytes}] blocks, got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
    if blocks.shape[0] == 0 or blocks.shape[0] % multiple:
        raise ValueError(f"{name}: N must be a positive multiple of {multiple}, got {blocks.shape[0]}")


def q4_pack(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks in GGUF row order re-interleaved into `q4_linear`'s layout.

    The input holds, per weight row, its Q4_1 blocks along k (bytes 0-1 fp16 d, 2-3 fp16 m,
    4-19: byte i has q[i] in its low nibble and q[i + 16] in its high one; ggml's block_q4_1).
    The output holds the same d, m and q, per 64 output columns and 32 k: the 4 groups' d[16] and
    m[16] (256 bytes), then for each of the 16 k pairs j and each group of 16 columns 16 bytes whose
    byte t has q[column t / 2][k 2j + t % 2] in its low nibble and q[column 8 + t / 2][same k] in
    its high one (engine/kernels/csrc/q4_linear.cpp says why).

    Args:
        blocks: uint8 [N, K / 32 · 20] (`weights.load_gguf_q4_1`).
    Returns:
        uint8 [N, K / 32 · 20], the same bytes re-ordered (a new tensor).
    Raises:
        ValueError: not uint8 2-D with whole blocks, or N not a multiple of 64.
    """
    _check_blocks("q4_pack", blocks, Q4_1_BLOCK_BYTES)
    n, row_bytes = blocks.shape
    nb, kb = n // BLOCK_N, row_bytes // Q4_1_BLOCK_BYTES
    b = blocks.view(nb, 4, 16, kb, Q4_1_BLOCK_BYTES)                  # [nb, group, col, kb, 20]
    scales = b[..., :4].reshape(nb, 4, 16, kb, 2, 2)                  # [.., {d, m}, 2 bytes]
    scales = scales.permute(0, 3, 1, 4, 2, 5).reshape(nb, kb, 4 * 2 * 16 * 2)
    qs = b[..., 4:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1)                        # [nb, g, col, kb, 32 k]
    q = q.view(nb, 4, 2, 8, kb, 16, 2)                                # col = (half, c); k = (j, p)
    q = q.permute(0, 4, 5, 1, 3, 6, 2)                                # [nb, kb, j, g, c, p, half]
    nibbles = (q[..., 0] | (q[..., 1] << 4)).reshape(nb, kb, 16 * 4 * 16)
    return torch.cat([scales, nibbles], dim=-1).reshape(n, row_bytes).contiguous()


Q4Q8_PANEL_N = 32   # output columns per parallel panel of `q4q8_linear` (N must be a multiple)
Q4Q8_BLOCK_BYTES = 20   # bytes per output column and 32 k in `q4q8_pack`'s layout


def q4q8_pack(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks in GGUF row order re-grouped into `q4q8_linear`'s layout
    (engine/kernels/csrc/q4q8_linear.cpp: Q4_1 weights × activations rounded to int8 per block
    of 32, on AVX512-VNNI or AVX2).

    The input holds, per weight row, its Q4_1 blocks along k (bytes 0-1 fp16 d, 2-3 fp16 m,
    4-19: byte i has q[i] in its low nibble and q[i + 16] in its high one; ggml's block_q4_1).
    The output holds, per group of 16 output columns and block of 32 k (320 bytes): the 16
    columns' d as fp16 (32 bytes, the file's), their m as fp16 (32 bytes), then for j = 0..3
    and each column c 4 bytes: bytes 4j .. 4j + 3 of that column's block nibbles, so byte i of
    (j, c) holds q[c][4j + i] (low nibble) and q[c][16 + 4j + i] (high nibble). Groups are in
    column order, blocks in k order within a group.

    Args:
        blocks: uint8 [N, K / 32 · 20] (`weights.load_gguf_q4_1`), N a multiple of 32.
    Returns:
        uint8 [N, K / 32 · 20], contiguous (a new tensor); row g·16 .. g·16 + 15 hold group g.
    Raises:
        ValueError: not uint8 2-D with whole blocks, or N not a positive multiple of 32.
    """
    _check_blocks("q4q8_pack", blocks, Q4_1_BLOCK_BYTES, Q4Q8_PANEL_N)
    n, row_bytes = blocks.shape
    ng, kb = n // 16, row_bytes // Q4_1_BLOCK_BYTES
    b = blocks.contiguous().view(ng, 16, kb, Q4_1_BLOCK_BYTES)       # [group, col, kb, 20]
    d = b[..., 0:2].permute(0, 2, 1, 3).reshape(ng, kb, 32)           # [group, kb, 16 fp16]
    m = b[..., 2:4].permute(0, 2, 1, 3).reshape(ng, kb, 32)
    nib = b[..., 4:].reshape(ng, 16, kb, 4, 4).permute(0, 2, 3, 1, 4)   # [group, kb, j, col, i]
    out = torch.cat([d, m, nib.reshape(ng, kb, 256)], dim=-1)          # [group, kb, 320]
    return out.reshape(n, kb * Q4Q8_BLOCK_BYTES).contiguous()


Q8Q8_BLOCK_BYTES = Q8_0_BLOCK_BYTES   # bytes per output column and 32 k in `q8q8_pack`'s layout: the file's


def q8q8_pack(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks in GGUF row order re-grouped into `q8q8_linear`'s layout
    (engine/kernels/csrc/q4q8_linear.cpp: Q8_0 weights × activations rounded to int8 per block
    of 32, llama.cpp's Q8_0 × Q8_0 product).

    The input holds, per weight row, its Q8_0 blocks along k (bytes 0-1 fp16 d, 2-33 the int8
    q[0..31]; ggml's block_q8_0). The output holds, per group of 16 output columns and block of
    32 k (544 bytes, what the file holds for them): the 16 columns' d as the file's fp16 (32
    bytes; the kernel widens them exactly), then for j = 0..7 and each column c the 4 bytes
    q[c][4j .. 4j + 3]. Groups are in column order, blocks in k order within a group.

    Args:
        blocks: uint8 [N, K / 32 · 34] (`weights.load_gguf_output_q8_0`), N a multiple of 32.
    Returns:
        uint8 [N, K / 32 · 34], contiguous (a new tensor); row g·16 .. g·16 + 15 hold group g.
    Raises:
        ValueError: not uint8 2-D with whole blocks, or N not a positive multiple of 32.
    """
    _check_blocks("q8q8_pack", blocks, Q8_0_BLOCK_BYTES, Q4Q8_PANEL_N)
    n, row_bytes = blocks.shape
    ng, kb = n // 16, row_bytes // Q8_0_BLOCK_BYTES
    b = blocks.contiguous().view(ng, 16, kb, Q8_0_BLOCK_BYTES)       # [group, col, kb, 34]
    d = b[..., 0:2].permute(0, 2, 1, 3).reshape(ng, kb, 32)           # [group, kb, 16 * 2] fp16 bytes
    q = b[..., 2:].reshape(ng, 16, kb, 8, 4).permute(0, 2, 3, 1, 4)   # [group, kb, j, col, i]
    out = torch.cat([d, q.reshape(ng, kb, 512)], dim=-1)               # [group, kb, 544]
    return out.reshape(n, kb * Q8Q8_BLOCK_BYTES).contiguous()


def q8_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks uint8 [N, K / 32 · 34] (GGUF row order) as fp64 [N, K]: d · q, exact."""
    n, row_bytes = blocks.shape
    kb = row_bytes // Q8_0_BLOCK_BYTES
    b = blocks.contiguous().view(n, kb, Q8_0_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).double()        # [N, kb, 1]
    q = b[..., 2:].contiguous().view(torch.int8).double()            # [N, kb, 32]
    return (d * q).reshape(n, kb * QK)


def q8_1_round(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows rounded per block of 32 as `q4q8_linear` rounds them (ggml's Q8_1), in torch ops:
    scale = fp32(amax · fp32(1/127)) (1 where 0), q = round_half_even(fp32(x · fp32(1 / scale))).

    Args:
        x: [M, K] (any float dtype; taken as fp32), K a multiple of 32.
    Returns:
        (q, scale): q fp32 [M, K] of integers in -127..127, scale fp32 [M, K / 32].
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    inv_qmax = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(127.0, dtype=torch.float32)
    scale = xb.abs().amax(dim=-1) * inv_qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    inv = torch.ones_like(scale) / scale
    q = torch.round(xb * inv[..., None])
    return q.reshape(m, k), scale


def q4_1_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks uint8 [N, K / 32 · 20] (GGUF row order) as fp64 [N, K]: d · q + m, exact."""
    n, row_bytes = blocks.shape
    kb = row_bytes // Q4_1_BLOCK_BYTES
    b = blocks.contiguous().view(n, kb, Q4_1_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).double()        # [N, kb, 1]
    mn = b[..., 2:4].contiguous().view(torch.float16).double()
    qs = b[..., 4:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).double()               # [N, kb, 32]
    return (d * q + mn).reshape(n, kb * QK)


def q4q8_linear_reference(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """What `q4q8_linear` computes, in torch ops, for tests: the Q4_1 blocks dequantized exactly
    (d · q + m in fp64), x rounded by `q8_1_round`, the product in fp64.

    Args:
        x: [M, K]; blocks: uint8 [N, K / 32 · 20] in GGUF row order.
    Returns:
        fp64 [M, N] (not rounded to bf16).
    """
    kb = blocks.shape[1] // Q4_1_BLOCK_BYTES
    w = q4_1_dequantize(blocks)
    xq, scale = q8_1_round(x)
    xd = (xq.double().reshape(x.shape[0], kb, QK) * scale.double()[..., None]).reshape(x.shape[0], -1)
    return xd @ w.T


def q8q8_linear_reference(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """What `q8q8_linear` computes, in torch ops, for tests: the Q8_0 blocks dequantized exactly
    (d · q in fp64), x rounded by `q8_1_round`, the product in fp64.

    Args:
        x: [M, K]; blocks: uint8 [N, K / 32 · 34] in GGUF row order.
    Returns:
        fp64 [M, N] (not rounded to bf16).
    """
    kb = blocks.shape[1] // Q8_0_BLOCK_BYTES
    xq, scale = q8_1_round(x)
    xd = (xq.double().reshape(x.shape[0], kb, QK) * scale.double()[..., None]).reshape(x.shape[0], -1)
    return xd @ q8_0_dequantize(blocks).T


def amx_pack(blocks: torch.Tensor, block_bytes: int = Q4_1_BLOCK_BYTES) -> torch.Tensor:
    """Quantized blocks in GGUF row order re-grouped into `q4_amx_linear`'s (Q4_1) or
    `q8_amx_linear`'s (Q8_0) layout (engine/kernels/csrc/amx_linear.cpp).

    The input holds, per weight row, its blocks along k in the file's format: Q4_1 (20 bytes:
    fp16 d, fp16 m, 16 bytes whose byte i holds q[i] and q[i + 16]) or Q8_0 (34 bytes: fp16 d,
    32 int8). The output holds the same values per 64 output columns and 32 k, as 4 groups of 16
    columns: the group's 16 d (and for Q4_1 its 16 m) side by side, then each column's quants:
    Q8_0's as in the file, Q4_1's nibbles re-paired so that byte 2j holds q[j] (low nibble) and
    q[8 + j], byte 2j + 1 q[16 + j] and q[24 + j] (the kernel's table lookup reads them so).

    Args:
        blocks: uint8 [N, K / 32 · block_bytes]; block_bytes: `Q4_1_BLOCK_BYTES` or
            `Q8_0_BLOCK_BYTES`.
    Returns:
        uint8 [N, K / 32 · block_bytes], the same bytes re-ordered (a new tensor).
    Raises:
        ValueError: another block size, not uint8 2-D with whole blocks, or N not a multiple
            of 64.
    """
    scale_bytes = {Q4_1_BLOCK_BYTES: 4, Q8_0_BLOCK_BYTES: 2}.get(block_bytes)
    if scale_bytes is None:
        raise ValueError(f"amx_pack: blocks of {block_bytes} bytes are neither Q4_1 "
                         f"({Q4_1_BLOCK_BYTES}) nor Q8_0 ({Q8_0_BLOCK_BYTES})")
    _check_blocks("amx_pack", blocks, block_bytes)
    n, row_bytes = blocks.shape
    nb, kb = n // BLOCK_N, row_bytes // block_bytes
    b = blocks.view(nb, 4, 16, kb, block_bytes).permute(0, 3, 1, 2, 4)  # [nb, kb, group, col, ..]
    parts = [b[..., i:i + 2].reshape(nb, kb, 4, 32) for i in range(0, scale_bytes, 2)]
    quants = b[..., scale_bytes:]
    if block_bytes == Q4_1_BLOCK_BYTES:         # byte 2j: q[j], q[8 + j]; 2j + 1: q[16 + j], q[24 + j]
        q = torch.cat([quants & 0xF, quants >> 4], dim=-1).view(nb, kb, 4, 16, 4, 8)  # [.., L, j]
        quants = torch.stack([q[..., 0, :] | (q[..., 1, :] << 4),
                              q[..., 2, :] | (q[..., 3, :] << 4)], dim=-1)          # [.., j, 2]
    parts.append(quants.reshape(nb, kb, 4, 16 * (block_bytes - scale_bytes)))
    return torch.cat(parts, dim=-1).reshape(n, row_bytes).contiguous()


def amx_matches_onednn(weight: torch.Tensor, packed: PackedWeight, blocks: torch.Tensor,
                       op: str = "q4_amx_linear") -> bool:
    """Whether `op` (`q4_amx_linear`, or `q8_amx_linear` for Q8_0 blocks) over `blocks`
    (`amx_pack`'s layout) gives the bits of `packed`'s oneDNN calls of
    `packed.tile_rows` rows over `weight` (the blocks' bf16 values), on ≥ 2^20 random outputs
    and on one row alone. oneDNN's AMX summation order is not documented behaviour, so it is
    checked, as `linear.onednn_k_chunk` checks oneDNN's chunk; a different order rounds about
    1 output in 10^4 differently, which a probe this size sees."""
    n, k = weight.shape
    rows = min(4096, max(64, -(-(1 << 20) // n)))
    probe = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = onednn_tiled(probe, packed.tensor, packed.tile_rows)
    product = getattr(torch.ops.genserve, op)
    return (torch.equal(product(probe, blocks), want) and
            torch.equal(product(probe[:1].clone(), blocks), want[:1]))


def q4_weight(packed: PackedWeight, weight: torch.Tensor, blocks: torch.Tensor,
              amx_checked: dict[tuple[int, int], bool] | None = None) -> PackedWeight:
    """`packed` (a bf16 matrix's `PackedWeight`) with the matrix's 4-bit blocks attached (of
    `weight`'s values; `blocks` in the file's format) and the product they reproduce (module
    docstring): `packed_linear`'s with oneDNN's chunk and row limit (`q4_pack`'s layout);
    oneDNN's AMX product on every row count (k chunk 0: `q4_amx_linear`, `amx_pack`'s layout);
    else one chain over k on every product (`q4_pack`'s layout). `amx_checked` (shape →
    `amx_matches_onednn`) saves the check for shapes already checked."""
    k = blocks.shape[1] // Q4_1_BLOCK_BYTES * QK
    if packed.k_chunk and not packed.tile_rows and packed.k_chunk % QK == 0:
        return PackedWeight(packed.tensor, packed.k_chunk, packed.max_rows, 0, q4_pack(blocks))
    if packed.tile_rows and kernels.q4_amx_available():
        checked = {} if amx_checked is None else amx_checked
        shape = (weight.shape[0], weight.shape[1])
        grouped = amx_pack(blocks)
        if shape not in checked:
            checked[shape] = amx_matches_onednn(weight, packed, grouped)
        if checked[shape]:
            return PackedWeight(packed.tensor, 0, ANY_ROWS, packed.tile_rows, grouped)
    return PackedWeight(packed.tensor, k, ANY_ROWS, packed.tile_rows, q4_pack(blocks))


def bf16_twin(packed: PackedWeight, weight: torch.Tensor) -> PackedWeight:
    """The bf16 `PackedWeight` of `weight` whose products `packed` (a `q4_weight`) reproduces bit
    for bit: oneDNN's fixed-size calls where `packed` runs `q4_amx_linear`; `packed_linear` with
    the same k chunk and row limit over oneDNN's copy where `packed` keeps oneDNN's chunk, else
    over `linear.vnni_pack(weight)` (genserve's own layout). For comparing the two (tests,
    benchmarks.q4); raises ValueError unless `packed` has blocks."""
    if packed.q4 is None:
        raise ValueError("bf16_twin: the PackedWeight has no 4-bit blocks")
    if not packed.k_chunk:
        return PackedWeight(packed.tensor, 0, PACKED_LINEAR_MAX_ROWS, packed.tile_rows)
    if packed.max_rows != ANY_ROWS:
        return PackedWeight(packed.tensor, packed.k_chunk, packed.max_rows)
    return PackedWeight(vnni_pack(weight), packed.k_chunk, ANY_ROWS)


def q4_1_block_matrices(model: Transformer, source: str | pathlib.Path | gguf.GGUFReader | None,
                        mode: str) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, attribute name, Q4_1 blocks uint8 [out, in / 32 · 20]) of every block matrix of
    `model` (`engine.model.transformer.block_matrices` order), the blocks read from the GGUF `source`
    (None: the embedded model) and fused as the model fuses its matrices.

    Raises:
        ValueError: a block matrix of the file is not Q4_1, or its row count is not the model's
            (the message names `mode`, the weights mode asking).
    """
    args = model.args
    fused = fused_block_matrices(load_gguf_q4_1(source), args)
    per_layer = len(block_matrices(model)) // args.n_layers
    out = []
    for j, (module, name) in enumerate(block_matrices(model)):
        owner = "attention" if name in ("wqkv", "wo") else "feed_forward"
        blocks = fused[f"layers.{j // per_layer}.{owner}.{name}"]
        if blocks.shape[0] != getattr(module, name).shape[0]:
            raise ValueError(f"weights '{mode}': layer {j // per_layer} {name} has {blocks.shape[0]} "
                             f"rows of blocks, the model {getattr(module, name).shape[0]}")
        out.append((module, name, blocks))
    return out


def attach_q4(model: Transformer, source: str | pathlib.Path | gguf.GGUFReader | None = None
              ) -> None:
    """Serve `model`'s block matrices from the 4-bit blocks of the GGUF it was loaded from.

    Sets each block matrix's `PackedWeight` to `q4_weight`'s (a model runner made after this reads
    them into its C++ decode loop, `engine.runner.decode_loop`); where the output projection is Q8_0 in the file, sets its `PackedWeight` to
    `q8_output_weight`'s. Logs which bits the products give (module docstring).

    Args:
        model: a bf16 CPU model built from `source` by `Transformer.from_state_dict` (packed).
        source: the `.gguf` file, a reader, or None for the embedded model.
    Raises:
        ValueError: the model is not bf16 on the CPU, not the plain Llama block with dense MLPs
            (the Q4_1 reader knows that file layout only), this build has no `q4_linear` (no
            AVX512-BF16), the model is not packed, or a block matrix of the file is not Q4_1.
    """
    if model.dtype != torch.bfloat16 or model.output.device.type != "cpu":
        raise ValueError(f"weights 'q4' needs a bfloat16 model on the CPU, got {model.dtype} on "
                         f"{model.output.device.type}")
    if not model.args.plain_llama:
        raise ValueError(f"weights 'q4' serves Q4_1 files of the plain Llama block; {model.args.architecture} "
                         "has other options (weights 'q4q8' takes its Q4_1 blocks)")
    if not kernels.q4_linear_available():
        raise ValueError("weights 'q4' needs genserve's q4_linear kernel, built only for CPUs "
                         "with AVX512-BF16 (and g++); use weights 'bf16'")
    if any(getattr(module, name + "_packed") is None for module, name in block_matrices(model)):
        raise ValueError("weights 'q4': the model has no packed bf16 copies (Transformer.pack found none)")
    amx_checked: dict[tuple[int, int], bool] = {}
    for module, name, blocks in q4_1_block_matrices(model, source, "q4"):
        setattr(module, name + "_packed",
                q4_weight(getattr(module, name + "_packed"), getattr(module, name), blocks, amx_checked))
    kinds = {describe(getattr(m, n + "_packed")) for m, n in block_matrices(model)}
    log.info("weights q4: %s", "; ".join(sorted(kinds)))
    output = load_gguf_output_q8_0(source)
    if output is not None and model.output_packed is not None:
        model.output_packed = q8_output_weight(model.output_packed, model.output, output)
    log.info("weights q4: output projection %s", "from its Q8_0 blocks (q8_amx_linear, the bf16 "
             "engine's oneDNN AMX bits)" if model.output_packed is not None and
             model.output_packed.q8 is not None else "in bf16")


def q8_output_weight(packed: PackedWeight, weight: torch.Tensor, blocks: torch.Tensor
                     ) -> PackedWeight:
    """The output projection's `PackedWeight` reading its Q8_0 blocks (`blocks` in the file's
    format, of `weight`'s values) where `q8_amx_linear` gives the bits of its products here:
    oneDNN's fixed-size AMX calls (`packed.tile_rows`), checked by `amx_matches_onednn`; else
    `packed` unchanged (the bf16 products)."""
    if not (packed.tile_rows and kernels.q4_amx_available()
            and weight.shape[0] % BLOCK_N == 0 and weight.shape[1] % QK == 0):
        return packed
    grouped = amx_pack(blocks, Q8_0_BLOCK_BYTES)
    if not amx_matches_onednn(weight, packed, grouped, "q8_amx_linear"):
        return packed
    return dataclasses.replace(packed, q8=grouped)


def describe(packed: PackedWeight) -> str:
    """Which kernel runs a `q4_weight`'s products and whose bits they are, in words."""
    if not packed.k_chunk:
        return "q4_amx_linear on every product (the bf16 engine's oneDNN AMX bits)"
    if packed.max_rows != ANY_ROWS:
        return (f"q4_linear up to {packed.max_rows} rows, k chunk {packed.k_chunk}, oneDNN above "
                "(the bf16 engine's bits)")
    if packed.tile_rows:
        return ("q4_linear on every product, one chain over k (the own-layout bf16 engine's "
                "bits, not this CPU's bf16 default's)")
    return "q4_linear on every product, one chain over k (the bf16 engine's bits)"
