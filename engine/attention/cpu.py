"""The "cpu" attention backend: genserve's CPU kernels where they built, else torch SDPA, over
host metadata (`engine.attention.paged_sdpa`).

Batch-invariant bit for bit (tests/engine/attention/test_attention.py): every decode row and every prefill
piece is computed alone, whatever else is in the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.attention import paged_sdpa
from engine.attention.base import AttentionMetadata, AttentionSpec, StepLayout


@dataclass(frozen=True)
class PieceContexts:
    """A step's prefill pieces grouped by the context they extend, for `paged_prefill_pieces`.

    Attributes:
        pieces: int64 [P, 4] on the device: per piece (its first row in the flat batch, its rows,
            its first position, its context's row in `tables`), in flat-batch order.
        tables: int64 [S, W]: each context's block table in position order, padded with block 0
            to the longest (W blocks).
    """

    pieces: torch.Tensor
    tables: torch.Tensor


def piece_contexts(layout: StepLayout) -> tuple[list[int], list[int], int]:
    """`PieceContexts`' integers from a layout: (pieces flat [P × 4], tables flat [S × W], W).

    Consecutive pieces where each starts at the position the one before ends and holds its blocks
    first (one request's prompt cut into pieces) share a context: the last one's blocks.
    """
    rows: list[list[int]] = []
    pieces: list[int] = []
    offset, prev_end, prev_blocks = 0, -1, None
    for p in layout.pieces:
        blocks = layout.piece_blocks[offset:offset + p.num_blocks]
        offset += p.num_blocks
        start = p.context_len - p.length
        if not (rows and start == prev_end and blocks[:len(prev_blocks)] == prev_blocks):
            rows.append([])
        rows[-1] = blocks
        pieces += [p.q_start, p.length, start, len(rows) - 1]
        prev_end, prev_blocks = p.context_len, blocks
    width = max((len(r) for r in rows), default=0)
    return pieces, [b for r in rows for b in (*r, *[0] * (width - len(r)))], width


class CpuBackend:
    """Attention on the CPU: `paged_sdpa.attend` with genserve's kernels or with torch SDPA.

    Args:
        kernels: genserve's CPU kernels run the decode rows and, where the CPU has AVX512-BF16
            or AVX2 + FMA and no usable AMX, the bf16 prefill pieces of head_dim 64 (name
            "cpu-kernels"; with AMX torch's flash attention runs them); else torch SDPA
            ("cpu-sdpa").
    """

    int8_kv: ClassVar[bool] = True          # the kernels read the 8-bit rows; SDPA dequantizes
    layer_specs: ClassVar[bool] = True      # the torch paths of paged_sdpa honour them
    cuda_graphs: ClassVar[bool] = False
    prefill_masks = True                    # SDPA's prefill: pieces the kernel does not run (AMX, fp32)

    def __init__(self, kernels: bool) -> None:
        self.kernels = kernels
        self.name = "cpu-kernels" if kernels else "cpu-sdpa"
        self.decode_masks = not kernels     # genserve's decode kernel reads the lengths

    def host_ints(self, layout: StepLayout) -> list[list[int]]:
        """With the kernels and prefill pieces: `piece_contexts`' two lists; else none."""
        if not (self.kernels and layout.pieces):
            return []
        pieces, tables, _ = piece_contexts(layout)
        return [pieces, tables]

    def step_state(self, ints: Sequence[torch.Tensor], layout: StepLayout, num_blocks: int,
                   device: torch.device) -> Any:
        """A `PieceContexts` over `host_ints`' tensors where it gave them (the kernels' one call
        for every prefill piece of a layer, `paged_sdpa.attend`); else None."""
        if not ints:
            return None
        pieces = ints[0].view(-1, 4)
        contexts = int(pieces[-1, 3]) + 1          # numbered in flat-batch order from 0
        return PieceContexts(pieces, ints[1].view(contexts, -1))

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        """See `AttentionBackend.attend`: `paged_sdpa.attend`."""
        return paged_sdpa.attend(q, cache, meta, self.kernels, spec)
