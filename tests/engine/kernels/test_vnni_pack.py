"""The batch-invariant products for CPUs where oneDNN's rows depend on the row count: oneDNN in
fixed-size calls (`onednn_tiled`), genserve's own layout (`packed_linear` over `vnni_pack`ed
weights), and the model-wide choice among them and oneDNN's packed copies (`pack_weights`)."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.model import linear as lin

needs_packed_linear = pytest.mark.skipif(not kernels.packed_linear_available(),
                                         reason="packed_linear needs an AVX512-BF16 CPU and g++")
needs_onednn_bf16 = pytest.mark.skipif(not lin.bf16_arithmetic(),
                                       reason="oneDNN packs bf16 weights only with AVX512, AMX or "
                                              "AVX-NE-CONVERT; this CPU has none (fma_linear there)")


def _weights(*shapes: tuple[int, int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16) for s in shapes]


def test_vnni_pack_is_the_blocked_pair_layout():
    w = torch.arange(128 * 64, dtype=torch.float32).view(128, 64).to(torch.bfloat16)
    p = lin.vnni_pack(w).view(2, 32, 64, 2)        # [N/64][K/2][64][2]
    # block b, k pair j, column c, element e is W[64 b + c, 2 j + e]
    assert p[1, 5, 7, 1] == w[64 + 7, 11] and p[0, 31, 63, 0] == w[63, 62]
    with pytest.raises(ValueError, match="N must be a multiple of 64"):
        lin.vnni_pack(w[:100])


@needs_packed_linear
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (192, 576)])
def test_own_layout_products_are_exact_and_batch_invariant(shape):
    (w,) = _weights(shape)
    packed = lin.PackedWeight(lin.vnni_pack(w), shape[1], lin.ANY_ROWS)
    x = torch.randn(300, shape[1], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = lin.linear(x, w, packed)
    ref = x.float() @ w.float().T
    # one fp32 chain per output, one rounding to bf16: within bf16's half-ulp of the exact sum
    assert torch.allclose(y.float(), ref, rtol=2 ** -8, atol=1e-3)
    # every row alone, in a batch of 7 and of 228 gives the same bits as in the batch of 300
    parts = [lin.linear(x[a:b], w, packed) for a, b in ((0, 1), (1, 8), (8, 72), (72, 300))]
    assert torch.equal(torch.cat(parts), y)


@needs_onednn_bf16
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536)])
def test_tiled_products_are_batch_invariant(shape):
    (w,) = _weights(shape)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, lin.TILE_ROWS)
    assert lin.tiles_are_row_independent(w, packed, lin.TILE_ROWS)
    x = torch.randn(300, shape[1], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = lin.onednn_tiled(x, packed, lin.TILE_ROWS)
    ref = x.float() @ w.float().T
    assert y.shape == (300, shape[0]) and torch.allclose(y.float(), ref, rtol=2 ** -7, atol=1e-2)
    # a row alone, in 7 rows, in 64 and in 228 (not a multiple of the tile): the same bits
    parts = [lin.onednn_tiled(x[a:b], packed, lin.TILE_ROWS) for a, b in ((0, 1), (1, 8), (8, 72), (72, 300))]
    assert torch.equal(torch.cat(parts), y)


@needs_onednn_bf16
def test_pack_weights_takes_oneDNN_tiles_for_the_whole_model_when_oneDNN_is_not_exact(monkeypatch):
    weights = _weights((192, 64), (64, 192))
    # oneDNN's copy of the second matrix fails the row-count check: every matrix is tiled
    real = lin.pack_weight
    monkeypatch.setattr(lin, "pack_weight", lambda w, k=None: None if w.shape[0] == 64 else real(w, k))
    packed = lin.pack_weights(weights)
    assert all(p.tile_rows == lin.TILE_ROWS and p.k_chunk == 0 for p in packed)
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(lin.linear(x, weights[0], packed[0]), lin.onednn_tiled(x, packed[0].tensor, 32))


@needs_packed_linear
def test_pack_weights_falls_back_to_the_own_layout_for_the_whole_model(monkeypatch):
    weights = _weights((192, 64), (64, 192))
    # oneDNN's copy of the second matrix is not usable, and neither are its tiles (their rows
    # depended on their neighbours): every matrix then takes genserve's own layout, never a mix.
    real = lin.pack_weight
    monkeypatch.setattr(lin, "pack_weight", lambda w, k=None: None if w.shape[0] == 64 else real(w, k))
    monkeypatch.setattr(lin, "tiles_are_row_independent", lambda w, p, t: w.shape[0] != 64)
    packed = lin.pack_weights(weights)
    assert all(p.max_rows == lin.ANY_ROWS and not p.tensor.is_mkldnn for p in packed)
    assert all(torch.equal(p.tensor, lin.vnni_pack(w)) for p, w in zip(packed, weights))


def test_pack_weights_leaves_fp32_to_f_linear():
    (w,) = _weights((192, 64))
    assert lin.pack_weights([w.float()]) == [None]


@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (5120, 64)])
def test_fp32_products_are_close_to_exact_and_batch_invariant(shape):
    """The fp32 copies (`fp32_linear`, CPUs without bf16 arithmetic; the products themselves run on
    any CPU): one rounding of an fp32 sum, and a row's bits whatever the batch, including the
    1-3 rows the BLAS would run as matrix-vector products and a matrix sliced by its outputs."""
    (w,) = _weights(shape)
    packed = lin._fp32_copy(w, {})
    if packed is None:
        pytest.skip("no fp32 call size passed the row-position probe on this CPU's BLAS")
    assert packed.f32.dtype == torch.float32 and torch.equal(packed.f32.to(torch.bfloat16), w)
    assert packed.call_rows[-1] == lin.FP32_CALL_ROWS[-1] and 1 not in packed.call_rows
    x = torch.randn(600, shape[1], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = lin.linear(x, w, packed)
    ref = x.float() @ w.float().T
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref, rtol=2 ** -8, atol=1e-4)
    parts = [lin.linear(x[a:b], w, packed) for a, b in ((0, 1), (1, 3), (3, 10), (10, 33), (33, 300), (300, 600))]
    assert torch.equal(torch.cat(parts), y)
    for i in (0, 7, 299, 599):
        assert torch.equal(lin.linear(x[i:i + 1], w, packed)[0], y[i])


def test_pack_weights_takes_fp32_copies_where_the_cpu_has_no_bf16_arithmetic(monkeypatch):
    """Without bf16 arithmetic and without genserve's `fma_linear` (kernels not built): fp32 copies.
    Where `fma_linear` is built, tests/engine/kernels/test_fma_linear.py checks that it is taken."""
    weights = _weights((192, 64), (64, 192))
    monkeypatch.setattr(lin, "pack_weight", lambda w, k=None: None)    # oneDNN cannot pack bf16
    monkeypatch.setattr(lin, "_onednn_tiles", lambda w: None)
    monkeypatch.setattr(kernels, "packed_linear_available", lambda: False)
    monkeypatch.setattr(kernels, "fma_linear_available", lambda: False)
    monkeypatch.setattr(lin, "bf16_arithmetic", lambda: False)
    packed = lin.pack_weights(weights)
    assert all(p is not None and p.f32 is not None and p.call_rows for p in packed)
    monkeypatch.setattr(lin, "bf16_arithmetic", lambda: True)          # never where oneDNN has bf16
    assert lin.pack_weights(weights) == [None, None]
