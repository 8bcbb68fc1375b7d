"""Ragged-batch attention over the paged KV cache.

One step's tokens arrive as a flat list `[T = B + C]` tagged with their request. Each layer
writes the step's new keys and values into their cache slots (`store_kv`, or fused with RoPE in
`engine.model.layer_ops`), then every request attends over its own context, read through its
block table (`attend`).

Decode rows (one query each) run in genserve's own kernel when it could be built
(`engine/kernels.py`, `torch.ops.genserve.paged_decode`): per row (all its KV heads, or one KV
head when rows are few) it reads each block's keys and then values once, in place through the
block table, with fp32 scores (16 keys at a time on AMX), an online softmax and P·V, the `group`
query heads of a KV head together. Otherwise, and for prefill, torch's fused CPU attention kernel runs
(`scaled_dot_product_attention`, which picks `_scaled_dot_product_flash_attention_for_cpu` for
these inputs: online softmax, fp32 accumulation, no [queries × keys] matrix in memory):

* decode rows (fallback) in one batched call: each row's blocks are gathered with one
  `index_select` into `[B, L, kv_heads, head_dim]`, viewed (no copy) as `[B, kv_heads, L,
  head_dim]`; the query heads that share a KV head are laid along the query axis
  (`[B, kv_heads, group, head_dim]`), so K and V are never repeated for GQA. L is padded to a
  multiple of 64 keys and the padding masked with -inf. The gathered keys and values go into a
  `GatherBuffer` the executor keeps across steps (`AttentionMetadata.gather`).
* prefill pieces (at most `prefill_piece` tokens of one request) in one call per piece, over the
  piece's exact context, with `enable_gqa` (K/V not repeated) and a causal additive mask.

Both are exact with respect to batching on CPU — a request's output does not depend on which
other requests share the step (the batch-invariance test, docs/design.md): both kernels work per
(row, head) — genserve's over the row's exact context, SDPA's with masked keys adding exact zeros —
and a prefill piece is always computed with the same shape. One process uses one decode path.

The same two functions run on any torch device (the "sdpa" backend of
`engine.attention_backends`, whose metadata `AttentionMetadata.build` puts on the device with one
host-to-device copy per step); the other backends there (xformers, FlexAttention) read the same
`AttentionMetadata` plus their own per-step state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine import kernels as genserve_kernels
from engine.kv_quant import dequantize_kv, quantize_kv, quantized

if TYPE_CHECKING:
    from engine.attention_backends import AttentionBackend

Span = tuple[int, int, "list[int] | tuple[int, ...]", bool]   # (start, length, block table, decode)


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """One prefill piece's slice of the flat batch.

    Attributes:
        q_start, q_end: its tokens are rows [q_start, q_end) of the flat batch.
        context_len: keys it attends to, positions [0, context_len) (== its last position + 1).
        blocks: int64 [ceil(context_len / block_size)] block ids in position order.
        bias: additive mask [1, 1, q_len, context_len] in the model dtype, 0 where query i may
            attend key j (j <= its position), -inf elsewhere; None for a single query (it attends
            every key).
    """

    q_start: int
    q_end: int
    context_len: int
    blocks: torch.Tensor
    bias: torch.Tensor | None


DECODE_PAD_BLOCKS = 4     # decode keys are padded to a multiple of 4 blocks (64 tokens)
GATHER_GROWTH = 1.25      # a GatherBuffer grows to 1.25× what a step asked for


class GatherBuffer:
    """Memory for the SDPA decode path's gathered keys and values, reused by every layer of every
    step; it only grows (to `GATHER_GROWTH` × the largest request, so contexts that grow a block
    at a time do not reallocate every few steps) and is never shrunk: it holds ≈ 1.25 × the
    largest step's gather until the executor goes. Used from the scheduler thread only.

    Each layer gathers B rows × L keys of K and of V (bytes: 2 · B · L · kv_heads · head_dim ·
    itemsize). Buffers that size, allocated per layer, are handed back to the OS by glibc on free
    and page-faulted in again on the next touch; why that mattered is in docs/benchmarks/kernels.md.
    """

    def __init__(self) -> None:
        self._buf = torch.empty(0)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A 1-D tensor of `numel` elements of `dtype` on `device` (contents undefined), valid
        until the next call; raises RuntimeError (from torch) if the allocation fails."""
        buf = self._buf
        if buf.dtype != dtype or buf.device != torch.device(device) or buf.numel() < numel:
            self._buf = buf = torch.empty(int(numel * GATHER_GROWTH), dtype=dtype, device=device)
        return buf[:numel]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one step, passed explicitly to every layer.

    Attributes:
        slots: int64 [T], where each new token's K and V go in the layer's K (and V) pool viewed
            as rows `[num_blocks × block_size, kv_heads, head_dim]`: block × block_size + offset.
        num_decode: B, decode rows at the front of the flat batch (one query each).
        decode_blocks: int64 [B × nb], the decode rows' block tables, each padded with block 0 to
            nb = a multiple of DECODE_PAD_BLOCKS blocks, concatenated row after row.
        decode_bias: additive mask [B, 1, 1, nb × block_size] in the model dtype: -inf for keys
            past a row's context, 0 elsewhere (SDPA path; [B, 1, 1, 0] on the kernel path).
        decode_lens: int64 [B], each decode row's context length (keys it attends to).
        seqs: one `SeqSpan` per prefill piece, in flat-batch order (after the decode rows).
        kernels: the step runs genserve's CPU kernels (`engine.kernels`): decode rows in
            `torch.ops.genserve.paged_decode` (else SDPA) and the model's per-token steps in
            `KernelLayerOps` (else `TorchLayerOps`).
        gather: where the SDPA decode path gathers keys and values (None: a new tensor per
            layer).
        backend: the attention backend that runs `attend` for this step
            (`engine.attention_backends`); None: this module's `attend` with metadata built on the
            CPU as above.
        state: the backend's own per-step data (masks, block masks), from its `step_state`.
        inputs: the caller's per-step int64 lists (`build`'s `inputs`: token ids, positions, rows
            to sample), uploaded to the device in the same copy as the metadata.
    """

    slots: torch.Tensor
    num_decode: int
    decode_blocks: torch.Tensor
    decode_bias: torch.Tensor
    decode_lens: torch.Tensor
    seqs: tuple[SeqSpan, ...]
    kernels: bool = False
    gather: GatherBuffer | None = None
    backend: "AttentionBackend | None" = None
    state: Any = None
    inputs: tuple[torch.Tensor, ...] = ()

    @classmethod
    def build(cls, spans: list[Span], block_size: int, dtype: torch.dtype = torch.float32,
              kernels: bool = False, gather: GatherBuffer | None = None, *,
              backend: "AttentionBackend | None" = None, device: torch.device | str = "cpu",
              num_blocks: int = 0, inputs: Sequence[list[int]] = ()) -> "AttentionMetadata":
        """Metadata from `(start_position, num_tokens, block_table, is_decode)` per segment, in
        batch order; decode rows (one token each) must come first.

        Args:
            spans: the step's segments.
            block_size: tokens per block.
            dtype: the model dtype (the masks' dtype must match the queries').
            kernels: build for genserve's kernels (no decode mask).
            gather: the executor's buffer for the SDPA decode path (see `GatherBuffer`).
            backend: None builds the CPU metadata above (today's CPU path, `attend`); a backend
                (`engine.attention_backends`) gets metadata built by `build_on_device`.
            device, num_blocks, inputs: see `build_on_device` (used only with a backend).
        Raises:
            ValueError: a block table does not cover its segment, or a decode row follows a
                prefill piece.
        """
        if backend is not None:
            return cls.build_on_device(spans, block_size, dtype, backend, device, num_blocks,
                                       inputs, gather)
        slots, seqs, tables, lens = [], [], [], []
        q = 0
        for start, length, table, decode in spans:
            end = start + length
            if len(table) * block_size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            if decode:
                if seqs or length != 1:
                    raise ValueError("decode rows hold one token and come before prefill pieces")
                tables.append(table)
                lens.append(end)
            else:
                bias = None
                if length > 1:
                    pos = torch.arange(start, end)
                    causal = torch.arange(end)[None, :] <= pos[:, None]          # [q_len, L]
                    bias = torch.zeros(length, end, dtype=dtype).masked_fill_(~causal, float("-inf"))
                    bias = bias[None, None]                                       # [1, 1, q, L]
                nb_used = -(-end // block_size)
                seqs.append(SeqSpan(q, q + length, end,
                                    torch.tensor(table[:nb_used], dtype=torch.long), bias))
            q += length
        nb = max((len(t) for t in tables), default=0)
        nb = -(-nb // DECODE_PAD_BLOCKS) * DECODE_PAD_BLOCKS
        padded = [list(t) + [0] * (nb - len(t)) for t in tables]
        decode_blocks = torch.tensor(padded, dtype=torch.long).reshape(-1)
        decode_lens = torch.tensor(lens, dtype=torch.long)
        if kernels:
            decode_bias = torch.zeros(len(tables), 0, dtype=dtype)
        else:
            past = torch.arange(nb * block_size)[None, :] >= decode_lens[:, None]   # [B, L]
            decode_bias = torch.zeros(len(tables), nb * block_size, dtype=dtype)
            decode_bias.masked_fill_(past, float("-inf"))
        return cls(torch.tensor(slots, dtype=torch.long), len(tables), decode_blocks,
                   decode_bias[:, None, None, :], decode_lens, tuple(seqs), kernels, gather)

    @classmethod
    def build_on_device(cls, spans: list[Span], block_size: int, dtype: torch.dtype,
                        backend: "AttentionBackend", device: torch.device | str,
                        num_blocks: int, inputs: Sequence[list[int]] = (),
                        gather: GatherBuffer | None = None) -> "AttentionMetadata":
        """The same metadata as `build`, on `device`, with one host-to-device copy.

        Every integer the step needs (slots, decode block tables and lengths, each prefill
        piece's blocks, the backend's own lists from `backend.host_ints`, and the caller's
        `inputs`) goes into one int64 host tensor (pinned on CUDA), is copied once, and is sliced
        into views on the device. The SDPA masks (`decode_bias`, `SeqSpan.bias`) are then computed
        on the device from those views, only when the backend reads them (`backend.masks`).

        Args:
            spans, block_size, dtype, gather: as in `build`.
            backend: the backend that will run the step; its `step_state` builds `state`.
            device: where the model's weights and the KV cache live.
            num_blocks: blocks in the KV pool (the paged backends' key axis).
            inputs: extra int lists to upload in the same copy (returned in `inputs`, int64).
        Raises:
            ValueError: as `build`.
        """
        device = torch.device(device)
        slots: list[int] = []
        tables: list[list[int]] = []
        lens: list[int] = []
        pieces: list[tuple[int, int, int, int]] = []          # (q_start, length, end, blocks)
        piece_blocks: list[int] = []
        q = 0
        for start, length, table, decode in spans:
            end = start + length
            if len(table) * block_size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            if decode:
                if pieces or length != 1:
                    raise ValueError("decode rows hold one token and come before prefill pieces")
                tables.append(list(table))
                lens.append(end)
            else:
                nb_used = -(-end // block_size)
                pieces.append((q, length, end, nb_used))
                piece_blocks.extend(table[:nb_used])
            q += length
        nb = max((len(t) for t in tables), default=0)
        nb = -(-nb // DECODE_PAD_BLOCKS) * DECODE_PAD_BLOCKS
        padded = [b for t in tables for b in t + [0] * (nb - len(t))]
        own = backend.host_ints(spans, block_size)
        lists = [slots, padded, lens, piece_blocks, *own, *inputs]
        sizes = [len(x) for x in lists]
        flat = [v for x in lists for v in x]
        host = torch.tensor(flat, dtype=torch.long)
        if device.type == "cuda":
            host = host.pin_memory()
        views = list(host.to(device, non_blocking=True).split(sizes))
        slots_t, blocks_t, lens_t, piece_t = views[:4]
        own_t = views[4:4 + len(own)]
        inputs_t = tuple(views[4 + len(own):])
        b = len(tables)
        if backend.masks:
            keys = torch.arange(nb * block_size, device=device)
            decode_bias = torch.zeros(b, nb * block_size, dtype=dtype, device=device)
            decode_bias.masked_fill_(keys[None, :] >= lens_t[:, None], float("-inf"))
        else:
            decode_bias = torch.zeros(b, 0, dtype=dtype, device=device)
        seqs = []
        offset = 0
        for q_start, length, end, nb_used in pieces:
            bias = None
            if length > 1 and backend.masks:
                pos = torch.arange(end - length, end, device=device)
                causal = torch.arange(end, device=device)[None, :] <= pos[:, None]
                bias = torch.zeros(length, end, dtype=dtype, device=device)
                bias = bias.masked_fill_(~causal, float("-inf"))[None, None]
            seqs.append(SeqSpan(q_start, q_start + length, end,
                                piece_t[offset:offset + nb_used], bias))
            offset += nb_used
        state = backend.step_state(own_t, spans, block_size, num_blocks, device)
        return cls(slots_t, b, blocks_t, decode_bias[:, None, None, :], lens_t, tuple(seqs),
                   False, gather, backend, state, inputs_t)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention of B one-token decode rows over their paged contexts, batched.

    Args:
        q: [B, n_heads, head_dim] queries of the decode rows.
        cache: one layer's pools [2, num_blocks, block_size, n_kv_heads, head_dim] (K, V), or
            int8 rows of the 8-bit format (`engine.kv_quant`), read as their dequantized values.
        meta: `decode_blocks` [B × nb] and `decode_bias` [B, 1, 1, nb × block_size]; the SDPA
            path gathers into `meta.gather` when it is set.
    Returns:
        [B, n_heads, head_dim] in q's dtype. Scale 1/sqrt(head_dim) (Vaswani et al. 2017).

    Runs `torch.ops.genserve.paged_decode` when `meta.kernels` (keys read in place,
    `decode_blocks` viewed as [B, nb] tables, `decode_lens` the contexts), else SDPA over the
    gathered, padded keys. Batch-invariant by construction (checked row by row against B = 1 with
    other paddings in tests/engine/test_attention.py, both paths): every (row, KV head) is an
    independent problem and padded keys contribute exact zeros.
    """
    b, n_heads, hd = q.shape
    n_kv = cache.shape[-2]
    if meta.kernels:                     # reads either cache format in place
        tables = meta.decode_blocks.view(b, -1)
        return torch.ops.genserve.paged_decode(q.contiguous(), cache[0], cache[1], tables,
                                               meta.decode_lens, hd ** -0.5)
    length = meta.decode_bias.shape[-1]
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
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_bias)
    return out.view(b, n_heads, hd)


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, span: SeqSpan) -> torch.Tensor:
    """Causal attention of one prefill piece over its context.

    Args:
        q: [q_len, n_heads, head_dim] the piece's queries.
        cache: one layer's pools [2, num_blocks, block_size, n_kv_heads, head_dim].
        span: the piece (context length, blocks, causal bias).
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
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=span.bias, enable_gqa=gqa)    # [1, H, q, hd]
    return out[0].transpose(0, 1)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the step's keys and values into their cache slots.

    Args:
        k, v: [T, n_kv_heads, head_dim] (RoPE already applied to k).
        cache: one layer's pools [2, num_blocks, block_size, n_kv_heads, head_dim] (K, V), or
            int8 [..., row_bytes(head_dim)]: then k and v are stored in the 8-bit format
            (`engine.kv_quant.quantize_kv`).
        slots: int64 [T], rows of the pools viewed as [num_blocks × block_size, ...].
    """
    if quantized(cache.dtype):
        k, v = quantize_kv(k), quantize_kv(v)
    rows = cache.view(2, -1, *cache.shape[-2:])               # [2, num_blocks·bs, kvh, hd]
    rows[0].index_copy_(0, slots, k)
    rows[1].index_copy_(0, slots, v)


