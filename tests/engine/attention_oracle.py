"""Test oracles for attention: the dense mask every backend is held to, and step metadata from
segment tuples (what the model runner builds from a plan)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention import CpuBackend
from engine.attention.base import (AttentionBackend, AttentionMetadata, GatherBuffer, SegmentInts,
                                   StepLayout, build_metadata)


def paged_step_mask(spans: Sequence[SegmentInts], block_size: int, num_blocks: int) -> torch.Tensor:
    """The step's attention mask over the whole pool, bool [T, num_blocks × block_size].

    Entry (t, s) is True when token t (flat-batch order, segments in `spans` order) may attend
    pool slot s = block × block_size + offset: the block is in t's block table at logical index
    j, and j × block_size + offset ≤ t's position. A dense reference (it allocates T × pool
    slots); raises ValueError when a table does not cover its segment.
    """
    rows = []
    for start, length, table, _ in spans:
        end = start + length
        if len(table) * block_size < end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        logical = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        for j, block in enumerate(table[:-(-end // block_size)]):
            logical[block * block_size:(block + 1) * block_size] = \
                torch.arange(j * block_size, (j + 1) * block_size)
        pos = torch.arange(start, end)
        rows.append((logical[None, :] >= 0) & (logical[None, :] <= pos[:, None]))
    return torch.cat(rows)


def step_metadata(spans: Sequence[SegmentInts], block_size: int, dtype: torch.dtype = torch.float32,
                  kernels: bool = False, gather: GatherBuffer | None = None, *,
                  backend: AttentionBackend | None = None, device: torch.device | str = "cpu",
                  num_blocks: int = 0) -> AttentionMetadata:
    """The metadata the model runner builds for a step of these segments: with `backend`, or the
    CPU backend with or without genserve's kernels."""
    backend = backend if backend is not None else CpuBackend(kernels)
    meta, _ = build_metadata(backend, StepLayout.from_segments(spans, block_size), dtype, device,
                             num_blocks, gather)
    return meta
