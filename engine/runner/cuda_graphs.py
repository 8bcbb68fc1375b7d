"""CUDA graphs for decode-only steps, captured per row bucket (off by default).

A decode step of a 7B model launches ~15 kernels per layer from Python; at a few rows the GPU
waits on those launches more than on memory. vLLM and nano-vllm capture the decode step as a
CUDA graph per batch size bucket and pad the rows up to the bucket; `DecodeGraphs` does the same
for genserve's model: buckets `BUCKETS` rows, and, because the decode attention here gathers each
row's keys into a padded tensor (`engine.attention.paged_sdpa.decode_attention`, SDPA), keys padded to a
power-of-two number of blocks (`key_blocks`), so one graph serves every step of that
(rows, key length) pair. Graphs are captured lazily, on the first step of each pair (the step
itself is then computed by the warm-up run and the replay), and share one memory pool.

Padding rows repeat the step's last real row (token, position, cache slot, block table): they
compute the same values as that row and write the same K/V bits to the same slot, so the cache
is unchanged by them, and their outputs are dropped. Inside a graph the attention is always the
SDPA decode path, whatever backend the executor chose for other steps.

Whether it pays is measured, not assumed: `ModelRunner(..., cuda_graphs=True)` turns it on,
and the GPU check runs the decode benchmark with and without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import DECODE_PAD_BLOCKS, AttentionMetadata, decode_mask
from engine.attention.sdpa import SdpaBackend
from engine.core.plan import StepPlan
from engine.model.transformer import Transformer
from engine.runner.inputs import StepInputs
from engine.runner.kv_cache import KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)     # rows per captured graph (vLLM's small sizes)


def row_bucket(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket ≥ `rows`, or None when `rows` is 0 or above the largest bucket."""
    for b in buckets:
        if rows <= b:
            return b if rows > 0 else None
    return None


def key_blocks(blocks: int) -> int:
    """Blocks per row a graph gathers: the power of two ≥ `blocks`, at least DECODE_PAD_BLOCKS."""
    n = DECODE_PAD_BLOCKS
    while n < blocks:
        n *= 2
    return n


@dataclass(frozen=True, slots=True)
class PaddedDecode:
    """A decode-only step's inputs padded to a graph's shape.

    Attributes:
        rows: the bucket (rows in the graph); real rows come first.
        blocks_per_row: nb, blocks of each row's padded block table (`key_blocks`).
        tokens, positions, slots, lens: [rows] each: token id, position, cache slot
            (block × block_size + offset) and context length (position + 1).
        tables: [rows × nb] block tables, each padded with block 0.
    """

    rows: int
    blocks_per_row: int
    tokens: list[int]
    positions: list[int]
    slots: list[int]
    lens: list[int]
    tables: list[int]

    def ints(self) -> list[int]:
        """tokens | positions | slots | lens | tables, the graph's static input order."""
        return self.tokens + self.positions + self.slots + self.lens + self.tables


def pad_decode_step(bucket: int, inputs: StepInputs) -> PaddedDecode:
    """Pad a decode-only step to `bucket` rows by repeating its last row.

    Args:
        bucket: rows of the graph (≥ the step's rows).
        inputs: the step's inputs, all decode rows (their slots, tables and lengths are the
            layout's; only the padding is added here).
    Raises:
        ValueError: the step holds a prefill piece, no row, or more rows than `bucket`.
    """
    layout = inputs.layout
    rows = layout.num_decode
    if not rows or rows > bucket or layout.pieces:
        raise ValueError(f"a graph step holds 1..{bucket} decode rows")
    nb = key_blocks(max(len(table) for _, _, table, _ in layout.segments))
    tables: list[int] = []
    for _, _, table, _ in layout.segments:
        tables.extend([*table, *[0] * (nb - len(table))])
    pad = bucket - rows
    return PaddedDecode(bucket, nb, inputs.token_ids + inputs.token_ids[-1:] * pad,
                        inputs.positions + inputs.positions[-1:] * pad,
                        layout.slots + layout.slots[-1:] * pad,
                        layout.decode_lens + layout.decode_lens[-1:] * pad,
                        tables + tables[-nb:] * pad)


def decode_forward(model: Transformer, kv: KVCache, static: torch.Tensor, rows: int,
                   blocks_per_row: int) -> torch.Tensor:
    """The model over a padded decode step held in one int64 tensor (`PaddedDecode.ints()` on the
    device): what a graph captures, and runs eagerly on any device.

    Returns:
        [rows, dim] final-norm hidden states in the model dtype.
    """
    tokens, positions, slots, lens, tables = static.split([rows] * 4 + [rows * blocks_per_row])
    bias = decode_mask(lens, blocks_per_row * kv.block_size, model.dtype)
    meta = AttentionMetadata(slots, rows, tables, bias, lens, (), SdpaBackend())
    return model(tokens, positions, kv.layers, meta)


@dataclass(slots=True)
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    static: torch.Tensor          # int64 [4 · rows + rows · nb]: the graph's inputs
    out: torch.Tensor             # [rows, dim]: its output


class DecodeGraphs:
    """Captured decode steps of one model and KV cache, keyed by (rows bucket, blocks per row).

    Args:
        model, kv: on a CUDA device (capture needs one).
        buckets: row buckets (`BUCKETS`).
    """

    def __init__(self, model: Transformer, kv: KVCache, buckets: tuple[int, ...] = BUCKETS) -> None:
        self.model = model
        self.kv = kv
        self.buckets = buckets
        self.device = kv.layers[0].device
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None

    def bucket(self, plan: StepPlan) -> int | None:
        """The bucket a plan replays in, or None (not on CUDA, a prefill piece in the step, or
        more rows than the largest bucket): then the step runs eagerly."""
        if self.device.type != "cuda" or not plan.segments:
            return None
        if any(not s.decode for s in plan.segments):
            return None
        return row_bucket(len(plan.segments), self.buckets)

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(rows, blocks per row) of every graph captured so far."""
        return sorted(self._graphs)

    def run(self, bucket: int, inputs: StepInputs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Replay (capturing first if new) the graph of a decode-only step.

        Args:
            bucket: from `bucket(plan)`; inputs: the step's (the integers of its sampling,
                `inputs.sampling_ints`, are uploaded in the same host-to-device copy as the
                graph's inputs).
        Returns:
            (hidden [rows, dim] — a view of the graph's output, valid until the next replay —,
            `inputs.sampling_ints` as int64 tensors on the device, in order).
        """
        padded = pad_decode_step(bucket, inputs)
        ints = padded.ints()
        sampling = inputs.sampling_ints
        host = torch.tensor(ints + [v for x in sampling for v in x], dtype=torch.long).pin_memory()
        up = host.to(self.device, non_blocking=True)
        fixed = len(ints)
        key = (bucket, padded.blocks_per_row)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(bucket, padded.blocks_per_row, up[:fixed])
            self._graphs[key] = entry
        else:
            entry.static.copy_(up[:fixed])
        entry.graph.replay()
        return entry.out[:len(inputs.token_ids)], tuple(up[fixed:].split([len(x) for x in sampling]))

    def _capture(self, rows: int, nb: int, first: torch.Tensor) -> _Graph:
        """Warm up on a side stream with `first` (the real step: its K/V writes are the ones the
        replay repeats), then capture `decode_forward` into the shared pool."""
        static = first.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            decode_forward(self.model, self.kv, static, rows, nb)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = decode_forward(self.model, self.kv, static, rows, nb)
        self._pool = graph.pool()
        return _Graph(graph, static, out)
