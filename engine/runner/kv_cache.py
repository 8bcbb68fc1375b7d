"""The paged K/V tensors, sized from a memory budget or from the device's free memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.kv_quant import quantized, row_bytes
from engine.core.kv_groups import KVGroups
from engine.model.config import ModelArgs
from engine.runner.huge_pages import advise_huge_pages, collapse_huge_pages


def stored_row(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """How one cached head vector (one token, one KV head, K or V) is stored: (elements, bytes per
    element) — (head_dim, the dtype's size), or, when `dtype` is int8, the 8-bit format's row as
    one-byte elements (`engine.attention.kv_quant.row_bytes`: 66 for head_dim 64). Raises ValueError for
    int8 with a head_dim that is not a multiple of 32."""
    return (row_bytes(head_dim), 1) if quantized(dtype) else (head_dim, _element_size(dtype))


def head_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one cached head vector: elements × bytes per element of `stored_row`."""
    elements, elem = stored_row(head_dim, dtype)
    return elements * elem


def kv_groups(args: ModelArgs) -> KVGroups:
    """The KV groups of `args`'s layers (`engine.core.kv_groups`): one group of every layer unless
    global and sliding-window layers mix."""
    return KVGroups.for_layers(args.sliding_windows, args.max_context)


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across the layers of a KV group (all layers, for a model without
    sliding windows): group layers × 2 (K, V) × block × kv_heads × head bytes.

    For the reference 7B model in fp16 (docs/design.md): 32 × 2 × 16 × 32 × 128 × 2 = 8,388,608 bytes (8.39 MB);
    for SmolLM2-135M in bf16: 30 × 2 × 16 × 3 × 64 × 2 = 368,640 bytes; in the 8-bit format
    (int8): 30 × 2 × 16 × 3 × 66 = 190,080 bytes.
    """
    return kv_groups(args).group_size * 2 * block_size * args.n_kv_heads * head_bytes(args.head_dim, dtype)


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    """How many blocks a KV pool holds, and the arithmetic behind the number.

    Attributes:
        memory_bytes: device memory the sizing started from, bytes.
        weight_bytes: of which the weights take, bytes.
        reserve_bytes: of which kept for activations, bytes.
        pool_bytes: memory_bytes − weight_bytes − reserve_bytes, bytes (the pool's budget).
        bytes_per_token: 2 (K, V) × layers × kv_heads × head_dim × element bytes.
        block_size: tokens per block.
        num_blocks: ⌊pool_bytes / (block_size × bytes_per_token)⌋.
    """

    memory_bytes: int
    weight_bytes: int
    reserve_bytes: int
    pool_bytes: int
    bytes_per_token: int
    block_size: int
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: block_size × bytes_per_token."""
        return self.block_size * self.bytes_per_token

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool: num_blocks × block_size."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """One line for the start-up log, e.g. "KV pool: 7152 blocks of 16 tokens (114432 tokens,
        60.00 GB = 80.00 GB − 14.00 GB weights − 6.00 GB reserve; 524288 B per token)"."""
        gb = 1e9
        return (f"KV pool: {self.num_blocks} blocks of {self.block_size} tokens ({self.num_tokens} "
                f"tokens, {self.pool_bytes / gb:.2f} GB = {self.memory_bytes / gb:.2f} GB − "
                f"{self.weight_bytes / gb:.2f} GB weights − {self.reserve_bytes / gb:.2f} GB reserve; "
                f"{self.bytes_per_token} B per token)")


def kv_pool_size(memory_bytes: int, weight_bytes: int, reserve_bytes: int, *, n_layers: int,
                 n_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int) -> KVPoolSize:
    """Size the KV pool from device memory: what is left after the weights and an activation reserve.

    The design's arithmetic (docs/design.md, "memory"), generalised: an 80 GB GPU, 14 GB of FP16
    weights (7 × 10^9 parameters × 2 bytes) and a 6 GB reserve leave 60 GB (decimal gigabytes);
    one token of a 32-layer model with 32 KV heads of size 128 in FP16 takes
    2 × 32 × 32 × 128 × 2 = 524,288 bytes, a 16-token block 8,388,608 bytes, so the pool holds
    ⌊60 × 10^9 / 8,388,608⌋ = 7,152 blocks = 114,432 tokens. On a device, pass the free memory
    measured after the weights were loaded as `memory_bytes` and 0 as `weight_bytes`.

    Args:
        memory_bytes: device memory available to weights + pool + activations, bytes.
        weight_bytes: memory the weights take (or will take), bytes.
        reserve_bytes: memory kept for the forward pass's activations, bytes.
        n_layers, n_kv_heads, head_dim: the model's shape.
        dtype_bytes: bytes per cached element (2 for fp16/bf16, 4 for fp32).
        block_size: tokens per block.

    Returns:
        The pool's size with its arithmetic (`KVPoolSize`).

    Raises:
        ValueError: a negative or zero shape value, or fewer than 2 blocks fit (the message gives
            the arithmetic).
    """
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes), ("block_size", block_size)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    per_token = 2 * n_layers * n_kv_heads * head_dim * dtype_bytes
    pool = int(memory_bytes) - int(weight_bytes) - int(reserve_bytes)
    size = KVPoolSize(int(memory_bytes), int(weight_bytes), int(reserve_bytes), pool, per_token,
                      block_size, max(pool, 0) // (block_size * per_token))
    if size.num_blocks < 2:
        raise ValueError(f"{size.describe()}: fewer than 2 blocks fit; give the pool more memory "
                         "(free device memory, lower the activation reserve, or raise --kv-pool-gib)")
    return size


def model_pool_size(args: ModelArgs, block_size: int, dtype: torch.dtype, memory_bytes: int,
                    weight_bytes: int = 0, reserve_bytes: int = 0) -> KVPoolSize:
    """`kv_pool_size` for `args`'s KV heads with rows as the pool stores them in `dtype`
    (`stored_row`: the 8-bit format's rows carry their scales), a block holding one KV group's
    layers (`kv_groups`; all layers without sliding windows): the one sizing rule of the CPU
    budget (`--kv-pool-gib`) and the CUDA device's free memory alike.

    Raises:
        ValueError: fewer than 2 blocks fit (the message gives the arithmetic).
    """
    width, elem = stored_row(args.head_dim, dtype)
    return kv_pool_size(memory_bytes, weight_bytes, reserve_bytes, n_layers=kv_groups(args).group_size,
                        n_kv_heads=args.n_kv_heads, head_dim=width, dtype_bytes=elem, block_size=block_size)


def device_pool_size(args: ModelArgs, block_size: int, dtype: torch.dtype, device: torch.device,
                     reserve_bytes: int) -> KVPoolSize:
    """Size the pool on a CUDA `device` whose weights are already loaded: its free memory now
    (`torch.cuda.mem_get_info`, after emptying torch's cache) minus `reserve_bytes`.

    Raises:
        ValueError: fewer than 2 blocks fit, or `device` is not a CUDA device.
    """
    if device.type != "cuda":
        raise ValueError(f"device pool sizing needs a CUDA device, got {device}")
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return model_pool_size(args, block_size, dtype, free, 0, reserve_bytes)


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor of `shape` and `dtype` on `device`. On the CPU it asks for huge pages
    before the zeros first touch it (`engine.runner.huge_pages.advise_huge_pages`), then collapses what
    malloc handed out already touched (`collapse_huge_pages`)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pool = torch.empty(shape, dtype=dtype)
    advised = advise_huge_pages(pool)
    pool.zero_()
    if advised:
        collapse_huge_pages(pool)
    return pool


class KVCache:
    """Per-layer K/V block storage.

    Layout of each K/V tensor: `[2, num_blocks, block_size, n_kv_heads, head_dim]` in `dtype`, or
    `[2, num_blocks, block_size, n_kv_heads, row_bytes(head_dim)]` int8 when `dtype` is int8 (the
    8-bit format of `engine.attention.kv_quant`: each row's int8 numbers, then its scales' exponents); index 0 of
    the first dimension is the K pool, 1 the V pool. Token position p of a request lives in block
    `block_table[p // block_size]` at offset `p % block_size`, i.e. flat slot
    `block_id * block_size + offset` of each pool's `[num_blocks * block_size, ...]` view. K and V
    are separate pools so that gathering a request's blocks gives its keys as one
    `[tokens, n_kv_heads, head_dim]` run that attention reads without another copy.

    There are `groups.group_size` such tensors (`engine.core.kv_groups`): a model without sliding
    windows has one tensor per layer; when global and sliding layers mix, layer l uses tensor
    `groups.layer_slot[l]` with the block table of its group `groups.layer_group[l]`, so layers of
    different groups share a tensor and a block id stores whichever group holds it.

    On the CPU each tensor asks Linux for transparent huge pages before its first touch
    (`engine.runner.huge_pages`): decode reads scattered blocks, and 4 KB pages cost a TLB miss every few
    KB of them.

    Args:
        args: model shape (layers, kv heads, head dim).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype: element type (the model dtype, or int8 for the 8-bit format).
        device: where the pools live (CPU by default).
        groups: the KV groups; None: one group of every layer (a tensor per layer, one block
            table: what a caller that runs the model with one `AttentionMetadata` needs). The
            engine passes `kv_groups(args)`.
    Attributes:
        groups: the KV groups.
        layers: per layer, its K/V tensor (a tensor appears once per group using its slot).
    Raises:
        ValueError: int8 with a head_dim that is not a multiple of 32.
    """

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", groups: KVGroups | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = groups or KVGroups.single(args.n_layers)
        if len(self.groups.layer_slot) != args.n_layers:
            raise ValueError(f"KV groups for {len(self.groups.layer_slot)} layers, the model has {args.n_layers}")
        shape = (2, num_blocks, block_size, args.n_kv_heads, stored_row(args.head_dim, dtype)[0])
        self.slots = [zeroed_pool(shape, dtype, device) for _ in range(self.groups.group_size)]
        self.layers = [self.slots[j] for j in self.groups.layer_slot]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s K and V into block `dst` in every tensor (copy-on-write)."""
        for slot in self.slots:
            slot[:, dst].copy_(slot[:, src])
