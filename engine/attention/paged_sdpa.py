"""Attention over the paged KV cache in genserve's CPU kernels or torch's fused SDPA.

The functions the "cpu" and "sdpa" backends run (`engine.attention.cpu`, `engine.attention.sdpa`).
Decode rows (one query each) run in genserve's own kernel when the caller says so (`kernels`,
the CPU backend with `engine.kernels` built; `torch.ops.genserve.paged_decode`): per row (all its
KV heads, or one KV head when rows are few) it reads each block's keys and then values once, in
place through the block table, with fp32 scores (16 keys at a time on AMX), an online softmax and
P·V, the `group` query heads of a KV head together. Otherwise, and for prefill, torch's fused
attention runs (`scaled_dot_product_attention`, which on the CPU picks
`_scaled_dot_product_flash_attention_for_cpu` for these inputs: online softmax, fp32
accumulation, no [queries × keys] matrix in memory):

* decode rows (fallback) in one batched call: each row's blocks are gathered with one
  `index_select` into `[B, L, kv_heads, head_dim]`, viewed (no copy) as `[B, kv_heads, L,
  head_dim]`; the query heads that share a KV head are laid along the query axis
  (`[B, kv_heads, group, head_dim]`), so K and V are never repeated for GQA. L is padded to a
  multiple of 64 keys and the padding masked with -inf. The gathered keys and values go into the
  runner's `GatherBuffer` (`AttentionMetadata.gather`).
* prefill pieces (at most `prefill_piece` tokens of one request) in one call per piece, over the
  piece's exact context, with `enable_gqa` (K/V not repeated) and a causal additive mask
  (genserve's `paged_prefill` kernel instead, with kernels, bf16, head_dim 64 and a build for
  AVX512-BF16 or AVX2 + FMA, where AMX is not usable: `engine.kernels.prefill_kernel_preferred`).

Both are exact with respect to batching on CPU — a request's output does not depend on which
other requests share the step (the batch-invariance test, docs/design.md): both kernels work per
(row, head) — genserve's over the row's exact context, SDPA's with masked keys adding exact zeros —
and a prefill piece is always computed with the same shape. One process uses one decode path.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine import kernels as genserve_kernels
from engine.attention.base import (AttentionMetadata, AttentionSpec, GatherBuffer, PrefillPiece, decode_mask,
                                   window_mask)
from engine.attention.kv_quant import dequantize_kv, quantized


KERNEL_HEAD_DIMS = (64, 128, 256)     # head sizes `paged_decode_window` is compiled for
KERNEL_GROUPS = (1, 2, 3, 4, 8)       # query heads per KV head the decode kernels are compiled for


def window_kernel_serves(n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         cache_dtype: torch.dtype, spec: AttentionSpec | None) -> bool:
    """Whether `torch.ops.genserve.paged_decode_window` computes a layer's decode rows: head_dim
    64, 128 or 256, a group size of 1, 2, 3, 4 or 8, bf16 or fp32 pools of the queries' dtype
    (not the 8-bit format) and no softcap (`spec.softcap`; the score scale and the sliding window
    it takes). Says nothing of whether the kernels built (`engine.kernels.available`)."""
    return (head_dim in KERNEL_HEAD_DIMS and n_kv_heads > 0 and n_heads % n_kv_heads == 0
            and n_heads // n_kv_heads in KERNEL_GROUPS and dtype == cache_dtype
            and dtype in (torch.bfloat16, torch.float32) and (spec is None or spec.softcap is None))


def decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     kernels: bool = False, spec: AttentionSpec | None = None) -> torch.Tensor:
    """Attention of B one-token decode rows over their paged contexts, batched.

    Args:
        q: [B, n_heads, head_dim] queries of the decode rows.
        cache: one layer's pools [2, num_blocks, block_size, n_kv_heads, head_dim] (K, V), or
            int8 rows of the 8-bit format (`engine.attention.kv_quant`), read as their dequantized values.
        meta: `decode_blocks` [B × nb] and `decode_bias` [B, 1, 1, nb × block_size]; the SDPA
            path gathers into `meta.gather` when it is set.
        kernels: run genserve's kernel (the CPU backend with `engine.kernels` built):
            `paged_decode` for head_dim 64 without a spec, else `paged_decode_window` where
            `window_kernel_serves` (another head_dim, score scale or a sliding window), else SDPA.
        spec: the layer's scale, sliding window and softcap (`AttentionSpec`); None: plain.
    Returns:
        [B, n_heads, head_dim] in q's dtype. Scale 1/sqrt(head_dim) (Vaswani et al. 2017)
        unless `spec` says.

    Runs `torch.ops.genserve.paged_decode` when `kernels` (keys read in place,
    `decode_blocks` viewed as [B, nb] tables, `decode_lens` the contexts), else SDPA over the
    gathered, padded keys. Batch-invariant by construction (checked row by row against B = 1 with
    other paddings in tests/engine/attention/test_attention.py, both paths): every (row, KV head) is an
    independent problem and padded keys contribute exact zeros.
    """
    b, n_heads, hd = q.shape
    n_kv = cache.shape[-2]
    if kernels and spec is None and hd == 64:         # reads either cache format in place
        tables = meta.decode_blocks.view(b, -1)
        return torch.ops.genserve.paged_decode(q.contiguous(), cache[0], cache[1], tables,
                                               meta.decode_lens, hd ** -0.5)
    if kernels and b and window_kernel_serves(n_heads, n_kv, hd, q.dtype, cache.dtype, spec):
        tables = meta.decode_blocks.view(b, -1)
        scale = hd ** -0.5 if spec is None else spec.scale
        window = 0 if spec is None or spec.sliding_window is None else spec.sliding_window
        return torch.ops.genserve.paged_decode_window(q.contiguous(), cache[0], cache[1], tables,
                                                      meta.decode_lens, scale, window)
    length = meta.decode_blocks.numel() // b * cache.shape[2] if b else 0     # padded keys per row
    pools = cache.view(2, cache.shape[1], -1)                   # [2, num_blocks, block elements]
    gathered = torch.Size((2, meta.decode_blocks.numel(), pools.shape[-1]))
    buffer = meta.gather if meta.gather is not None else GatherBuffer()    # None: this layer's own
    kv = buffer.take(gathered.numel(), cache.dtype, cache.device).view(gathered)
    torch.index_select(pools[0], 0, meta.decode_blocks, out=kv[0])
    torch.index_select(pools[1], 0, meta.decode_blocks, out=kv[1])
    if quantized(cache.dtype):                                          # the 8-bit format
        kv = dequantize_kv(kv.view(2, -1, cache.shape[-1]), q.dtype)
    keys = kv[0].view(b, length, n_kv, hd).transpose(1, 2)             # [B, kvh, L, hd]
    values = kv[1].view(b, length, n_kv, hd).transpose(1, 2)
    qg = q.view(b, n_kv, n_heads // n_kv, hd)              # [B, kvh, group, hd]: group as queries
    bias = meta.decode_bias
    if bias.shape[-1] != length:            # a backend that builds no decode masks
        bias = decode_mask(meta.decode_lens, length, q.dtype)
    if spec is None:
        # reshape, not view: CUDA's fused kernels may return [B, kvh, group, hd] in another
        # memory order (with GQA, group > 1)
        return F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias).reshape(b, n_heads, hd)
    if spec.sliding_window is not None:     # keys older than the window: -inf as well
        old = torch.arange(length, device=q.device)[None, :] <= (meta.decode_lens - 1 - spec.sliding_window)[:, None]
        bias = bias.masked_fill(old[:, None, None, :], float("-inf"))
    return spec_attention(qg, keys, values, bias, spec).reshape(b, n_heads, hd)


def spec_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                   spec: AttentionSpec) -> torch.Tensor:
    """softmax(softcap(q·kᵀ · scale) + bias)·v for a layer with an `AttentionSpec`.

    Args:
        q: [N, kvh, q, hd]; keys, values: [N, kvh, L, hd]; bias: additive, broadcast to
            [N, kvh, q, L] (-inf hides a key).
    Returns:
        [N, kvh, q, hd] in q's dtype. Without a softcap it is SDPA with the spec's scale; with
        one the scores are computed explicitly in fp32 (SDPA has no softcap), capped as
        c·tanh(s / c) (Gemma 2, transformers' eager attention), masked, softmaxed in fp32.
    """
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=spec.scale)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap + bias.float()
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(q.dtype)


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, span: PrefillPiece,
                      spec: AttentionSpec | None = None) -> torch.Tensor:
    """Causal attention of one prefill piece over its context.

    Args:
        q: [q_len, n_heads, head_dim] the piece's queries.
        cache: one layer's pools [2, num_blocks, block_size, n_kv_heads, head_dim].
        span: the piece (context length, blocks, causal bias).
        spec: the layer's scale, sliding window and softcap; None: plain.
    Returns:
        [q_len, n_heads, head_dim] in q's dtype; head h reads KV head h // group (GQA, Ainslie
        et al. 2023; SDPA's `enable_gqa` reads the shared K/V without repeating them). Heads stay
        separate rather than folded into the query axis: torch's CPU flash kernel splits the
        work by (head, block of queries), and 9 heads × 4 blocks of 64 queries keep 2 threads
        evenly busy where 3 folded heads × 3 blocks of 256 did not (≈ 3 % faster per piece).
    """
    n_kv, hd = cache.shape[-2], cache.shape[-1]
    length = span.context_len
    keys = cache[0].index_select(0, span.blocks).view(-1, n_kv, hd)[:length].transpose(0, 1)
    values = cache[1].index_select(0, span.blocks).view(-1, n_kv, hd)[:length].transpose(0, 1)
    # On CPU always (the path the batch-invariance tests pin); elsewhere only with real groups:
    # CUDA's fused kernels may refuse the flag even for equal head counts.
    gqa = q.device.type == "cpu" or q.shape[1] != n_kv
    if spec is not None:
        bias = span.bias
        if spec.sliding_window is not None or bias is None:
            bias = window_mask(length - q.shape[0], length, length, spec.sliding_window, q.dtype, q.device)
        group = q.shape[1] // n_kv                     # query heads of a KV head along the query axis
        qg = q.view(q.shape[0], n_kv, group, hd).permute(1, 2, 0, 3).reshape(1, n_kv, -1, hd)
        out = spec_attention(qg, keys[None], values[None], bias.repeat(1, 1, group, 1), spec)
        return out.reshape(n_kv, group, q.shape[0], hd).permute(2, 0, 1, 3).reshape(q.shape)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=span.bias, enable_gqa=gqa)    # [1, H, q, hd]
    return out[0].transpose(0, 1)


def attend(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
           kernels: bool = False, spec: AttentionSpec | None = None) -> torch.Tensor:
    """Every request of the step attends over its own context (this step's K/V already stored).

    Args:
        q: [T, n_heads, head_dim] queries of the flat batch (RoPE applied).
        cache: one layer's K and V pools, [2, num_blocks, block_size, n_kv_heads, head_dim] in
            q's dtype, or int8 rows of the 8-bit format (`engine.attention.kv_quant`). Decode rows read
            the 8-bit rows in place on the kernel path; every other path attends over the
            dequantized blocks of its context (`dequantized_context`).
        meta: this step's decode rows and prefill pieces.
        kernels: genserve's CPU kernels run the decode rows (`decode_attention`: with a `spec`
            too, but for a softcap) and, for bf16 with head_dim 64 on AVX512-BF16 or AVX2 + FMA
            CPUs without usable AMX and no `spec`, the prefill pieces.
        spec: the layer's scale, sliding window and softcap (`AttentionSpec`); None: plain.
    Returns:
        [T, n_heads, head_dim] attention output, dtype of q.
    """
    if not meta.pieces:
        return decode_attention(q, cache, meta, kernels, spec)
    kernel = kernels and spec is None and q.dtype == torch.bfloat16 and q.shape[-1] == 64 \
        and genserve_kernels.prefill_kernel_preferred()
    contexts = getattr(meta.state, "tables", None) is not None
    if kernel and contexts and not quantized(cache.dtype):
        # every piece in one call (`engine.attention.cpu.PieceContexts`), each with the bits
        # `paged_prefill` gives it alone; the decode rows' outputs are written over theirs
        out = torch.ops.genserve.paged_prefill_pieces(q, cache[0], cache[1], meta.state.tables,
                                                      meta.state.pieces, q.shape[-1] ** -0.5)
        if meta.num_decode:
            out[:meta.num_decode] = decode_attention(q[:meta.num_decode], cache, meta, kernels)
        return out
    out = torch.empty_like(q)
    if meta.num_decode:
        out[:meta.num_decode] = decode_attention(q[:meta.num_decode], cache, meta, kernels, spec)
    for s in meta.pieces:
        piece = q[s.q_start:s.q_end]
        piece_cache = cache
        if quantized(cache.dtype):
            piece_cache, s = dequantized_context(cache, s, q.dtype)
        if kernel:
            out[s.q_start:s.q_end] = torch.ops.genserve.paged_prefill(
                piece, piece_cache[0], piece_cache[1], s.blocks, s.context_len - len(piece),
                q.shape[-1] ** -0.5)
        else:
            out[s.q_start:s.q_end] = prefill_attention(piece, piece_cache, s, spec)
    return out


def dequantized_context(cache: torch.Tensor, span: PrefillPiece,
                        dtype: torch.dtype) -> tuple[torch.Tensor, PrefillPiece]:
    """A prefill piece's context blocks of an 8-bit cache, dequantized.

    Args:
        cache: one layer's int8 pools [2, num_blocks, block_size, n_kv_heads, row_bytes].
        span: the piece; its `blocks` name the context's blocks in position order.
        dtype: the model dtype.
    Returns:
        (pools [2, nb, block_size, n_kv_heads, head_dim] in `dtype` holding the piece's nb
        blocks in order, the span with `blocks` = 0..nb-1 over them): the same attention as the
        pools in `dtype` holding the dequantized numbers. Prefill is bound by arithmetic, not by
        reading the context, so one dequantized copy per piece and layer costs little.
    """
    local = dequantize_kv(cache.index_select(1, span.blocks), dtype)
    blocks = torch.arange(len(span.blocks), dtype=torch.long, device=span.blocks.device)
    return local, replace(span, blocks=blocks)
