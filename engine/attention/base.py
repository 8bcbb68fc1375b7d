"""The attention interface: what a step's layout is, what every backend is given, and how the
step's keys and values are stored.

One step's tokens arrive as a flat batch `[T = B + C]`: B decode rows (one token each) first,
then the prefill pieces (runs of prompt tokens of one request). Each layer writes the step's new
keys and values into their cache slots (`store_kv`, or fused with RoPE in
`engine.model.layer_ops`), then calls its backend's `attend`, which lets every request attend
over its own context, read through its block table.

* `StepLayout` is the step as integers (per segment: start, length, block table, decode), with
  the slot of every token, the decode rows' padded tables and context lengths, and each prefill
  piece's blocks: the one place the slot formula and the padding are written.
* `build_metadata` turns a layout into the `AttentionMetadata` every layer reads, on the model's
  device, with one host-to-device copy of all the step's integers (and of the runner's own, the
  token ids and positions), then builds the masks the backend reads (`decode_mask`,
  `causal_mask`) there.
* `AttentionBackend` is the protocol each backend of `engine.attention` implements, with its
  capabilities declared as class attributes.

This module is the only part of `engine.attention` the model imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from engine.attention.kv_quant import quantize_kv, quantized

SegmentInts = tuple[int, int, Sequence[int], bool]
"""One segment of a step as integers: (start position, tokens, block table, is a decode row)."""

DECODE_PAD_BLOCKS = 4     # decode keys are padded to a multiple of 4 blocks (64 tokens)
GATHER_GROWTH = 1.25      # a GatherBuffer grows to 1.25× what a step asked for


def padded_blocks(blocks: int) -> int:
    """Blocks a decode row's table is padded to: a multiple of DECODE_PAD_BLOCKS (SDPA's keys
    are then a multiple of 64, and the row's padding does not depend on its neighbours')."""
    return -(-blocks // DECODE_PAD_BLOCKS) * DECODE_PAD_BLOCKS


@dataclass(frozen=True, slots=True)
class PiecePlace:
    """Where one prefill piece sits in a `StepLayout` (integers only).

    Attributes:
        q_start: its first token's row in the flat batch; length: its tokens.
        context_len: keys it attends to, positions [0, context_len) (its last position + 1).
        num_blocks: blocks covering that context, ceil(context_len / block_size).
    """

    q_start: int
    length: int
    context_len: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class StepLayout:
    """A step's segments as host integers, everything attention needs before any tensor exists.

    Attributes:
        block_size: tokens per block.
        segments: (start, length, block table, decode) per segment, decode rows first.
        slots: [T] where each token's K and V go in a layer's pools viewed as rows
            `[num_blocks × block_size, kv_heads, head_dim]`: block × block_size + offset.
        decode_tables: [B × nb] the decode rows' block tables, each padded with block 0 to nb =
            `blocks_per_row`, row after row.
        decode_lens: [B] each decode row's context length (keys it attends to).
        blocks_per_row: nb, `padded_blocks` of the longest decode table (0 with no decode row).
        pieces: one `PiecePlace` per prefill piece, in flat-batch order.
        piece_blocks: the pieces' context blocks, piece after piece (`PiecePlace.num_blocks` each).
    """

    block_size: int
    segments: tuple[SegmentInts, ...]
    slots: list[int]
    decode_tables: list[int]
    decode_lens: list[int]
    blocks_per_row: int
    pieces: tuple[PiecePlace, ...]
    piece_blocks: list[int]

    @property
    def num_decode(self) -> int:
        """B, decode rows at the front of the flat batch."""
        return len(self.decode_lens)

    @property
    def num_tokens(self) -> int:
        """T = B + C, rows of the flat batch."""
        return len(self.slots)

    @classmethod
    def from_segments(cls, segments: Sequence[SegmentInts], block_size: int) -> "StepLayout":
        """The layout of a step whose segments are given in batch order.

        Raises:
            ValueError: a block table does not cover its segment, or a decode row (one token)
                follows a prefill piece.
        """
        slots: list[int] = []
        tables: list[Sequence[int]] = []
        lens: list[int] = []
        pieces: list[PiecePlace] = []
        piece_blocks: list[int] = []
        q = 0
        for start, length, table, decode in segments:
            end = start + length
            if len(table) * block_size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            if decode:
                if pieces or length != 1:
                    raise ValueError("decode rows hold one token and come before prefill pieces")
                tables.append(table)
                lens.append(end)
            else:
                used = -(-end // block_size)
                pieces.append(PiecePlace(q, length, end, used))
                piece_blocks.extend(table[:used])
            q += length
        nb = padded_blocks(max((len(t) for t in tables), default=0))
        padded = [b for t in tables for b in (*t, *[0] * (nb - len(t)))]
        return cls(block_size, tuple(segments), slots, padded, lens, nb, tuple(pieces), piece_blocks)


@dataclass(frozen=True, slots=True)
class PrefillPiece:
    """One prefill piece's slice of the flat batch, with its context on the device.

    Attributes:
        q_start, q_end: its tokens are rows [q_start, q_end) of the flat batch.
        context_len: keys it attends to, positions [0, context_len) (== its last position + 1).
        blocks: int64 [ceil(context_len / block_size)] block ids in position order.
        bias: additive mask [1, 1, q_len, context_len] in the model dtype (`causal_mask`), or
            None for a single query (it attends every key) or a backend that reads no masks.
    """

    q_start: int
    q_end: int
    context_len: int
    blocks: torch.Tensor
    bias: torch.Tensor | None


class GatherBuffer:
    """Memory for the SDPA decode path's gathered keys and values, reused by every layer of every
    step; it only grows (to `GATHER_GROWTH` × the largest request, so contexts that grow a block
    at a time do not reallocate every few steps) and is never shrunk: it holds ≈ 1.25 × the
    largest step's gather until its owner goes. Used from the scheduler thread only.

    Each layer gathers B rows × L keys of K and of V (bytes: 2 · B · L · kv_heads · head_dim ·
    itemsize). Buffers that size, allocated per layer, are handed back to the OS by glibc on free
    and page-faulted in again on the next touch; why that mattered is in docs/benchmarks/kernels.md
    (the "SDPA decode path" entry).
    """

    def __init__(self) -> None:
        self._buf = torch.empty(0)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A 1-D tensor of `numel` elements of `dtype` on `device` (contents undefined), valid
        until the next call; raises RuntimeError (from torch) if the allocation fails."""
        buf = self._buf
        if buf.dtype != dtype or buf.device != torch.device(device) or buf.numel() < numel:
            self._buf = buf = torch.empty(int(numel * GATHER_GROWTH), dtype=dtype, device=device)
        return buf[:numel]


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What one layer's attention computes beyond causal softmax(q·kᵀ / √head_dim)·v: the
    options of `engine.model.config.ModelArgs` that reach attention. A layer whose attention is
    exactly that passes no spec (None), and every backend's fast path serves it.

    Attributes:
        scale: the score scale (head_dim^-½, or Gemma's query_pre_attn_scalar^-½).
        sliding_window: W: a query at position p reads keys p - W + 1 .. p; None: every key.
        softcap: scores become c·tanh(s / c) before the mask and softmax (Gemma 2); None: off.
    """

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None


def window_mask(start: int, end: int, keys: int, window: int | None, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, end - start, keys] of the queries at positions [start, end) over keys
    [0, keys): 0 where the key is causal (j ≤ p) and inside the window (p − j < `window`; None:
    no window), -inf elsewhere."""
    pos = torch.arange(start, end, device=device)[:, None]
    key = torch.arange(keys, device=device)[None, :]
    visible = key <= pos
    if window is not None:
        visible &= pos - key < window
    bias = torch.zeros(end - start, keys, dtype=dtype, device=device)
    return bias.masked_fill_(~visible, float("-inf"))[None, None]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one step, passed explicitly to every layer.

    Attributes:
        slots: int64 [T], each new token's row in a layer's pools (`StepLayout.slots`).
        num_decode: B, decode rows at the front of the flat batch (one query each).
        decode_blocks: int64 [B × nb], the decode rows' padded block tables, row after row.
        decode_bias: additive mask [B, 1, 1, nb × block_size] in the model dtype (`decode_mask`),
            or [B, 1, 1, 0] when the backend reads none.
        decode_lens: int64 [B], each decode row's context length (keys it attends to).
        pieces: one `PrefillPiece` per prefill piece, in flat-batch order (after the decode rows).
        backend: the attention backend every layer calls (`backend.attend(q, cache, meta)`).
        state: the backend's own per-step data (masks, block masks), from its `step_state`.
        gather: where the SDPA decode path gathers keys and values (None: a new tensor per layer).
    """

    slots: torch.Tensor
    num_decode: int
    decode_blocks: torch.Tensor
    decode_bias: torch.Tensor
    decode_lens: torch.Tensor
    pieces: tuple[PrefillPiece, ...]
    backend: "AttentionBackend"
    state: Any = None
    gather: GatherBuffer | None = None


class AttentionBackend(Protocol):
    """What a layer calls for attention in a step; one object per process and model shape
    (`engine.attention.choose_backend`).

    Capabilities (class attributes, read before a backend is chosen):
        int8_kv: reads the 8-bit KV cache format (`engine.attention.kv_quant`).
        cuda_graphs: its steps may be captured in CUDA graphs.
        layer_specs: `attend` honours an `AttentionSpec` (sliding windows, softcaps, another
            scale); a model whose layers pass one runs only on such a backend.
    Attributes:
        name: short name, logged and exported as the metric's `backend` label.
        decode_masks / prefill_masks: whether `attend` reads `AttentionMetadata.decode_bias` /
            `PrefillPiece.bias`; when False they are not built.
    """

    int8_kv: ClassVar[bool]
    cuda_graphs: ClassVar[bool]
    layer_specs: ClassVar[bool]
    name: str
    decode_masks: bool
    prefill_masks: bool

    def host_ints(self, layout: StepLayout) -> list[list[int]]:
        """The backend's own per-step integers, uploaded with the step's metadata."""
        ...

    def step_state(self, ints: Sequence[torch.Tensor], layout: StepLayout, num_blocks: int,
                   device: torch.device) -> Any:
        """The per-step object `attend` reads (`meta.state`), from the uploaded `ints` (int64
        views on `device`, one per `host_ints` list)."""
        ...

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        """q [T, n_heads, head_dim] (RoPE applied), cache [2, num_blocks, block_size, n_kv_heads,
        head_dim] (or the 8-bit rows) with this step's K/V stored → [T, n_heads, head_dim] in q's
        dtype. Scale 1/sqrt(head_dim) unless `spec` says; head h reads KV head h // (n_heads /
        n_kv_heads). A backend without `layer_specs` raises NotImplementedError for a spec."""
        ...


def decode_mask(lens: torch.Tensor, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, 1, keys] of decode rows over their padded keys: -inf at key positions
    ≥ the row's context length `lens` [B] (int64), 0 elsewhere; in `dtype` on `lens`' device.
    With no keys (a backend that reads no decode masks) an empty mask, made without arithmetic."""
    if keys == 0:
        return torch.empty(lens.shape[0], 1, 1, 0, dtype=dtype, device=lens.device)
    positions = torch.arange(keys, device=lens.device)
    bias = torch.zeros(lens.shape[0], keys, dtype=dtype, device=lens.device)
    bias.masked_fill_(positions[None, :] >= lens[:, None], float("-inf"))
    return bias[:, None, None, :]


