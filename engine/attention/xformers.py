"""The "xformers" attention backends: xformers `memory_efficient_attention` over the flat batch.

One block-diagonal bias covers the step: `PagedBlockDiagonalCausalWithOffsetPaddedKeysMask`
(keys read in place through the block tables, "xformers"), or, when no xformers kernel takes the
paged mask, `BlockDiagonalCausalWithOffsetPaddedKeysMask` over keys gathered per segment
("xformers-gathered"). Its kernels need CUDA; its mask classes work on the CPU (tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from engine.attention.base import AttentionMetadata, AttentionSpec, SegmentInts, StepLayout


def xformers_step_bias(spans: Sequence[SegmentInts], block_size: int, paged_keys: bool,
                       ints: Sequence[torch.Tensor] | None = None,
                       device: torch.device | str = "cpu") -> Any:
    """The xformers attention bias of a step: one block-diagonal block per segment (a decode row
    is a segment of one query), causal with each segment's offset (its queries are the last
    `length` of its `start + length` keys), keys padded per segment to the widest block table.

    Args:
        spans: the step's segments; block_size: tokens per block (xformers' page size).
        paged_keys: `PagedBlockDiagonalCausalWithOffsetPaddedKeysMask` (keys in the pool, read
            through the block tables) if True, else `BlockDiagonalCausalWithOffsetPaddedKeysMask`
            (segment i's keys gathered at [i × padding, i × padding + its context)).
        ints: the uploaded `XformersBackend.host_ints` lists (None: made here on `device`).
    Returns:
        The bias; its `.materialize(shape)` works on CPU.
    Raises:
        ImportError: xformers is not installed.
    """
    from xformers.ops.fmha import attn_bias as xb

    host = XformersBackend.lists(spans, block_size)
    if ints is None:
        ints = [torch.tensor(x, dtype=torch.long, device=device) for x in host]
    q_start, kv_start, kv_lens, tables = host
    q_start_t, kv_start_t, kv_lens_t, tables_t = (x.to(torch.int32) for x in ints)
    q_lens = [b - a for a, b in zip(q_start, q_start[1:])]
    width = len(tables) // len(spans)
    q_info = xb._SeqLenInfo(seqstart=q_start_t, max_seqlen=max(q_lens), min_seqlen=min(q_lens),
                            seqstart_py=q_start)
    k_info = xb._PaddedSeqLenInfo(seqstart=kv_start_t, max_seqlen=max(kv_lens),
                                  min_seqlen=min(kv_lens), seqstart_py=kv_start, seqlen=kv_lens_t,
                                  seqlen_py=kv_lens, padding=width * block_size)
    if paged_keys:
        return xb.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(
            q_seqinfo=q_info, k_seqinfo=k_info, block_tables=tables_t.view(len(spans), width),
            page_size=block_size)
    return xb.BlockDiagonalCausalWithOffsetPaddedKeysMask(q_seqinfo=q_info, k_seqinfo=k_info)


class XformersBackend:
    """xformers `memory_efficient_attention` over the flat batch with one block-diagonal bias.

    Args:
        paged_keys: keys read in place through the block tables (name "xformers"); False:
            each segment's blocks gathered first ("xformers-gathered").
    Raises:
        ImportError: xformers is not installed.
    """

    int8_kv: ClassVar[bool] = False
    cuda_graphs: ClassVar[bool] = False
    layer_specs: ClassVar[bool] = False     # no sliding windows, softcaps or other scales yet
    decode_masks = False
    prefill_masks = False

    def __init__(self, paged_keys: bool) -> None:
        from xformers.ops import fmha
        self._fmha = fmha
        self.paged_keys = paged_keys
        self.name = "xformers" if paged_keys else "xformers-gathered"

    @staticmethod
    def lists(spans: Sequence[SegmentInts], block_size: int) -> list[list[int]]:
        """[query starts (S + 1), padded key starts (S + 1), contexts (S), block tables padded
        with block 0 to the widest, row after row]."""
        ends = [start + length for start, length, _, _ in spans]
        width = max(-(-end // block_size) for end in ends)
        q_start = [0]
        for _, length, _, _ in spans:
            q_start.append(q_start[-1] + length)
        kv_start = [i * width * block_size for i in range(len(spans) + 1)]
        tables = []
        for (_, _, table, _), end in zip(spans, ends):
            used = list(table[:-(-end // block_size)])
            tables.extend(used + [0] * (width - len(used)))
        return [q_start, kv_start, ends, tables]

    def host_ints(self, layout: StepLayout) -> list[list[int]]:
        """See `lists`."""
        return self.lists(layout.segments, layout.block_size)

    def step_state(self, ints: Sequence[torch.Tensor], layout: StepLayout, num_blocks: int,
                   device: torch.device) -> Any:
        """(bias, block tables int64 [S, width]) for `attend`."""
        bias = xformers_step_bias(layout.segments, layout.block_size, self.paged_keys, ints, device)
        return bias, ints[3].view(len(layout.segments), -1)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        """See `AttentionBackend.attend`; queries as [1, T, kv_heads, group, hd] (xformers' BMGHK
        layout for GQA), keys expanded (no copy) over the group."""
        if spec is not None:
            raise NotImplementedError(f"the {self.name} attention backend has no sliding windows, softcaps or other scales")
        t, h, hd = q.shape
        n_kv = cache.shape[-2]
        group = h // n_kv
        bias, tables = meta.state
        if self.paged_keys:
            keys, values = cache[0], cache[1]
        else:
            keys, values = cache[0][tables], cache[1][tables]    # [S, width, bs, kvh, hd]
        keys = keys.reshape(1, -1, n_kv, 1, hd).expand(-1, -1, -1, group, -1)
        values = values.reshape(1, -1, n_kv, 1, hd).expand(-1, -1, -1, group, -1)
        out = self._fmha.memory_efficient_attention_forward(
            q.reshape(1, t, n_kv, group, hd), keys, values, attn_bias=bias, scale=hd ** -0.5)
        return out.reshape(t, h, hd)
