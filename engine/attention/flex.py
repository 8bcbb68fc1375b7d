"""The "flex" attention backend: PyTorch FlexAttention over the flat batch and the whole pool.

The step's mask is a block mask built from its segments and block tables: which 128-key tiles of
the pool each 128-query tile may touch, and a `mask_mod` that maps a pool slot back to its position
in the query's request (vLLM's FlexAttention backend does the same, "physical to logical" block
map). Compiled with `torch.compile` on CUDA; the eager reference runs on the CPU (tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from engine.attention.base import AttentionMetadata, AttentionSpec, StepLayout

FLEX_TILE = 128                       # FlexAttention's default tile (queries and keys), tokens


class FlexBackend:
    """FlexAttention over the flat batch and the whole pool, with a per-step block mask.

    Args:
        compiled: run `torch.compile(flex_attention, dynamic=True)` (its fused Triton kernel on
            CUDA); False runs the eager reference, which materialises [H, T, pool] scores (CPU
            tests).
    Raises:
        ImportError: this torch has no FlexAttention.
    """

    int8_kv: ClassVar[bool] = False
    cuda_graphs: ClassVar[bool] = False
    layer_specs: ClassVar[bool] = False     # no sliding windows, softcaps or other scales yet
    decode_masks = False
    prefill_masks = False
    name = "flex"

    def __init__(self, compiled: bool) -> None:
        from torch.nn.attention.flex_attention import flex_attention
        self._flex = torch.compile(flex_attention, dynamic=True) if compiled else flex_attention

    @staticmethod
    def padded_queries(tokens: int) -> int:
        """Query rows of a step's call: a power of two ≥ `tokens`, at least FLEX_TILE. The
        compiled kernel is specialised on the block mask's lengths, so steps are padded to at
        most six sizes up to 4,096 rows instead of one per token count."""
        n = FLEX_TILE
        while n < tokens:
            n *= 2
        return n

    @staticmethod
    def kv_tile(block_size: int) -> int:
        """Keys per tile of the block mask: FLEX_TILE rounded down to whole blocks (≥ 1 block),
        so a block never straddles two tiles."""
        return block_size * max(1, FLEX_TILE // block_size)

    def host_ints(self, layout: StepLayout) -> list[list[int]]:
        """[segment of each query row, position of each query row, then (segment, block, logical
        index) of every table entry as three lists, key tiles per query tile, the tiles' indices
        padded to the widest query tile]. Query rows are padded to `padded_queries`; padding rows
        belong to segment S (= len(segments)), which holds no block, so they attend nothing."""
        spans, block_size = layout.segments, layout.block_size
        kv_tile = self.kv_tile(block_size)
        q_seg: list[int] = []
        q_pos: list[int] = []
        e_seg: list[int] = []
        e_block: list[int] = []
        e_logical: list[int] = []
        tiles: dict[int, set[int]] = {}
        q = 0
        for i, (start, length, table, _) in enumerate(spans):
            used = list(table[:-(-(start + length) // block_size)])
            q_seg.extend([i] * length)
            q_pos.extend(range(start, start + length))
            e_seg.extend([i] * len(used))
            e_block.extend(used)
            e_logical.extend(range(len(used)))
            kv = {b * block_size // kv_tile for b in used}
            for t in range(q // FLEX_TILE, (q + length - 1) // FLEX_TILE + 1):
                tiles.setdefault(t, set()).update(kv)
            q += length
        rows = self.padded_queries(q)
        q_seg.extend([len(spans)] * (rows - q))
        q_pos.extend([0] * (rows - q))
        n_q = rows // FLEX_TILE
        width = max((len(v) for v in tiles.values()), default=1)
        counts = [len(tiles.get(t, ())) for t in range(n_q)]
        indices = [k for t in range(n_q)
                   for k in sorted(tiles.get(t, ())) + [0] * (width - len(tiles.get(t, ())))]
        return [q_seg, q_pos, e_seg, e_block, e_logical, counts, indices]

    def step_state(self, ints: Sequence[torch.Tensor], layout: StepLayout, num_blocks: int,
                   device: torch.device) -> Any:
        """The step's `BlockMask` (query tiles × key tiles of the pool, plus `mask_mod`)."""
        from torch.nn.attention.flex_attention import BlockMask

        spans, block_size = layout.segments, layout.block_size
        q_seg, q_pos, e_seg, e_block, e_logical, counts, indices = ints
        p2l = torch.full((len(spans) + 1, num_blocks), -1, dtype=torch.long, device=device)
        p2l[e_seg, e_block] = e_logical                     # segment × pool block → logical block
        bs = block_size

        def mask_mod(b, h, qi, kv):                          # noqa: ARG001 — FlexAttention's signature
            logical = p2l[q_seg[qi], kv // bs]
            return (logical >= 0) & (logical * bs + kv % bs <= q_pos[qi])

        n_q = counts.numel()
        return BlockMask.from_kv_blocks(
            counts.to(torch.int32).view(1, 1, n_q), indices.to(torch.int32).view(1, 1, n_q, -1),
            BLOCK_SIZE=(FLEX_TILE, self.kv_tile(block_size)), mask_mod=mask_mod,
            seq_lengths=(q_seg.numel(), num_blocks * block_size))

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        """See `AttentionBackend.attend`; keys are the pool viewed [1, kv_heads, pool, hd],
        queries padded with zero rows to the block mask's length (their outputs dropped)."""
        if spec is not None:
            raise NotImplementedError(f"the {self.name} attention backend has no sliding windows, softcaps or other scales")
        t, h, hd = q.shape
        n_kv = cache.shape[-2]
        keys = cache[0].view(-1, n_kv, hd).transpose(0, 1)[None]
        values = cache[1].view(-1, n_kv, hd).transpose(0, 1)[None]
        rows = meta.state.seq_lengths[0]
        queries = q.new_zeros(1, h, rows, hd)
        queries[0, :, :t] = q.transpose(0, 1)
        out = self._flex(queries, keys, values, block_mask=meta.state,
                         scale=hd ** -0.5, enable_gqa=h != n_kv)          # [1, H, rows, hd]
        return out[0, :, :t].transpose(0, 1)
