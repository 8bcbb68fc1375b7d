"""Attention backends behind one interface, one chosen per process.

Every backend computes the same thing for a step: each token of the flat batch `[T = B + C]`
attends, causally, over its own request's context, read from the paged KV cache through the
request's block table (`paged_step_mask` writes that mask out densely; it is the definition the
tests hold every backend to). They differ in how:

* `CpuBackend` ("cpu-kernels" / "cpu-sdpa"): `engine.attention.attend` with the metadata built on
  the host, exactly as before backends existed: genserve's CPU kernels when they built
  (`engine.kernels`), else torch SDPA per decode batch and per prefill piece. Batch-invariant bit
  for bit (tests/engine/test_attention.py).
* `SdpaBackend` ("sdpa"): the same two SDPA functions on any torch device, metadata on the device.
* `FlexBackend` ("flex"): PyTorch FlexAttention (`torch.nn.attention.flex_attention`) over the
  flat batch against the whole K/V pool, with a block mask built from the step's segments and
  block tables: which 128-key tiles of the pool each 128-query tile may touch, and a `mask_mod`
  that maps a pool slot back to its position in the query's request (vLLM's FlexAttention
  backend does the same, "physical to logical" block map). Compiled with `torch.compile` on CUDA.
* `XformersBackend` ("xformers", "xformers-gathered"): xformers `memory_efficient_attention` over
  the flat batch with `PagedBlockDiagonalCausalWithOffsetPaddedKeysMask` (keys read in place
  through the block tables), or, when no xformers kernel takes the paged mask,
  `BlockDiagonalCausalWithOffsetPaddedKeysMask` over keys gathered per segment. CUDA only.

Choice (`choose_backend`, once per process for a given device and shape, logged): on the CPU the
`CpuBackend`; on CUDA the first of xformers (paged, then gathered), FlexAttention, SDPA that
imports and passes a probe step against SDPA on the device (so a missing or mismatched xformers
build, or a Triton that cannot compile, falls through). `GENSERVE_ATTENTION=cpu|sdpa|flex|xformers`
(or the executor's `attention` argument) forces one; a forced backend that fails its probe raises.
The chosen backend's `name` is exported as `genserve_attention_backend_info`.

A backend's per-step integers travel with the step's metadata in one host-to-device copy
(`AttentionMetadata.build_on_device`): `host_ints` lists them, `step_state` turns the uploaded
views into the backend's per-step object (`AttentionMetadata.state`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from engine import attention as paged
from engine.attention import AttentionMetadata, Span

log = logging.getLogger(__name__)

ENV = "GENSERVE_ATTENTION"            # forces a backend: cpu, sdpa, flex or xformers
NAMES = ("cpu", "sdpa", "flex", "xformers")
FLEX_TILE = 128                       # FlexAttention's default tile (queries and keys), tokens
PROBE_TOLERANCE = 2e-2                # |probe output − SDPA| allowed in bf16/fp16 (2^-6 ≈ 1.6e-2)


class AttentionBackend(Protocol):
    """What the model calls for attention in a step.

    Attributes:
        name: short name, logged and exported as the metric's `backend` label.
        masks: whether `attend` reads the SDPA masks (`AttentionMetadata.decode_bias`,
            `SeqSpan.bias`); when False they are not built.
    """

    name: str
    masks: bool

    def host_ints(self, spans: Sequence[Span], block_size: int) -> list[list[int]]:
        """The backend's per-step integers, uploaded with the step's metadata."""
        ...

    def step_state(self, ints: Sequence[torch.Tensor], spans: Sequence[Span], block_size: int,
                   num_blocks: int, device: torch.device) -> Any:
        """The per-step object `attend` reads (`meta.state`), from the uploaded `ints` (int64
        views on `device`, one per `host_ints` list)."""
        ...

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, n_heads, head_dim] (RoPE applied), cache [2, num_blocks, block_size, n_kv_heads,
        head_dim] with this step's K/V stored → [T, n_heads, head_dim] in q's dtype. Scale
        1/sqrt(head_dim); head h reads KV head h // (n_heads / n_kv_heads)."""
        ...


