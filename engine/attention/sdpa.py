"""The "sdpa" attention backend: torch's fused SDPA over the paged KV cache, on any device.

The same two functions as the CPU backend's fallback (`engine.attention.paged_sdpa`): decode rows
in one batched call over gathered keys padded to 64, prefill pieces one call each, with masks built
on the device. The reference every other backend is probed against, and the attention inside
the CUDA-graph decode steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from engine.attention import paged_sdpa
from engine.attention.base import AttentionMetadata, AttentionSpec, StepLayout


class SdpaBackend:
    """`paged_sdpa.attend` on the model's device, without genserve's kernels."""

    int8_kv: ClassVar[bool] = True          # dequantizes the blocks it reads
    layer_specs: ClassVar[bool] = True      # the torch paths of paged_sdpa honour them
    cuda_graphs: ClassVar[bool] = True
    decode_masks = True
    prefill_masks = True
    name = "sdpa"

    def host_ints(self, layout: StepLayout) -> list[list[int]]:
        """None beyond the common metadata."""
        return []

    def step_state(self, ints: Sequence[torch.Tensor], layout: StepLayout, num_blocks: int,
                   device: torch.device) -> Any:
        """None."""
        return None

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        """See `AttentionBackend.attend`: `paged_sdpa.attend` without kernels."""
        return paged_sdpa.attend(q, cache, meta, spec=spec)