def causal_mask(start: int, end: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask [1, 1, end - start, end] of the queries at positions [start, end)
    over keys [0, end): 0 where key j ≤ the query's position, -inf elsewhere."""
    pos = torch.arange(start, end, device=device)
    causal = torch.arange(end, device=device)[None, :] <= pos[:, None]
    bias = torch.zeros(end - start, end, dtype=dtype, device=device)
    return bias.masked_fill_(~causal, float("-inf"))[None, None]


def build_metadata(backend: AttentionBackend, layout: StepLayout, dtype: torch.dtype,
                   device: torch.device | str, num_blocks: int, gather: GatherBuffer | None = None,
                   extra: Sequence[Sequence[int]] = (), group_layouts: Sequence[StepLayout] = (),
                   ) -> tuple[AttentionMetadata, tuple[torch.Tensor, ...]] | \
        tuple[list[AttentionMetadata], tuple[torch.Tensor, ...]]:
    """The step's metadata on `device`, with one host-to-device copy.

    Every integer the step needs (slots, decode tables and lengths, each prefill piece's blocks,
    the backend's own lists from `backend.host_ints`, those of every KV group's layout, and the
    caller's `extra` lists) goes into one int64 host tensor (pinned on CUDA), is copied once, and
    is sliced into views there. The masks are then computed there from those views, only those
    the backend reads.

    Args:
        backend: the backend that runs the step; its `step_state` builds `state`.
        layout: the step (KV group 0's block tables).
        dtype: the model dtype (the masks' dtype must match the queries').
        device: where the model's weights and the KV cache live.
        num_blocks: blocks in the KV pool (the paged backends' key axis).
        gather: the SDPA decode path's buffer (see `GatherBuffer`).
        extra: more int lists to upload in the same copy (token ids, positions, rows to sample).
        group_layouts: the same step in KV groups 1 .. G - 1 (their own block tables;
            `engine.runner.inputs.StepInputs.group_layouts`).
    Returns:
        (metadata, the `extra` lists as int64 tensors on `device`, in order); with
        `group_layouts`, the metadata is a list, one per group, group 0 first.
    """
    device = torch.device(device)
    layouts = [layout, *group_layouts]
    per_layout = [[x.slots, x.decode_tables, x.decode_lens, x.piece_blocks, *backend.host_ints(x)]
                  for x in layouts]
    lists = [lst for own in per_layout for lst in own] + list(extra)
    host = torch.tensor([v for x in lists for v in x], dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    views = list(host.to(device, non_blocking=True).split([len(x) for x in lists]))
    metas = []
    for x, own in zip(layouts, per_layout):
        mine, views = views[:len(own)], views[len(own):]
        metas.append(_metadata(backend, x, dtype, device, num_blocks, gather, mine))
    return (metas if group_layouts else metas[0]), tuple(views)


def _metadata(backend: AttentionBackend, layout: StepLayout, dtype: torch.dtype, device: torch.device,
              num_blocks: int, gather: GatherBuffer | None, views: list[torch.Tensor]) -> AttentionMetadata:
    """`layout`'s metadata from its uploaded integers `views` (slots, decode tables, decode
    lengths, pieces' blocks, then the backend's own lists): the masks and the backend's state."""
    slots, tables, lens, piece_blocks = views[:4]
    own_t = views[4:]
    keys = layout.blocks_per_row * layout.block_size if backend.decode_masks else 0
    decode_bias = decode_mask(lens, keys, dtype)
    pieces = []
    offset = 0
    for p in layout.pieces:
        bias = None
        if p.length > 1 and backend.prefill_masks:
            bias = causal_mask(p.context_len - p.length, p.context_len, dtype, device)
        pieces.append(PrefillPiece(p.q_start, p.q_start + p.length, p.context_len,
                                   piece_blocks[offset:offset + p.num_blocks], bias))
        offset += p.num_blocks
    state = backend.step_state(own_t, layout, num_blocks, device)
    return AttentionMetadata(slots, layout.num_decode, tables, decode_bias, lens, tuple(pieces),
                             backend, state, gather)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the step's keys and values into their cache slots.

    Args:
        k, v: [T, n_kv_heads, head_dim] (RoPE already applied to k).
        cache: one layer's pools [2, num_blocks, block_size, n_kv_heads, head_dim] (K, V), or
            int8 [..., row_bytes(head_dim)]: then k and v are stored in the 8-bit format
            (`engine.attention.kv_quant.quantize_kv`).
        slots: int64 [T], rows of the pools viewed as [num_blocks × block_size, ...].
    """
    if quantized(cache.dtype):
        k, v = quantize_kv(k), quantize_kv(v)
    rows = cache.view(2, -1, *cache.shape[-2:])               # [2, num_blocks·bs, kvh, hd]
    rows[0].index_copy_(0, slots, k)
    rows[1].index_copy_(0, slots, v)
