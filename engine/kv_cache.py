"""The paged K/V tensors, sized from a memory budget."""

from __future__ import annotations

import torch

from engine.model.llama import ModelArgs


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers: layers × 2 (K, V) × block × kv_heads × head_dim × elem.

    For the reference 7B model in fp16 (docs/design.md): 32 × 2 × 16 × 32 × 128 × 2 = 8,388,608 bytes (8.39 MB);
    for SmolLM2-135M in bf16: 30 × 2 × 16 × 3 × 64 × 2 = 368,640 bytes.
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    return args.n_layers * 2 * block_size * args.n_kv_heads * args.head_dim * elem


class KVCache:
    """Per-layer K/V block storage.

    Layout per layer: `[2, num_blocks, block_size, n_kv_heads, head_dim]` in `dtype`; index 0 of
    the first dimension is the K pool, 1 the V pool. Token position p of a request lives in block
    `block_table[p // block_size]` at offset `p % block_size`, i.e. flat slot
    `block_id * block_size + offset` of each pool's `[num_blocks * block_size, ...]` view. K and V
    are separate pools so that gathering a request's blocks gives its keys as one
    `[tokens, n_kv_heads, head_dim]` run that attention reads without another copy.

    Args:
        args: model shape (layers, kv heads, head dim).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype: element type (bf16 on CPU by default).
    """

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_blocks, block_size, args.n_kv_heads, args.head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype) for _ in range(args.n_layers)]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s K and V into block `dst` in every layer (copy-on-write)."""
        for layer in self.layers:
            layer[:, dst].copy_(layer[:, src])

    @staticmethod
    def num_blocks_for_budget(args: ModelArgs, block_size: int, dtype: torch.dtype,
                              budget_bytes: int) -> int:
        """Blocks that fit in `budget_bytes` (floor); raises ValueError if fewer than 2."""
        n = budget_bytes // bytes_per_block(args, block_size, dtype)
        if n < 2:
            raise ValueError(f"KV budget of {budget_bytes} bytes holds {n} blocks; need >= 2")
        return int(n)
