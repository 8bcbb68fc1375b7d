"""The model's matrix products: oneDNN's packed weights, genserve's `packed_linear` for few rows,
oneDNN in fixed-size calls or genserve's own weight layout where oneDNN's rows depend on the row
count, and fp32 copies of the bf16 weights on CPUs without bf16 arithmetic (AVX2 only).

Every path a model is packed for gives a row the same bits whatever else is in the batch (see
`pack_weights`); which path runs is chosen at load, by checks and by measurement
(docs/benchmarks/linear.md). A model served from its 4-bit GGUF blocks (`engine.model.quant`) runs
genserve's `q4_linear` over them where it would run `packed_linear`, with the same bits.

Each weight format is a `LinearMethod` with its own `apply` (bf16 through oneDNN, `packed_linear`,
tiled oneDNN, `fma_linear`, fp32 copies; the GGUF's Q4_1, Q8_0 and K-quant blocks; int8 rows),
chosen once per weight when its `PackedWeight` is made (`choose_method`); `linear` only calls it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine import kernels
from engine.model.int8 import Int8Weight, int8_linear

if TYPE_CHECKING:
    from engine.model.kquant import QKWeight

log = logging.getLogger(__name__)


# Rows up to which `linear` (and the C++ decode loop) runs genserve's `packed_linear`; above,
# oneDNN. Both give the same bits, so this is a speed choice only, chosen by measurement (see
# docs/benchmarks/linear.md): it covers decode steps and small mixed steps; prefill runs on oneDNN.
PACKED_LINEAR_MAX_ROWS = 64
# `PackedWeight.max_rows` of a weight genserve packed itself: `packed_linear` runs every product.
ANY_ROWS = 1 << 62
# Rows of every oneDNN call where oneDNN's rows depend on the row count (`PackedWeight.tile_rows`):
# chosen by measurement on such a host (docs/benchmarks/linear.md).
TILE_ROWS = 32
# Row counts of the fp32 calls `fp32_linear` may make (CPUs without bf16 arithmetic): a product of
# M rows is one call of the smallest kept count >= M, or calls of the largest. Which are kept is
# probed per shape at load (`_fp32_copy`); 1-3 rows are not candidates, since the BLAS takes a
# matrix-vector kernel there whose sums round differently.
FP32_CALL_ROWS = (4, 8, 16, 32, 64, 128, 256)
# Output columns per fp32 call for a wide matrix (the LM head, 49,152 columns): the BLAS packs the
# whole weight on every call, and 1,024-column slices ran 1.2-1.5x faster at 4-32 rows, with the
# same bits (each output's sum runs over k alone). Measured in docs/benchmarks/linear.md.
FP32_OUT_CHUNK = 1024
# Output columns per panel of `fma_linear`'s weight layout (`panel_pack`): two ymm registers of fp32.
PANEL = 16


@dataclass(frozen=True)
class PackedWeight:
    """A packed (blocked) copy of a bf16 CPU weight [out, in], from `pack_weights`.

    Attributes:
        tensor: 2 · out · in bytes: oneDNN's tensor (`torch.ops.mkldnn._reorder_linear_weight`),
            a dense bf16 [out, in] tensor in `packed_linear`'s layout (`vnni_pack`), or with
            `fma` bf16 panels [out / 16, in, 16] (`panel_pack`).
        k_chunk: how many k `packed_linear` sums in one chain before adding the chains' sums;
            for a oneDNN tensor the chunk oneDNN uses (`onednn_k_chunk`), so the two give the
            same bits. 0: `packed_linear` cannot reproduce oneDNN here, and oneDNN runs every
            product.
        max_rows: rows up to which `linear` runs `packed_linear` (`PACKED_LINEAR_MAX_ROWS` for a
            oneDNN tensor, above which oneDNN runs; `ANY_ROWS` for genserve's own layout, which
            oneDNN cannot read).
        tile_rows: when > 0, every product is oneDNN's in calls of exactly this many rows (the
            input padded with zero rows): every row is then computed by the one kernel oneDNN
            picks for that row count, whatever the batch (`onednn_tiled`).
        q4: None, or the weight's 4-bit blocks in `q4_linear`'s layout (uint8 [out, in / 32 · 20],
            `engine.model.quant.q4_pack`): then the products up to `max_rows` rows run
            `torch.ops.genserve.q4_linear` with `k_chunk` (the bits `packed_linear` gives with
            that chunk over the bf16 weight), or with `k_chunk` 0 `q4_amx_linear` (the bits of
            oneDNN's AMX product, `onednn_tiled`), and `tile_rows` is not used below that.
        q8: None, or the weight's Q8_0 blocks in `q8_amx_linear`'s layout (uint8 [out, in / 32 ·
            34], `engine.model.quant.amx_pack`): then every product runs
            `torch.ops.genserve.q8_amx_linear`, the bits of the `tile_rows`-row oneDNN calls.
        q4q8: None, or the weight's Q4_1 blocks in `q4q8_linear`'s layout (uint8, `engine.model.
            quant.q4q8_pack`): then every product runs `torch.ops.genserve.q4q8_linear` (the
            4-bit weights exact, the input rounded to 8 bits per row and block of 32: ggml's
            Q4_1 x Q8_1, not the bf16 product's bits; rows independent of the batch).
        q8q8: None, or the weight's Q8_0 blocks in `q8q8_linear`'s layout (uint8, `engine.model.
            quant.q8q8_pack`): then every product runs `torch.ops.genserve.q8q8_linear` (the
            8-bit weights exact, the input rounded as for `q4q8`: ggml's Q8_0 x Q8_0).
        qk: None, or the weight's Q4_K / Q6_K blocks in `qk_linear`'s layout (`engine.model.
            kquant.QKWeight`, row segments of one kind each): then every product runs
            `torch.ops.genserve.qk_linear` (the weights exact, the input rounded to Q8_K, 8 bits
            per row and block of 256: ggml's Q4_K / Q6_K x Q8_K; rows independent of the batch).
        i8: None, or the weight quantized to int8 per output row (`engine.model.int8`): then
            every product runs `int8_linear` (int8 arithmetic, not the bf16 product's bits).
        f32: None, or the weight as fp32 [out, in] (exact: every bf16 is an fp32), on CPUs whose
            oneDNN has no bf16 kernel (no AVX512-BF16, AMX or AVX-NE-CONVERT): then every product
            runs `fp32_linear` in calls of `call_rows` rows, the input widened to fp32 and the
            sums rounded to bf16 once at the end (`tensor` is then the bf16 weight itself).
        call_rows: the row counts `fp32_linear` makes its calls with (ascending; `_fp32_copy`).
        fma: `tensor` is the weight in `panel_pack`'s panels, on CPUs without bf16 arithmetic
            where genserve's `fma_linear` is built: then every product runs `fma_linear` (the
            bf16 weights widened in registers, one fp32 FMA chain over k per output).
    """

    tensor: torch.Tensor
    k_chunk: int
    max_rows: int = PACKED_LINEAR_MAX_ROWS
    tile_rows: int = 0
    q4: torch.Tensor | None = None
    q8: torch.Tensor | None = None
    i8: Int8Weight | None = None
    q4q8: torch.Tensor | None = None
    q8q8: torch.Tensor | None = None
    qk: QKWeight | None = None
    f32: torch.Tensor | None = None
    call_rows: tuple[int, ...] = ()
    fma: bool = False
    method: LinearMethod = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", choose_method(self))


def linear(x: torch.Tensor, weight: torch.Tensor,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """`x @ weight.T` whose rows do not depend on how many rows there are: the packed copy's
    `LinearMethod` (chosen once, when the copy was made: `choose_method`), or without one
    `F.linear` (`PlainMethod`).

    Args:
        x: [M, in_features]; weight: [out_features, in_features], same dtype; packed: None or
            the weight's `PackedWeight` (`pack_weights`, or a quantized format's attach).
    Returns:
        [M, out_features].
    """
    if packed is None:
        return PLAIN.apply(x, weight, None)
    return packed.method.apply(x, weight, packed)


class LinearMethod:
    """How the products of one packed weight run (vLLM's `LinearMethodBase`): one subclass per
    weight format, chosen once per weight by `choose_method` and kept on its `PackedWeight`.
    Every method gives a row the same bits whatever else is in the batch, except where its
    docstring says whose bits it gives instead."""

    name = "?"

    def apply(self, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor:
        """x [M, in] @ weightᵀ → [M, out] in x's dtype, from `packed`'s format."""
        raise NotImplementedError


class PlainMethod(LinearMethod):
    """No packed copy: `F.linear` (cuBLAS on CUDA, whose rows may depend on M: docs/gpu.md says
    how that is checked). On the CPU oneDNN and `F.linear` take a different kernel for a single
    row whose low bits differ from the many-row kernel's on some inputs (seen on real
    down-projection inputs of SmolLM2, not on random ones; every M >= 2 agrees), so a one-row
    input is doubled there: a decode step of 1 row computes exactly what the same row computes
    inside a batch of 32."""

    name = "plain"

    def apply(self, x, weight, packed):
        one_row = x.shape[0] == 1 and x.device.type == "cpu"
        if one_row:
            x = torch.cat([x, x])
        y = F.linear(x, weight) if packed is None else onednn_linear(x, packed.tensor)
        return y[:1] if one_row else y


class OnednnMethod(PlainMethod):
    """oneDNN over its packed copy (`pack_weight` checked it gives `F.linear`'s bits), one-row
    inputs doubled as for `PlainMethod`."""

    name = "onednn"


class PackedLinearMethod(LinearMethod):
    """oneDNN's packed copy with a k chunk: up to `max_rows` rows genserve's `packed_linear`
    (engine/kernels/csrc/packed_linear.cpp, the same bits as oneDNN with that chunk), above it
    oneDNN; or genserve's own layout (`vnni_pack`, `max_rows` `ANY_ROWS`): `packed_linear` always.
    Which is faster where: docs/benchmarks/linear.md."""

    name = "packed_linear"

    def apply(self, x, weight, packed):
        if x.shape[0] <= packed.max_rows:
            return torch.ops.genserve.packed_linear(x.contiguous(), packed.tensor, packed.k_chunk)
        return ONEDNN.apply(x, weight, packed)


class OnednnTiledMethod(LinearMethod):
    """oneDNN's product in calls of exactly `tile_rows` rows (`onednn_tiled`), where oneDNN's
    rows depend on the row count but not on the other rows of one call."""

    name = "onednn_tiled"

    def apply(self, x, weight, packed):
        return onednn_tiled(x, packed.tensor, packed.tile_rows)


class Fp32Method(LinearMethod):
    """The fp32 copy in fixed-size BLAS calls (`fp32_linear`): CPUs without bf16 arithmetic where
    `fma_linear` is not built, and the MoE router's fp32 logits (`pack_fp32`)."""

    name = "fp32"

    def apply(self, x, weight, packed):
        return fp32_linear(x, packed.f32, packed.call_rows)


class FmaMethod(LinearMethod):
    """genserve's `fma_linear` over `panel_pack`'s panels (CPUs without bf16 arithmetic): one fp32
    FMA chain over k per output, each row alone."""

    name = "fma"

    def apply(self, x, weight, packed):
        return torch.ops.genserve.fma_linear(x.contiguous(), packed.tensor)


class Q4Method(LinearMethod):
    """The GGUF's Q4_1 blocks (`engine.model.quant`, `q4_linear`: the bits `packed_linear` gives
    with the same chunk; without a chunk `q4_amx_linear`, the bits of the `tile_rows`-row oneDNN
    calls) up to `max_rows` rows; above, the bf16 copy's own method (`rest`)."""

    name = "q4"

    def __init__(self, rest: LinearMethod) -> None:
        self.rest = rest

    def apply(self, x, weight, packed):
        if x.shape[0] > packed.max_rows:
            return self.rest.apply(x, weight, packed)
        if packed.k_chunk:
            return torch.ops.genserve.q4_linear(x.contiguous(), packed.q4, packed.k_chunk)
        return torch.ops.genserve.q4_amx_linear(x.contiguous(), packed.q4)


class Q8AmxMethod(LinearMethod):
    """Q8_0 blocks on AMX (`q8_amx_linear`): the bits of the `tile_rows`-row oneDNN calls."""

    name = "q8_amx"

    def apply(self, x, weight, packed):
        return torch.ops.genserve.q8_amx_linear(x.contiguous(), packed.q8)


class Int8Method(LinearMethod):
    """int8 weights per output row (`engine.model.int8.int8_linear`): int8 arithmetic, rows
    independent of the batch, not the bf16 product's bits."""

    name = "int8"

    def apply(self, x, weight, packed):
        return int8_linear(x, packed.i8)


class Q4Q8Method(LinearMethod):
    """A GGUF's Q4_1 blocks times inputs rounded to 8 bits per row and block of 32
    (`q4q8_linear`: ggml's Q4_1 x Q8_1, llama.cpp's arithmetic)."""

    name = "q4q8"

    def apply(self, x, weight, packed):
        return torch.ops.genserve.q4q8_linear(x.contiguous(), packed.q4q8, weight.shape[0])


class Q8Q8Method(LinearMethod):
    """A GGUF's Q8_0 blocks times 8-bit inputs (`q8q8_linear`: ggml's Q8_0 x Q8_0)."""

    name = "q8q8"

    def apply(self, x, weight, packed):
        return torch.ops.genserve.q8q8_linear(x.contiguous(), packed.q8q8, weight.shape[0])


class QKMethod(LinearMethod):
    """A GGUF's Q4_K / Q6_K blocks times inputs rounded to Q8_K (`qk_linear`: ggml's K-quant
    products, `engine.model.kquant`)."""

    name = "qk"

    def apply(self, x, weight, packed):
        return torch.ops.genserve.qk_linear(x.contiguous(), list(packed.qk.blocks),
                                            list(packed.qk.kinds), -1)


PLAIN, ONEDNN = PlainMethod(), OnednnMethod()
_BLOCK_METHODS = (("q4q8", Q4Q8Method()), ("q8q8", Q8Q8Method()), ("qk", QKMethod()),
                  ("i8", Int8Method()), ("q8", Q8AmxMethod()))


def choose_method(packed: PackedWeight) -> LinearMethod:
    """The `LinearMethod` of a packed weight, by the formats it carries, first match: a GGUF's
    Q4_1 x Q8_1, Q8_0 x Q8_0 or K-quant blocks, int8 rows, AMX Q8_0 blocks, Q4_1 blocks for up to
    `max_rows` rows, then the bf16 copy's: `fma_linear` panels, an fp32 copy, `tile_rows`-row
    oneDNN calls, `packed_linear` with a k chunk, else plain oneDNN."""
    for attribute, method in _BLOCK_METHODS:
        if getattr(packed, attribute) is not None:
            return method
    if packed.fma:
        rest: LinearMethod = FmaMethod()
    elif packed.f32 is not None:
        rest = Fp32Method()
    elif packed.tile_rows:
        rest = OnednnTiledMethod()
    elif packed.k_chunk:
        rest = PackedLinearMethod()
    else:
        rest = ONEDNN
    return Q4Method(rest) if packed.q4 is not None else rest


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ Wᵀ through oneDNN's packed copy of W (`torch.ops.mkldnn._reorder_linear_weight`),
    [M, out] in x's dtype; no bias, no fused activation."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def pack_weight(weight: torch.Tensor,
                k_chunks: dict[tuple[int, int], int] | None = None) -> PackedWeight | None:
    """oneDNN's packed (blocked) copy of a bf16 CPU weight [out, in] for `linear`, or None.

    None when the weight is not bf16 on CPU, this torch has no oneDNN linear, or the packed
    product fails the check that makes it usable: on random rows, its M = 2, 7 and 64 results
    must equal `F.linear` at M = 64 bit for bit (so packed and unpacked engines, and rows of any
    batch, agree). Costs one more copy of the weight (bytes = 2 · out · in). The k chunk for
    genserve's `packed_linear` comes from `onednn_k_chunk`, or from `k_chunks` (shape → chunk,
    filled in here) when an earlier weight had the same shape: oneDNN picks its blocking from
    the shape, not the values.
    """
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        probe = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(0)
                            ).to(weight.dtype)
        want = F.linear(probe, weight)
        for m in (2, 7, 64):
            got = onednn_linear(probe[:m], packed)
            if not torch.equal(got, want[:m]):
                return None
    except (RuntimeError, AttributeError):
        return None
    k_chunks = {} if k_chunks is None else k_chunks
    shape = (weight.shape[0], weight.shape[1])
    if shape not in k_chunks:
        k_chunks[shape] = onednn_k_chunk(packed)
    return PackedWeight(packed, k_chunks[shape])


def onednn_tiled(x: torch.Tensor, packed: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """x [M, in] @ Wᵀ through oneDNN's packed copy of W in calls of exactly `tile_rows` rows (the
    last padded with zero rows), [M, out] in x's dtype. A row's result depends only on the row
    itself, never on M or its neighbours, where oneDNN computes the rows of one call
    independently (`tiles_are_row_independent` checks it)."""
    m = x.shape[0]
    pad = -m % tile_rows
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    if x.shape[0] == tile_rows:
        return onednn_linear(x, packed)[:m]
    return torch.cat([onednn_linear(tile, packed) for tile in x.split(tile_rows)])[:m]


def tiles_are_row_independent(weight: torch.Tensor, packed: torch.Tensor, tile_rows: int) -> bool:
    """Whether oneDNN's product of `tile_rows` rows gives each row the same bits whatever the
    other rows hold (and at any offset of the input's storage): probed on random rows, each row
    position against a call where every other row differs."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(tile_rows, weight.shape[1], generator=gen).to(weight.dtype)
    want = onednn_linear(a, packed)
    for r in range(tile_rows):
        b = torch.randn(tile_rows + 1, weight.shape[1], generator=gen).to(weight.dtype)
        b[1 + r] = a[r]
        if not torch.equal(onednn_linear(b[1:], packed)[r], want[r]):
            return False
    return True


def vnni_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] bf16 in `packed_linear`'s layout, as a dense [N, K] tensor of the same bytes.

    The layout is oneDNN's AB16b64a2b: blocks of 64 output columns, each [K / 2][64][2], i.e. for
    every pair of k the 64 columns' two weights side by side (the vdpbf16ps order). Raises
    ValueError unless N is a multiple of 64 and K of 32.
    """
    n, k = weight.shape
    if n % 64 or k % 32:
        raise ValueError(f"vnni_pack: N must be a multiple of 64 and K of 32, got N = {n}, K = {k}")
    return weight.view(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(n, k)


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in `fma_linear`'s panels: [N / PANEL, K, PANEL], for every k the PANEL
    columns' weights side by side (engine/kernels/csrc/fma_linear.cpp). Same dtype; raises
    ValueError unless N is a multiple of PANEL."""
    n, k = weight.shape
    if n % PANEL:
        raise ValueError(f"panel_pack: N must be a multiple of {PANEL}, got N = {n}")
    return weight.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


# How pack_weights's log lines on a CPU without bf16 arithmetic begin: the products they name are
# the bf16 fallback, which `--weights` (the line after) may replace with quantized ones.
_FALLBACK_LOG = ("bf16 matrix products (every matrix, unless the weights line that follows serves "
                 "it from its quantized blocks): ")


def pack_weights(weights: list[torch.Tensor]) -> list[PackedWeight | None]:
    """Packed copies of a model's matrices [out, in], chosen for the whole model at once.

    Where oneDNN packs every matrix with rows that do not depend on the batch (`pack_weight`'s
    check) and `packed_linear` reproduces it (a k chunk for every matrix), the copies are
    oneDNN's: `packed_linear` up to `PACKED_LINEAR_MAX_ROWS` rows, oneDNN above, the same bits.
    oneDNN's blocking, and so its rounding, can change with the row count and the CPU; where it
    does, and oneDNN computes the rows of one call independently, every product is oneDNN's in
    calls of exactly TILE_ROWS rows (`onednn_tiled`), so each row always meets the same kernel.
    Otherwise, when `packed_linear` is built and every matrix fits its blocks (bf16, N a multiple
    of 64, K of 32), genserve packs them itself (`vnni_pack`) and `packed_linear` runs every
    product, one chain over all of k, each row alone. Otherwise, on a CPU without bf16
    arithmetic (`bf16_arithmetic`: AVX2 alone, where oneDNN packs nothing), the weights in
    `panel_pack`'s panels for genserve's `fma_linear` (one fp32 FMA chain over k per output, each
    row alone) where it is built and every matrix has a multiple of 16 outputs, else fp32 copies
    for `fp32_linear` (4 · out · in bytes more). Otherwise oneDNN's copies where `pack_weight` gave
    one, else None (`F.linear`). Which is faster where, and why this order:
    docs/benchmarks/linear.md. Costs one more copy of each weight (2 · out · in bytes).
    """
    k_chunks: dict[tuple[int, int], int] = {}         # one probe per shape
    onednn = [pack_weight(w, k_chunks) for w in weights]
    if all(p is not None and p.k_chunk for p in onednn):
        return onednn
    tiled = [_onednn_tiles(w) for w in weights]
    if all(p is not None for p in tiled):
        return tiled
    own_layout = kernels.packed_linear_available() and all(
        w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[0] % 64 == 0
        and w.shape[1] % 32 == 0 for w in weights)
    if own_layout:
        return [PackedWeight(vnni_pack(w), w.shape[1], ANY_ROWS) for w in weights]
    # torch reports AVX2 for a CPU with AVX-NE-CONVERT too, where oneDNN does pack bf16
    if all(p is None for p in onednn) and not bf16_arithmetic():
        if kernels.fma_linear_available() and all(
                w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[0] % PANEL == 0
                for w in weights):
            log.info("%sgenserve's fma_linear, this CPU has no bf16 arithmetic", _FALLBACK_LOG)
            return [PackedWeight(panel_pack(w), 0, ANY_ROWS, fma=True) for w in weights]
        call_rows: dict[tuple[int, int], tuple[int, ...]] = {}    # one probe per shape
        widened = [_fp32_copy(w, call_rows) for w in weights]
        if all(p is not None for p in widened):
            log.info("%sfp32 copies of the bf16 weights, this CPU has no bf16 arithmetic (calls of "
                     "%s rows)", _FALLBACK_LOG, "/".join(map(str, widened[0].call_rows)))
            return widened
    return onednn


def bf16_arithmetic() -> bool:
    """Whether this CPU computes bf16 products natively: oneDNN packs bf16 weights only where it
    has AVX512 (BW, VL, DQ: AVX512-BF16 or its emulation), AMX or AVX-NE-CONVERT; elsewhere (AVX2
    alone) torch's bf16 `F.linear` converts on every call and runs 4-9x slower than fp32
    (docs/benchmarks/linear.md)."""
    caps = torch.backends.cpu.get_cpu_capability()
    return caps not in ("DEFAULT", "AVX2", "NO AVX") or torch.cpu._is_avx512_bf16_supported()


def fp32_linear(x: torch.Tensor, weight32: torch.Tensor, call_rows: tuple[int, ...]) -> torch.Tensor:
    """x [M, in] (bf16) @ Wᵀ with W's fp32 copy `weight32` [out, in]: x widened to fp32 (exact),
    summed in fp32 by torch's BLAS in calls of exactly one of `call_rows` rows (the input padded
    with zero rows: the smallest count >= M, or calls of the largest; a matrix of more than
    4 · `FP32_OUT_CHUNK` outputs in slices of that many), the result rounded to x's dtype
    [M, out]. Every call count was probed to give a row the same bits at any position
    (`_fp32_copy`), so a row's result does not depend on M or its neighbours."""
    m = x.shape[0]
    wide = x.float()
    largest = call_rows[-1]
    rows = next((r for r in call_rows if r >= m), largest)
    pad = -m % rows
    if pad:
        wide = F.pad(wide, (0, 0, 0, pad))
    if wide.shape[0] == rows:
        return _fp32_call(wide, weight32)[:m].to(x.dtype)
    return torch.cat([_fp32_call(tile, weight32) for tile in wide.split(rows)])[:m].to(x.dtype)


def _fp32_call(x: torch.Tensor, weight32: torch.Tensor) -> torch.Tensor:
    """One fp32 product x [M, in] @ weight32ᵀ, [M, out] fp32: a matrix of more than
    4 · `FP32_OUT_CHUNK` outputs in slices of that many outputs, else one `F.linear`."""
    if weight32.shape[0] > 4 * FP32_OUT_CHUNK:
        return torch.cat([F.linear(x, part) for part in weight32.split(FP32_OUT_CHUNK)], 1)
    return F.linear(x, weight32)


def pack_fp32(weight: torch.Tensor) -> PackedWeight | None:
    """An fp32 CPU matrix [out, in] for `linear` on fp32 inputs with rows independent of the
    batch: `fp32_linear`'s fixed-size calls, the call sizes probed for this shape as `_fp32_copy`
    probes them (the MoE router: fp32 logits whatever the serving dtype). None where no size
    passes the probe or the weight is not an fp32 CPU tensor (then `linear` runs `F.linear`)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return _fp32_copy(weight, {})


def _fp32_copy(weight: torch.Tensor, call_rows: dict[tuple[int, int], tuple[int, ...]]
               ) -> PackedWeight | None:
    """`weight` (bf16 or fp32, CPU) with its fp32 copy for `fp32_linear`, or None if no call count of
    `FP32_CALL_ROWS` passes the probe. The counts are probed once per shape (`call_rows`, shape →
    counts, filled in here; the BLAS picks its kernel by shape, not values): on random rows, a call
    of each count must give every row the bits of the largest count's call on the same rows, with
    the rows at shifted positions too. Costs 4 · out · in bytes (none for an fp32 weight)."""
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu":
        return None
    wide = weight.float()
    shape = (weight.shape[0], weight.shape[1])
    if shape not in call_rows:
        gen = torch.Generator().manual_seed(3)
        largest = FP32_CALL_ROWS[-1]
        probe = torch.randn(largest, weight.shape[1], generator=gen).to(torch.bfloat16).float()
        want = _fp32_call(probe, wide)
        kept = []
        for rows in FP32_CALL_ROWS:
            shifts = range(0, rows, max(1, rows // 8))
            if all(torch.equal(_fp32_call(probe[:rows].roll(s, 0), wide), want[:rows].roll(s, 0))
                   for s in shifts):
                kept.append(rows)
        call_rows[shape] = tuple(kept)
    if not call_rows[shape] or call_rows[shape][-1] != FP32_CALL_ROWS[-1]:
        return None
    return PackedWeight(weight, 0, 0, f32=wide, call_rows=call_rows[shape])


def _onednn_tiles(weight: torch.Tensor) -> PackedWeight | None:
    """oneDNN's packed copy of a bf16 CPU weight run in TILE_ROWS-row calls, or None where oneDNN
    cannot pack it or its rows in such a call depend on the other rows."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, TILE_ROWS)
        if not tiles_are_row_independent(weight, packed, TILE_ROWS):
            return None
    except (RuntimeError, AttributeError):
        return None
    return PackedWeight(packed, 0, 0, TILE_ROWS)


def onednn_k_chunk(packed: torch.Tensor) -> int:
    """The k chunk with which genserve's `packed_linear` gives oneDNN's bits for `packed`, or 0.

    oneDNN's bf16 kernel sums k in chunks (one vdpbf16ps chain per chunk, the chunks' sums added
    in order); the chunk length depends on the shape and is not documented, so it is found here:
    candidates go powers of two first, largest first, then every other multiple of 32 up to
    `in`, and the first whose products equal oneDNN's on ≥ 2^20 random outputs (and on one row
    alone) is taken. A wrong chunk rounds some outputs differently, so the probe tells it apart
    (how often, and the chunks found, in docs/benchmarks/linear.md). 0 when `packed_linear` is
    not built or no chunk matches (then oneDNN runs every product).
    """
    if not kernels.packed_linear_available():
        return 0
    n, k = packed.shape
    if n % 64 or k % 32:
        return 0
    rows = min(4096, max(64, -(-(1 << 20) // n)))
    probe = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = onednn_linear(probe, packed)
    powers = [2 ** i for i in range(k.bit_length() - 1, 4, -1)]        # ≤ k, largest first
    for chunk in powers + [c for c in range(32, k + 1, 32) if c not in powers]:
        try:
            if (torch.equal(torch.ops.genserve.packed_linear(probe, packed, chunk), want) and
                    torch.equal(torch.ops.genserve.packed_linear(probe[:1], packed, chunk),
                                want[:1])):
                return chunk
        except RuntimeError:        # a padded layout: not the one packed_linear reads
            return 0
    return 0
