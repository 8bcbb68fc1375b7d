"""The "cpu" attention backend: genserve's CPU kernels where they built, else torch SDPA, over
host metadata (`engine.attention.paged_sdpa`).

Batch-invariant bit for bit (tests/engine/test_attention.py): every decode row and every prefill
piece is computed alone, whatever else is in the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from engine.attention import paged_sdpa
from engine.attention.base import AttentionMetadata, StepLayout


class CpuBackend:
    """Attention on the CPU: `paged_sdpa.attend` with genserve's kernels or with torch SDPA.

    Args:
        kernels: genserve's CPU kernels run the decode rows and, where the CPU has AVX512-BF16
            or AVX2 + FMA and no usable AMX, the bf16 prefill pieces of head_dim 64 (name
            "cpu-kernels"; with AMX torch's flash attention runs them); else torch SDPA
            ("cpu-sdpa").
    """

    int8_kv: ClassVar[bool] = True          # the kernels read the 8-bit rows; SDPA dequantizes
    cuda_graphs: ClassVar[bool] = False
    prefill_masks = True                    # SDPA's prefill: pieces the kernel does not run (AMX, fp32)

    def __init__(self, kernels: bool) -> None:
        self.kernels = kernels
        self.name = "cpu-kernels" if kernels else "cpu-sdpa"
        self.decode_masks = not kernels     # genserve's decode kernel reads the lengths

    def host_ints(self, layout: StepLayout) -> list[list[int]]:
        """None beyond the common metadata."""
        return []

    def step_state(self, ints: Sequence[torch.Tensor], layout: StepLayout, num_blocks: int,
                   device: torch.device) -> Any:
        """None."""
        return None

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """See `AttentionBackend.attend`: `paged_sdpa.attend`."""
        return paged_sdpa.attend(q, cache, meta, self.kernels)
