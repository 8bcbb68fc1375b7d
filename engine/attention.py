"""Ragged-batch attention over the paged KV cache.

One step's tokens arrive as a flat list `[T = B + C]` tagged with their request. Each layer
writes the step's new keys and values into their cache slots, then every request attends over
its own context, read through its block table.

Decode rows (one query each) run batched in `decode_attention`; prefill pieces run through torch
`scaled_dot_product_attention`, one call per piece. Both are exact with respect to batching on
CPU — a request's output does not depend on which other requests share the step (the design's
batch-invariance test). A CUDA build would add an xformers
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


DECODE_PAD_BLOCKS = 4     # decode keys are padded to a multiple of 4 blocks (64 tokens)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one step, passed explicitly to every layer.

    Attributes:
        k_slots, v_slots: int64 [T], where each new token's K and V go in the layer cache viewed
            as rows `[num_blocks × 2 × block_size, kv_heads, head_dim]`:
            (block × 2 + {0 for K, 1 for V}) × block_size + offset.
        num_decode: B, decode rows at the front of the flat batch (one query each).
        decode_tables: int64 [B, nb] block tables of the decode rows, padded with block 0 to
            nb = a multiple of DECODE_PAD_BLOCKS.
        decode_mask: bool [B, nb × block_size], True for keys past a row's context (masked).
        seqs: one `SeqSpan` per prefill piece, in flat-batch order (after the decode rows).
    """

    k_slots: torch.Tensor
    v_slots: torch.Tensor
    num_decode: int
    decode_tables: torch.Tensor
    decode_mask: torch.Tensor
    seqs: tuple[SeqSpan, ...]

    @classmethod
    def build(cls, spans: list[tuple[int, int, list[int] | tuple[int, ...], bool]],
              block_size: int) -> "AttentionMetadata":
        """Metadata from `(start_position, num_tokens, block_table, is_decode)` per segment, in
        batch order; decode rows (one token each) must come first.

        Raises ValueError if a block table does not cover its segment, or a decode row follows
        a prefill piece.
        """
        index, offset, seqs, tables, lens = [], [], [], [], []
        q = 0
        for start, length, table, decode in spans:
            end = start + length
            if len(table) * block_size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            pos = torch.arange(start, end)
            tab = torch.tensor(table, dtype=torch.long)
            index.append(tab[pos // block_size])
            offset.append(pos % block_size)
            if decode:
                if seqs or length != 1:
                    raise ValueError("decode rows hold one token and come before prefill pieces")
                tables.append(tab)
                lens.append(end)
            else:
                mask = torch.arange(end)[None, :] <= pos[:, None] if length > 1 else None
                seqs.append(SeqSpan(q, q + length, end, tab, mask))
            q += length
        nb = max((len(t) for t in tables), default=0)
        nb = -(-nb // DECODE_PAD_BLOCKS) * DECODE_PAD_BLOCKS
        decode_tables = torch.zeros(len(tables), nb, dtype=torch.long)
        for i, t in enumerate(tables):
            decode_tables[i, :len(t)] = t
        decode_mask = torch.arange(nb * block_size)[None, :] >= torch.tensor(lens, dtype=torch.long)[:, None]
        block, off = torch.cat(index), torch.cat(offset)
        k_slots = block * (2 * block_size) + off
        return cls(k_slots, k_slots + block_size, len(tables), decode_tables, decode_mask,
                   tuple(seqs))


def decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention of B one-token decode rows over their paged contexts, batched.

    Args:
        q: [B, n_heads, head_dim] queries of the decode rows.
        cache: one layer's blocks [num_blocks, 2, block_size, n_kv_heads, head_dim].
        meta: `decode_tables` [B, nb] and `decode_mask` [B, nb × block_size].
    Returns:
        [B, n_heads, head_dim] in q's dtype.

    Batch-invariant by construction (checked on this CPU row by row against B = 1): the scores
    reduce over head_dim only; the keys are padded to a multiple of 64 and masked with -inf, so
    softmax sums the same lanes plus exact zeros; P·V runs in fp32, whose product here gives a row
    the same bits whatever the padded length (bf16's did not). Query heads are grouped per KV
    head, so K and V are never repeated.
    """
    b, n_heads, hd = q.shape
    kv = cache[meta.decode_tables]                        # [B, nb, 2, bs, kvh, hd]
    n_kv = kv.shape[-2]
    keys = kv[:, :, 0].flatten(1, 2).permute(0, 2, 3, 1)  # [B, kvh, hd, L]
    values = kv[:, :, 1].flatten(1, 2).transpose(1, 2).float()   # [B, kvh, L, hd] fp32
    qg = q.view(b, n_kv, n_heads // n_kv, hd)             # [B, kvh, group, hd]
    scores = torch.matmul(qg, keys).float() * hd ** -0.5  # [B, kvh, group, L] fp32
    scores.masked_fill_(meta.decode_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).view(b, n_heads, hd).to(q.dtype)


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
    rows = cache.view(-1, *cache.shape[-2:])                  # [num_blocks·2·bs, kvh, hd]
    rows.index_copy_(0, meta.k_slots, k)
    rows.index_copy_(0, meta.v_slots, v)
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    if meta.num_decode:
        out[:meta.num_decode] = decode_attention(q[:meta.num_decode], cache, meta)
    for s in meta.seqs:
        blocks = cache[s.block_table]                       # [nb, 2, bs, kvh, hd]
        kv = blocks.transpose(0, 1).flatten(1, 2)[:, : s.context_len]   # [2, L, kvh, hd]
        keys = kv[0].transpose(0, 1).repeat_interleave(group, dim=0)    # [H, L, hd]
        values = kv[1].transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, hd]
        qs = q[s.q_start:s.q_end].transpose(0, 1)                        # [H, ql, hd]
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=s.mask)
        out[s.q_start:s.q_end] = o.transpose(0, 1)
    return out