class CpuBackend:
    """Today's CPU path: `engine.attention.attend` over host-built metadata (no `state`).

    Args:
        kernels: genserve's CPU kernels run (name "cpu-kernels"), else torch SDPA ("cpu-sdpa").
    """

    masks = True

    def __init__(self, kernels: bool) -> None:
        self.kernels = kernels
        self.name = "cpu-kernels" if kernels else "cpu-sdpa"

    def host_ints(self, spans: Sequence[Span], block_size: int) -> list[list[int]]:
        """None: this backend's metadata is `AttentionMetadata.build`'s host path."""
        return []

    def step_state(self, ints: Sequence[torch.Tensor], spans: Sequence[Span], block_size: int,
                   num_blocks: int, device: torch.device) -> Any:
        """None."""
        return None

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`engine.attention.attend`."""
        return paged.attend(q, cache, meta)


class SdpaBackend(CpuBackend):
    """`engine.attention.attend`'s SDPA functions with metadata on the model's device: decode rows
    in one batched call over gathered keys padded to 64, prefill pieces one call each."""

    def __init__(self) -> None:
        super().__init__(kernels=False)
        self.name = "sdpa"


def paged_step_mask(spans: Sequence[Span], block_size: int, num_blocks: int) -> torch.Tensor:
    """The step's attention mask over the whole pool, bool [T, num_blocks × block_size].

    Entry (t, s) is True when token t (flat-batch order, segments in `spans` order) may attend
    pool slot s = block × block_size + offset: the block is in t's block table at logical index
    j, and j × block_size + offset ≤ t's position. A dense reference for tests (it allocates
    T × pool slots); raises ValueError when a table does not cover its segment.
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


class FlexBackend:
    """FlexAttention over the flat batch and the whole pool, with a per-step block mask.

    Args:
        compiled: run `torch.compile(flex_attention, dynamic=True)` (its fused Triton kernel on
            CUDA); False runs the eager reference, which materialises [H, T, pool] scores (CPU
            tests).
    Raises:
        ImportError: this torch has no FlexAttention.
    """

    masks = False
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

    def host_ints(self, spans: Sequence[Span], block_size: int) -> list[list[int]]:
        """[segment of each query row, position of each query row, then (segment, block, logical
        index) of every table entry as three lists, key tiles per query tile, the tiles' indices
        padded to the widest query tile]. Query rows are padded to `padded_queries`; padding rows
        belong to segment S (= len(spans)), which holds no block, so they attend nothing."""
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

    def step_state(self, ints: Sequence[torch.Tensor], spans: Sequence[Span], block_size: int,
                   num_blocks: int, device: torch.device) -> Any:
        """The step's `BlockMask` (query tiles × key tiles of the pool, plus `mask_mod`)."""
        from torch.nn.attention.flex_attention import BlockMask

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

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """See `AttentionBackend.attend`; keys are the pool viewed [1, kv_heads, pool, hd],
        queries padded with zero rows to the block mask's length (their outputs dropped)."""
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


