"""The GGUF's K-quant matrices (Q4_K, Q6_K) multiplied as they are, with llama.cpp's arithmetic.

A Q4_K_M file (the most common GGUF download) stores most matrices as Q4_K and some (the value
projection and the down projection of about half the layers, often the output projection) as
Q6_K: super-blocks of 256 weights along the input dimension, with sub-block scales. llama.cpp
multiplies them against each input row rounded to Q8_K (int8 per 256, one fp32 scale, int16 sums
of every 16), with integer dot products per sub-block scaled in fp32. Here
`torch.ops.genserve.qk_linear` (engine/kernels/csrc/qk_linear.cpp) does the same arithmetic over
the file's blocks re-grouped at load (`q4_k_pack`, `q6_k_pack`), and `qk_linear_reference` does it
step by step in torch ops for the tests. `engine.model.gguf_blocks` gives a model's block matrices these
products (and the Q4_1 ones), for `--weights q4q8`.

The block formats (ggml's ggml-common.h, `block_q4_K` and `block_q6_K`; dequantized by ggml's
`dequantize_row_q4_K` / `dequantize_row_q6_K` and `gguf.quants.Q4_K` / `Q6_K`):

* Q4_K, 144 bytes per 256 weights: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc[s] and
  eight 6-bit mins m[s] (packed as ggml's `get_scale_min_k4` reads them), 128 bytes of 4-bit q:
  byte 32p + l holds q of weight 64p + l (low nibble, sub-block 2p) and 64p + 32 + l (high
  nibble, sub-block 2p + 1). Weight w of sub-block s (32 weights): fp32(fp32(d · sc[s]) · q) −
  fp32(dmin · m[s]).
* Q6_K, 210 bytes per 256 weights: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), sixteen
  int8 scales sc[s] (sub-blocks of 16), fp16 d. In each half h (128 weights) and l in 0..31:
  weight 128h + l takes ql[64h + l] & 15 and bits 0-1 of qh[32h + l]; + 32: ql[64h + 32 + l] & 15,
  bits 2-3; + 64: ql[64h + l] >> 4, bits 4-5; + 96: ql[64h + 32 + l] >> 4, bits 6-7; q = those
  6 bits − 32. Weight: fp32(fp32(d · sc[s]) · q).

The activations (ggml's `quantize_row_q8_K_ref`, the Q8_K rounding its CPU backend uses for both):
per row and block of 256, max = the first x of largest |x|, iscale = fp32(−127 / max), q =
min(127, round_half_even(fp32(iscale · x))), d = fp32(1 / iscale), bsums[j] = Σ of q over
16-weight group j; a zero block gives d = 0, q = 0.

The product, per row r, output n and super-block b (ggml's `ggml_vec_dot_q4_K_q8_K` and
`ggml_vec_dot_q6_K_q8_K`: exact integer sums, then fp32), in this order in every path of the
kernel and in the reference:

* Q4_K: isum = Σ_s sc[s] · Σ_{k in s} q[k] · xq[k] and imin = Σ_s m[s] · (bsums[2s] + bsums[2s+1])
  (exact int32); acc = fma(fp32(xd · d), fp32(isum), acc); acc = fma(−fp32(xd · dmin),
  fp32(imin), acc).
* Q6_K: isum = Σ_s sc[s] · Σ_{k in s} q[k] · xq[k] (exact int32); acc = fma(fp32(xd · d),
  fp32(isum), acc).

acc starts at 0 and runs over the blocks in k order; y = acc, rounded once to x's dtype. ggml's
own SIMD paths keep a few fp32 partial sums per row and add them at the end, in an order that
differs from path to path (its AVX2 Q4_K keeps the min term apart); the integer sums, the
activation rounding and the per-block scaling are its, the fp32 accumulation order is this one.
Nothing here depends on the other rows of the batch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

QK_K = 256                  # weights per super-block (ggml's QK_K)
Q4_K = 12                   # gguf.GGMLQuantizationType.Q4_K
Q6_K = 14                   # gguf.GGMLQuantizationType.Q6_K
Q4_1 = 3                    # gguf.GGMLQuantizationType.Q4_1
Q8_0 = 8                    # gguf.GGMLQuantizationType.Q8_0
KIND_NAMES = {Q4_K: "Q4_K", Q6_K: "Q6_K"}
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}        # a file's bytes per 256 weights
PACKED_BYTES = {Q4_K: 148, Q6_K: 210}       # `qk_pack`'s bytes per output column and 256 weights
GROUP_N = 16                # output columns per group of the packed layout (N must be a multiple)
QK_PATHS = {"scalar": 0, "avx2": 1, "avx512": 2}   # `qk_linear`'s code paths (its `path` argument)


# ---- the file's blocks ---------------------------------------------------------------------------

def _check_blocks(name: str, blocks: torch.Tensor, kind: int, multiple: int = 1) -> tuple[int, int]:
    """(N, super-blocks per row) of `blocks`, uint8 [N, nb · BLOCK_BYTES[kind]]; raises ValueError
    (naming `name`) on another dtype or shape, an unknown kind, or N not a positive multiple of
    `multiple`."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"{name}: kind {kind} is neither Q4_K ({Q4_K}) nor Q6_K ({Q6_K})")
    size = BLOCK_BYTES[kind]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size or blocks.shape[1] == 0:
        raise ValueError(f"{name}: expected uint8 [N, K / 256 * {size}] {KIND_NAMES[kind]} blocks, "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    if blocks.shape[0] == 0 or blocks.shape[0] % multiple:
        raise ValueError(f"{name}: N must be a positive multiple of {multiple}, got {blocks.shape[0]}")
    return blocks.shape[0], blocks.shape[1] // size


def q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K block's 12 scale bytes [..., 12] (uint8) as its eight 6-bit scales and eight 6-bit
    mins, each uint8 [..., 8] (ggml's `get_scale_min_k4`): for s < 4 sc = b[s] & 63, m =
    b[s + 4] & 63; for s >= 4 sc = (b[s + 4] & 15) | (b[s - 4] >> 6) << 4, m = (b[s + 4] >> 4) |
    (b[s] >> 6) << 4."""
    b = scales.to(torch.uint8)
    lo, hi, mix = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 6) << 4)], dim=-1)
    m = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc, m


def q4_k_fields(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q4_K blocks uint8 [N, nb · 144] (file order) as their fields: d, dmin fp32 [N, nb] (the
    fp16 widened), sc, m int64 [N, nb, 8], q int64 [N, nb, 256] in weight order (0..15)."""
    n, nb = _check_blocks("q4_k_fields", blocks, Q4_K)
    b = blocks.contiguous().view(n, nb, 144)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    dmin = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    sc, m = q4_k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(n, nb, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, nb, 256)     # [.., p, low/high, 32]
    return dict(d=d, dmin=dmin, sc=sc.long(), m=m.long(), q=q.long())


def q6_k_fields(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q6_K blocks uint8 [N, nb · 210] (file order) as their fields: d fp32 [N, nb], sc int64
    [N, nb, 16] (signed), q int64 [N, nb, 256] in weight order (−32..31)."""
    n, nb = _check_blocks("q6_k_fields", blocks, Q6_K)
    b = blocks.contiguous().view(n, nb, 210)
    ql = b[..., 0:128].reshape(n, nb, 2, 2, 32).long()          # [.., half, A/B, l]
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32).long()        # [.., half, 1, l]
    low = torch.cat([ql & 15, ql >> 4], dim=3)                  # [.., half, (A lo, B lo, A hi, B hi), l]
    high = (qh >> torch.tensor([0, 2, 4, 6]).view(4, 1)) & 3    # [.., half, 4, l]
    q = (low | (high << 4)).reshape(n, nb, 256) - 32
    sc = b[..., 192:208].contiguous().view(torch.int8).long()
    d = b[..., 208:210].contiguous().view(torch.float16).float().squeeze(-1)
    return dict(d=d, sc=sc, q=q)


def qk_dequantize(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """Q4_K or Q6_K blocks uint8 [N, nb · BLOCK_BYTES[kind]] (file order) as fp32 [N, nb · 256],
    in ggml's fp32 operations (`dequantize_row_q4_K`: fp32(fp32(d · sc) · q) − fp32(dmin · m);
    `dequantize_row_q6_K`: fp32(fp32(d · sc) · q)), so equal to `gguf.quants.dequantize` of the
    same bytes. Raises ValueError on another kind or shape."""
    if kind == Q4_K:
        f = q4_k_fields(blocks)
        n, nb = f["d"].shape
        scale = (f["d"][..., None] * f["sc"].float()).repeat_interleave(32, dim=-1)
        mins = (f["dmin"][..., None] * f["m"].float()).repeat_interleave(32, dim=-1)
        return (scale * f["q"].float() - mins).reshape(n, nb * QK_K)
    f = q6_k_fields(blocks) if kind == Q6_K else _check_blocks("qk_dequantize", blocks, kind)
    n, nb = f["d"].shape
    scale = (f["d"][..., None] * f["sc"].float()).repeat_interleave(16, dim=-1)
    return (scale * f["q"].float()).reshape(n, nb * QK_K)


# ---- the kernel's layout -------------------------------------------------------------------------

def q4_k_pack(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks in file row order re-grouped into `qk_linear`'s layout
    (engine/kernels/csrc/qk_linear.cpp): per group of 16 output columns and super-block, one
    record of 2,368 bytes (148 per column, the file's 144 with the scales unpacked to bytes):

    * bytes 0-31: the 16 columns' d (fp16, the file's); 32-63: their dmin (fp16);
    * 64-191: sc[s][c], s = 0..7, one byte each (`q4_k_scales`);
    * 192-319: m[p][c][e] = m[2p + e] of column c, p = 0..3 (pairs, for one int16 pair product);
    * 320-2367: for p = 0..3, j = 0..7, c = 0..15, i = 0..3 the file's q byte 32p + 4j + i of
      column c: its low nibble is weight 64p + 4j + i (sub-block 2p), its high one weight
      64p + 32 + 4j + i (sub-block 2p + 1). One 64-byte row (p, j) is 16 columns × 4 weights,
      what one vpdpbusd multiplies by 4 broadcast activations.

    Records run over the super-blocks of a group, then over the groups in column order.

    Args:
        blocks: uint8 [N, K / 256 · 144], N a multiple of 16.
    Returns:
        uint8 [N, K / 256 · 148], contiguous (a new tensor); rows 16g .. 16g + 15 hold group g.
    Raises:
        ValueError: not uint8 2-D with whole blocks, or N not a positive multiple of 16.
    """
    n, nb = _check_blocks("q4_k_pack", blocks, Q4_K, GROUP_N)
    ng = n // GROUP_N
    b = blocks.contiguous().view(ng, GROUP_N, nb, 144)
    d = b[..., 0:2].permute(0, 2, 1, 3).reshape(ng, nb, 32)
    dmin = b[..., 2:4].permute(0, 2, 1, 3).reshape(ng, nb, 32)
    sc, m = q4_k_scales(b[..., 4:16])                                     # [ng, 16, nb, 8]
    sc = sc.permute(0, 2, 3, 1).reshape(ng, nb, 128)                      # [ng, nb, s, c]
    m = m.reshape(ng, GROUP_N, nb, 4, 2).permute(0, 2, 3, 1, 4).reshape(ng, nb, 128)   # [.., p, c, e]
    qs = b[..., 16:].reshape(ng, GROUP_N, nb, 4, 8, 4).permute(0, 2, 3, 4, 1, 5)       # [.., p, j, c, i]
    out = torch.cat([d, dmin, sc, m, qs.reshape(ng, nb, 2048)], dim=-1)   # [ng, nb, 2368]
    return out.reshape(n, nb * PACKED_BYTES[Q4_K]).contiguous()


def q6_k_pack(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks in file row order re-grouped into `qk_linear`'s layout
    (engine/kernels/csrc/qk_linear.cpp): per group of 16 output columns and super-block, one
    record of 3,360 bytes (210 per column, as in the file):

    * bytes 0-31: the 16 columns' d (fp16);
    * 32-287: sc[s][c], s = 0..15 (int8);
    * 288-3359: for h = 0..1 (half), j = 0..7, three 64-byte rows of [16 columns][4 bytes]:
      A = ql[64h + 4j + i], B = ql[64h + 32 + 4j + i], H = qh[32h + 4j + i]. A's low nibbles
      with H's bits 0-1 are weights 128h + 4j + i; B's low with bits 2-3 weights + 32; A's high
      with bits 4-5 + 64; B's high with bits 6-7 + 96 (q + 32, 0..63).

    Args:
        blocks: uint8 [N, K / 256 · 210], N a multiple of 16.
    Returns:
        uint8 [N, K / 256 · 210], contiguous (a new tensor); rows 16g .. 16g + 15 hold group g.
    Raises:
        ValueError: not uint8 2-D with whole blocks, or N not a positive multiple of 16.
    """
    n, nb = _check_blocks("q6_k_pack", blocks, Q6_K, GROUP_N)
    ng = n // GROUP_N
    b = blocks.contiguous().view(ng, GROUP_N, nb, 210)
    d = b[..., 208:210].permute(0, 2, 1, 3).reshape(ng, nb, 32)
    sc = b[..., 192:208].permute(0, 2, 3, 1).reshape(ng, nb, 256)        # [ng, nb, s, c]
    ql = b[..., 0:128].reshape(ng, GROUP_N, nb, 2, 2, 8, 4)              # [.., h, A/B, j, i]
    qh = b[..., 128:192].reshape(ng, GROUP_N, nb, 2, 1, 8, 4)            # [.., h, 1, j, i]
    rows = torch.cat([ql, qh], dim=4)                                     # [ng, c, nb, h, 3, j, i]
    rows = rows.permute(0, 2, 3, 5, 4, 1, 6).reshape(ng, nb, 3072)        # [ng, nb, h, j, 3, c, i]
    out = torch.cat([d, sc, rows], dim=-1)                                # [ng, nb, 3360]
    return out.reshape(n, nb * PACKED_BYTES[Q6_K]).contiguous()


def qk_pack(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """`q4_k_pack` or `q6_k_pack` by `kind` (`Q4_K` or `Q6_K`); raises ValueError otherwise."""
    if kind == Q4_K:
        return q4_k_pack(blocks)
    if kind == Q6_K:
        return q6_k_pack(blocks)
    raise ValueError(f"qk_pack: kind {kind} is neither Q4_K ({Q4_K}) nor Q6_K ({Q6_K})")


# ---- the reference -------------------------------------------------------------------------------

def q8_k_round(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's rows rounded to Q8_K as ggml's `quantize_row_q8_K_ref` rounds them (module docstring),
    step by step in torch's fp32 operations.

    Args:
        x: [M, K] float (bf16 and fp16 widen exactly to fp32), K a multiple of 256.
    Returns:
        (q, d, bsums): q int8 [M, K], d fp32 [M, K / 256] (negative where the block's largest
        |x| is positive: ggml's sign), bsums int16 [M, K / 16].
    Raises:
        ValueError: x not 2-D or K not a multiple of 256.
    """
    if x.dim() != 2 or x.shape[1] % QK_K:
        raise ValueError(f"q8_k_round: expected [M, K] with K a multiple of 256, got {tuple(x.shape)}")
    m, k = x.shape
    xb = x.float().reshape(m, k // QK_K, QK_K)
    first = xb.abs().argmax(dim=-1, keepdim=True)            # argmax: the first of equal maxima
    top = xb.gather(-1, first)                               # the signed x of largest |x|
    zero = top == 0
    iscale = torch.tensor(-127.0) / torch.where(zero, torch.ones_like(top), top)
    q = torch.round(iscale * xb).clamp(max=127)
    q = torch.where(zero, torch.zeros_like(q), q)
    d = torch.where(zero, torch.zeros_like(iscale), torch.tensor(1.0) / iscale).squeeze(-1)
    q = q.to(torch.int8).reshape(m, k)
    bsums = q.view(m, k // 16, 16).sum(dim=-1).to(torch.int16)
    return q, d, bsums


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a · b + c rounded once (IEEE fusedMultiplyAdd, what vfmadd computes), for fp32
    tensors of one shape: the product exact in fp64 (24 + 24 bits), the sum's fp64 rounding error
    recovered exactly (Knuth's TwoSum), and the one case where rounding the fp64 sum to fp32 is
    not the single rounding (the sum exactly halfway between two fp32 numbers while the error
    is not 0) corrected toward the error's side."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bv = s - p
    err = (p - (s - bv)) + (cd - bv)
    r = s.float()
    rd = r.double()
    other = torch.nextafter(r, torch.where(s > rd, torch.tensor(float("inf")), torch.tensor(float("-inf"))))
    tie = (s != rd) & (s == (rd + other.double()) * 0.5) & (err != 0)
    toward_other = ((err > 0) & (other > r)) | ((err < 0) & (other < r))
    return torch.where(tie & toward_other, other, r)


def qk_linear_reference(x: torch.Tensor, blocks: torch.Tensor, kind: int,
                        chunk: int = 256) -> torch.Tensor:
    """What `qk_linear` computes, step by step in torch ops (module docstring): x rounded by
    `q8_k_round`, the integer sums per sub-block exact (fp64 sums of integers below 2^53), the
    fp32 scaling and accumulation over the super-blocks with `fma32`, in the kernel's order.

    Args:
        x: [M, K] float, K a multiple of 256; blocks: uint8 [N, K / 256 · BLOCK_BYTES[kind]] in
            file order; kind: `Q4_K` or `Q6_K`; chunk: output columns per step (memory).
    Returns:
        fp32 [M, N], the accumulator before the output's rounding (round it to x's dtype).
    Raises:
        ValueError: an unknown kind, or shapes that do not match.
    """
    n, nb = _check_blocks("qk_linear_reference", blocks, kind)
    if x.dim() != 2 or x.shape[1] != nb * QK_K:
        raise ValueError(f"qk_linear_reference: x {tuple(x.shape)} does not match blocks of "
                         f"K = {nb * QK_K}")
    m = x.shape[0]
    xq, xd, bsums = q8_k_round(x)
    sub = 32 if kind == Q4_K else 16
    xs = xq.double().view(m, nb, QK_K // sub, sub)
    out = []
    for c0 in range(0, n, chunk):
        part = blocks[c0:c0 + chunk]
        f = q4_k_fields(part) if kind == Q4_K else q6_k_fields(part)
        w = f["q"].double().view(part.shape[0], nb, QK_K // sub, sub)
        dots = torch.einsum("mbsl,nbsl->mnbs", xs, w)                       # exact integers
        isum = (dots * f["sc"].double()[None]).sum(-1).float()             # [M, n, nb], exact int → fp32
        t1 = xd[:, None, :] * f["d"][None]                                   # fp32(xd · d)
        if kind == Q4_K:
            pairs = bsums.view(m, nb, 8, 2).long().sum(-1)                   # Σ q per 32
            imin = torch.einsum("mbs,nbs->mnb", pairs.double(), f["m"].double()).float()
            t2 = xd[:, None, :] * f["dmin"][None]
        acc = torch.zeros(m, part.shape[0])
        for b in range(nb):
            acc = fma32(t1[..., b], isum[..., b], acc)
            if kind == Q4_K:
                acc = fma32(-t2[..., b], imin[..., b], acc)
        out.append(acc)
    return torch.cat(out, dim=1)


# ---- the product ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class QKWeight:
    """A matrix's K-quant blocks in `qk_linear`'s layout, as row segments of one kind each (a
    fused matrix may join Q4_K rows with Q6_K rows: Q | K | V where V is Q6_K).

    Attributes:
        blocks: per segment uint8 [n_i, K / 256 · PACKED_BYTES[kind_i]] (`qk_pack`), n_i a
            multiple of 16; the output columns are the segments' rows in turn.
        kinds: per segment `Q4_K` or `Q6_K`.
    """

    blocks: tuple[torch.Tensor, ...]
    kinds: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(b.shape[0] for b in self.blocks)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)


def qk_weight(parts: list[tuple[int, torch.Tensor]]) -> QKWeight:
    """The `QKWeight` of a matrix whose rows are `parts` in turn: (kind, file-order blocks uint8
    [rows, K / 256 · BLOCK_BYTES[kind]]); adjacent parts of one kind become one segment.

    Raises:
        ValueError: an unknown kind, parts of different K, or a part whose rows are not a
            positive multiple of 16.
    """
    merged: list[tuple[int, list[torch.Tensor]]] = []
    k = None
    for kind, blocks in parts:
        _, nb = _check_blocks("qk_weight", blocks, kind, GROUP_N)
        if k is not None and nb != k:
            raise ValueError(f"qk_weight: parts of K = {k * QK_K} and {nb * QK_K}")
        k = nb
        if merged and merged[-1][0] == kind:
            merged[-1][1].append(blocks)
        else:
            merged.append((kind, [blocks]))
    return QKWeight(tuple(qk_pack(torch.cat(bs), kind) for kind, bs in merged),
                    tuple(kind for kind, _ in merged))


def qk_path_from_env() -> int:
    """The `path` argument `qk_linear` gets by default: -1 (the best path this CPU runs), or the
    path GENSERVE_QK_PATH names ("scalar", "avx2", "avx512"; for tests and measurements).

    Raises:
        ValueError: GENSERVE_QK_PATH names no path.
    """
    name = os.environ.get("GENSERVE_QK_PATH", "")
    if not name:
        return -1
    if name not in QK_PATHS:
        raise ValueError(f"GENSERVE_QK_PATH={name!r}: one of {', '.join(QK_PATHS)}")
    return QK_PATHS[name]


def qk_linear(x: torch.Tensor, weight: QKWeight, path: int | None = None) -> torch.Tensor:
    """x @ Wᵀ by `torch.ops.genserve.qk_linear` (module docstring) over `weight`'s segments.

    Args:
        x: bf16 or fp32 [M, K] (made contiguous), K a multiple of 256; weight: its `QKWeight`;
            path: `QK_PATHS` value to force, or None for the best this CPU runs (-1; the C++ op
            reads GENSERVE_QK_PATH then).
    Returns:
        [M, out_features] in x's dtype.
    Raises:
        RuntimeError: (from the op) K does not match, or the path cannot run on this CPU.
    """
    return torch.ops.genserve.qk_linear(x.contiguous(), list(weight.blocks), list(weight.kinds),
                                        -1 if path is None else path)
