"""Ragged-batch attention over the paged KV cache.

One step's tokens arrive as a flat list `[T = B + C]` tagged with their request. Each layer
writes the step's new keys and values into their cache slots, then every request attends over
its own context, read through its block table.

Path: torch `scaled_dot_product_attention`, one call per request, chosen because on CPU it is
exact with respect to batching — a request's output does not depend on which other requests
share the step (the design's batch-invariance test). A CUDA build would add an xformers
`BlockDiagonalCausalWithOffsetPaddedKeysMask` path here behind the same `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """One request's slice of the flat batch.

    Attributes:
        q_start, q_end: its tokens are rows [q_start, q_end) of the flat batch.
        context_len: keys it attends to, positions [0, context_len) (== its last position + 1).
        block_table: int64 [ceil(context_len / block_size)] block ids in position order.
        mask: bool [q_len, context_len], True where query i may attend key j (j <= its
            position); None for a single query (it attends every key).
    """

    q_start: int
    q_end: int
    context_len: int
    block_table: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one step, passed explicitly to every layer.

    Attributes:
        block_index: int64 [T], the block each new token's K/V is written to.
        block_offset: int64 [T], the offset inside that block.
        seqs: one `SeqSpan` per request in the step, in flat-batch order.
    """

    block_index: torch.Tensor
    block_offset: torch.Tensor
    seqs: tuple[SeqSpan, ...]

    @classmethod
    def build(cls, spans: list[tuple[int, int, list[int] | tuple[int, ...]]],
              block_size: int) -> "AttentionMetadata":
        """Metadata from `(start_position, num_tokens, block_table)` per request, in batch order.

        Raises ValueError if a block table does not cover its request's positions.
        """
        index, offset, seqs = [], [], []
        q = 0
        for start, length, table in spans:
            end = start + length
            if len(table) * block_size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            pos = torch.arange(start, end)
            tab = torch.tensor(table, dtype=torch.long)
            index.append(tab[pos // block_size])
            offset.append(pos % block_size)
            mask = None
            if length > 1:
                mask = torch.arange(end)[None, :] <= pos[:, None]
            seqs.append(SeqSpan(q, q + length, end, tab, mask))
            q += length
        return cls(torch.cat(index), torch.cat(offset), tuple(seqs))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Write the step's K/V into `cache`, then attend each request over its own context.

    Args:
        q: [T, n_heads, head_dim] queries of the flat batch (RoPE applied).
        k, v: [T, n_kv_heads, head_dim] the step's new keys (RoPE applied) and values.
        cache: one layer's K/V blocks, [num_blocks, 2, block_size, n_kv_heads, head_dim];
            same dtype as q.
        meta: slots and spans of this step.
    Returns:
        [T, n_heads, head_dim] attention output, dtype of q. Scale 1/sqrt(head_dim)
        (Vaswani et al. 2017); grouped-query heads share K/V (Ainslie et al. 2023).
    """
    cache[meta.block_index, 0, meta.block_offset] = k
    cache[meta.block_index, 1, meta.block_offset] = v
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    for s in meta.seqs:
        blocks = cache[s.block_table]                       # [nb, 2, bs, kvh, hd]
        kv = blocks.transpose(0, 1).flatten(1, 2)[:, : s.context_len]   # [2, L, kvh, hd]
        keys = kv[0].transpose(0, 1).repeat_interleave(group, dim=0)    # [H, L, hd]
        values = kv[1].transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, hd]
        qs = q[s.q_start:s.q_end].transpose(0, 1)                        # [H, ql, hd]
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=s.mask)
        out[s.q_start:s.q_end] = o.transpose(0, 1)
    return out