def xformers_step_bias(spans: Sequence[Span], block_size: int, paged_keys: bool,
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

    masks = False

    def __init__(self, paged_keys: bool) -> None:
        from xformers.ops import fmha
        self._fmha = fmha
        self.paged_keys = paged_keys
        self.name = "xformers" if paged_keys else "xformers-gathered"

    @staticmethod
    def lists(spans: Sequence[Span], block_size: int) -> list[list[int]]:
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

    def host_ints(self, spans: Sequence[Span], block_size: int) -> list[list[int]]:
        """See `lists`."""
        return self.lists(spans, block_size)

    def step_state(self, ints: Sequence[torch.Tensor], spans: Sequence[Span], block_size: int,
                   num_blocks: int, device: torch.device) -> Any:
        """(bias, block tables int64 [S, width]) for `attend`."""
        bias = xformers_step_bias(spans, block_size, self.paged_keys, ints, device)
        return bias, ints[3].view(len(spans), -1)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """See `AttentionBackend.attend`; queries as [1, T, kv_heads, group, hd] (xformers' BMGHK
        layout for GQA), keys expanded (no copy) over the group."""
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


def attend_step(backend: AttentionBackend, q: torch.Tensor, cache: torch.Tensor,
                spans: list[Span], block_size: int) -> torch.Tensor:
    """One attention call of a step whose K/V are already in `cache` (tests and probes).

    Args:
        q: [T, n_heads, head_dim] on the cache's device; cache: [2, num_blocks, block_size,
            n_kv_heads, head_dim]; spans: the step's segments (decode rows first).
    Returns:
        [T, n_heads, head_dim] in q's dtype.
    """
    if isinstance(backend, CpuBackend) and not isinstance(backend, SdpaBackend):
        meta = AttentionMetadata.build(spans, block_size, q.dtype, backend.kernels,
                                       None if backend.kernels else paged.GatherBuffer())
    else:
        meta = AttentionMetadata.build(spans, block_size, q.dtype, backend=backend,
                                       device=cache.device, num_blocks=cache.shape[1])
    return backend.attend(q, cache, meta)


def probe(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, block_size: int,
          n_heads: int, n_kv_heads: int, head_dim: int) -> str | None:
    """Run a small step (a decode row over two blocks, a prefill piece over two blocks, shuffled
    block ids) through `backend` and through `SdpaBackend` on `device`; None when they agree
    within PROBE_TOLERANCE, else why not (the exception, or the difference). Never raises."""
    try:
        g = torch.Generator().manual_seed(0)
        cache = torch.randn(2, 6, block_size, n_kv_heads, head_dim, generator=g).to(device, dtype)
        spans: list[Span] = [(block_size + 2, 1, [3, 1], True), (0, block_size + 3, [5, 2], False)]
        q = torch.randn(block_size + 4, n_heads, head_dim, generator=g).to(device, dtype)
        out = attend_step(backend, q, cache, spans, block_size)
        want = attend_step(SdpaBackend(), q, cache, spans, block_size)
        err = (out.float() - want.float()).abs().max().item()
        if not err <= PROBE_TOLERANCE:
            return f"differs from SDPA by {err:.3g}"
        return None
    except Exception as exc:        # noqa: BLE001 — any failure means: try the next backend
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {first[:200]}"


def choose_backend(device: torch.device | str, dtype: torch.dtype, block_size: int, n_heads: int,
                   n_kv_heads: int, head_dim: int, kernels: bool = False,
                   preferred: str | None = None) -> AttentionBackend:
    """The attention backend for a model on `device` (see the module docstring for the order).

    Made once per process for each (device type, dtype, shape, kernels, preferred): later calls
    return the same object. `preferred` (else `$GENSERVE_ATTENTION`, else automatic) is one of
    NAMES.

    Raises:
        ValueError: `preferred` is not one of NAMES.
        RuntimeError: the preferred backend cannot run here (the message says why).
    """
    preferred = preferred or os.environ.get(ENV) or None
    if preferred is not None and preferred not in NAMES:
        raise ValueError(f"attention backend must be one of {', '.join(NAMES)}; got {preferred!r}"
                         f" (from the executor's attention argument or ${ENV})")
    return _choose(torch.device(device).type, dtype, block_size, n_heads, n_kv_heads, head_dim,
                   kernels, preferred)


@functools.cache
def _choose(device_type: str, dtype: torch.dtype, block_size: int, n_heads: int, n_kv_heads: int,
            head_dim: int, kernels: bool, preferred: str | None) -> AttentionBackend:
    device = torch.device(device_type)
    shape = (device, dtype, block_size, n_heads, n_kv_heads, head_dim)
    if preferred is None:
        preferred = "cpu" if device_type == "cpu" else "auto"
    if preferred == "cpu":
        if device_type != "cpu":
            raise RuntimeError(f"attention backend 'cpu' runs on the CPU only, not {device_type}")
        backend: AttentionBackend = CpuBackend(kernels)
        log.info("attention backend: %s", backend.name)
        return backend
    candidates: list[tuple[str, Any]] = []
    if preferred in ("auto", "xformers"):
        candidates += [("xformers", lambda: XformersBackend(True)),
                       ("xformers", lambda: XformersBackend(False))]
    if preferred in ("auto", "flex"):
        candidates.append(("flex", lambda: FlexBackend(compiled=device_type == "cuda")))
    if preferred in ("auto", "sdpa"):
        candidates.append(("sdpa", SdpaBackend))
    skipped = []
    for name, make in candidates:
        if name != "sdpa" and device_type != "cuda" and preferred == "auto":
            continue                                   # fused backends: CUDA only, unless forced
        try:
            backend = make()
        except ImportError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        why = probe(backend, *shape)
        if why is None:
            if skipped:
                log.info("attention backends skipped: %s", "; ".join(skipped))
            log.info("attention backend: %s", backend.name)
            return backend
        skipped.append(f"{backend.name}: {why}")
    raise RuntimeError(f"attention backend {preferred!r} cannot run on {device_type}: "
                       + "; ".join(skipped))