def attend(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Every request of the step attends over its own context (this step's K/V already stored).

    Args:
        q: [T, n_heads, head_dim] queries of the flat batch (RoPE applied).
        cache: one layer's K and V pools, [2, num_blocks, block_size, n_kv_heads, head_dim] in
            q's dtype, or int8 rows of the 8-bit format (`engine.kv_quant`). Decode rows read
            the 8-bit rows in place on the kernel path; every other path attends over the
            dequantized blocks of its context (`dequantized_context`).
        meta: spans of this step.
    Returns:
        [T, n_heads, head_dim] attention output, dtype of q.
    """
    if not meta.seqs:
        return decode_attention(q, cache, meta)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[:meta.num_decode] = decode_attention(q[:meta.num_decode], cache, meta)
    kernel = meta.kernels and q.dtype == torch.bfloat16 and q.shape[-1] == 64 \
        and genserve_kernels.prefill_kernel_available()
    for s in meta.seqs:
        piece = q[s.q_start:s.q_end]
        piece_cache = cache
        if quantized(cache.dtype):
            piece_cache, s = dequantized_context(cache, s, q.dtype)
        if kernel:
            out[s.q_start:s.q_end] = torch.ops.genserve.paged_prefill(
                piece, piece_cache[0], piece_cache[1], s.blocks, s.context_len - len(piece),
                q.shape[-1] ** -0.5)
        else:
            out[s.q_start:s.q_end] = prefill_attention(piece, piece_cache, s)
    return out


def dequantized_context(cache: torch.Tensor, span: SeqSpan,
                        dtype: torch.dtype) -> tuple[torch.Tensor, SeqSpan]:
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
