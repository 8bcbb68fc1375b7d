"""The 8-bit KV cache format: keys and values stored as int8 with a power-of-two scale per 32.

Each head vector of a cached token (head_dim numbers, K or V) is cut into groups of
`KV_GROUP` = 32 along head_dim and stored as the OCP Microscaling specification's MXINT8 block
(OCP MX v1.0, 2023: 32 elements, one shared E8M0 scale, 8-bit integer elements): the group's
largest magnitude amax = m · 2^e (1 ≤ m < 2) sets the scale 2^e, and each number x is stored as
the integer q = round(x · 2^(6 − e)) in -127..127 (so |q| ≥ 64 for the largest); the number the
cache holds is then q · 2^(e − 6). One cache row (one token, one KV head) is head_dim int8 q
followed by one byte per group, the biased exponent e + 127, so a pool is still one tensor per
layer, `[2, num_blocks, block_size, kv_heads, row_bytes]` int8, and every place that moves blocks
(copy-on-write, gathers) moves rows unchanged. SmolLM2's head_dim 64 takes 66 bytes a row instead
of bf16's 128 (0.52×).

Why a power-of-two scale rather than ggml Q8_0's fp16 one: q · 2^(e − 6) has at most 7
significant bits, so it is exact in bf16 (8 bits) and in fp32, and reading the cache rounds
nothing. An 8-bit cache therefore gives, on every attention path, the bits of a bf16 cache that
holds the same numbers (`dequantize_kv`; tested for each path), and genserve's decode kernel turns
a row into fp32 values with one conversion and one exact multiply per 16 numbers. The price is
precision: the largest number of a group uses 64..127 of the integer range, not 127 (about
half a bit less than Q8_0 on average). Quantizing is a function of the token's own K or V, so a
row's bits still do not depend on its batch.

The rounding is pinned so that genserve's C++ kernel (`rope_store_kv` on an int8 cache) and
`quantize_kv` store the same bytes: e from frexp of the fp32 amax (e = 0 for an all-zero group,
at least -120 so that every stored number is an fp32 normal), q = x · 2^(6 − e) (exact) rounded
half to even and clamped to ±127.
"""

from __future__ import annotations

import torch

KV_GROUP = 32          # numbers per scale (MXINT8's block)
KV_QMAX = 127          # largest stored magnitude: q in -127..127
KV_EXP_BIAS = 127      # stored byte = e + 127 (E8M0)
KV_EXP_MIN = -120      # smallest e: q · 2^(e − 6) stays an fp32 normal (≥ 2^-126)
KV_Q_BITS = 6          # q = x · 2^(6 − e): the largest |q| is in 64..127
DEQUANT_ROWS = 1 << 16  # head vectors dequantized at a time (fp32 temporaries of 32 MB at hd 128)


def quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of element type `dtype` holds the 8-bit format (int8) rather than numbers."""
    return dtype == torch.int8


def row_bytes(head_dim: int) -> int:
    """Bytes of one stored head vector: head_dim int8 + 1 byte (the exponent) per group of 32.

    Raises:
        ValueError: head_dim is not a positive multiple of 32.
    """
    if head_dim <= 0 or head_dim % KV_GROUP:
        raise ValueError(f"the 8-bit KV cache needs head_dim a multiple of {KV_GROUP}, got {head_dim}")
    return head_dim + head_dim // KV_GROUP


def head_dim_of(row: int) -> int:
    """The head_dim whose stored row is `row` bytes (inverse of `row_bytes`; 66 → 64)."""
    return row * KV_GROUP // (KV_GROUP + 1)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """Head vectors → stored rows.

    Args:
        x: [..., head_dim] bf16, fp16 or fp32 (head_dim a multiple of 32), finite.
    Returns:
        int8 [..., row_bytes(head_dim)]: the q of each number, then each group's e + 127 as a
        byte, as the module docstring defines them.
    Raises:
        ValueError: head_dim is not a multiple of 32.
    """
    hd = x.shape[-1]
    width = row_bytes(hd)
    groups = x.float().reshape(*x.shape[:-1], hd // KV_GROUP, KV_GROUP)
    amax = groups.abs().amax(dim=-1)                                 # [..., groups] fp32
    _, k = torch.frexp(amax)                                        # amax = m · 2^k, 0.5 ≤ m < 1
    e = torch.where(amax == 0, torch.zeros_like(k), (k - 1).clamp(min=KV_EXP_MIN))
    up = torch.exp2((KV_Q_BITS - e).float())                        # exact powers of two
    q = torch.round(groups * up[..., None]).clamp_(-KV_QMAX, KV_QMAX).to(torch.int8)
    out = torch.empty(*x.shape[:-1], width, dtype=torch.int8, device=x.device)
    out[..., :hd] = q.reshape(*x.shape[:-1], hd)
    out[..., hd:] = (e + KV_EXP_BIAS).to(torch.uint8).view(torch.int8)
    return out


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows → the numbers attention reads.

    Args:
        rows: int8 [..., row_bytes(head_dim)].
        dtype: the model dtype (bf16, fp16 or fp32; each number is exact in bf16 and fp32).
    Returns:
        [..., head_dim] in `dtype`: q · 2^(e − 6), computed in fp32 and rounded once.

    The fp32 products are made `DEQUANT_ROWS` head vectors at a time, so besides the result
    they take at most 2 × 32 MB: SDPA's decode path dequantizes every gathered key and value of
    the step at once (32 rows of 3,520 tokens of Llama-2-7B: 7.4 GB of fp32 in one piece, more
    than the 6 GB activation reserve; docs/gpu.md).
    """
    hd = head_dim_of(rows.shape[-1])
    flat = rows.reshape(-1, rows.shape[-1])
    out = torch.empty(flat.shape[0], hd, dtype=dtype, device=rows.device)
    for start in range(0, flat.shape[0], DEQUANT_ROWS):
        part = flat[start:start + DEQUANT_ROWS]
        q = part[:, :hd].float().view(-1, hd // KV_GROUP, KV_GROUP)
        e = part[:, hd:].view(torch.uint8).float() - (KV_EXP_BIAS + KV_Q_BITS)
        out[start:start + DEQUANT_ROWS] = (q * torch.exp2(e)[..., None]).view(-1, hd)
    return out.view(*rows.shape[:-1], hd)
