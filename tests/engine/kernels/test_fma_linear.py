"""genserve's `fma_linear` (engine/kernels/csrc/fma_linear.cpp), the products on CPUs without bf16
arithmetic: bf16 weights in 16-column panels, widened in registers, one fp32 FMA chain over k per
output. A row's bits must not depend on the batch, the sums must be as close to exact as an
ordered fp32 sum rounded once to bf16, and `pack_weights` must take it where oneDNN has no bf16."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.model import linear as lin

pytestmark = pytest.mark.skipif(not kernels.fma_linear_available(),
                                reason="fma_linear needs a CPU with AVX2 and FMA, and g++")


def _weight(n: int, k: int, seed: int = 3) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


def _rows(m: int, k: int, seed: int = 4) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_panel_pack_puts_16_columns_side_by_side_for_every_k():
    w = _weight(48, 20)
    panels = lin.panel_pack(w)
    assert panels.shape == (3, 20, 16) and panels.dtype == torch.bfloat16
    for p, k, j in ((0, 0, 0), (1, 7, 3), (2, 19, 15)):
        assert panels[p, k, j] == w[16 * p + j, k]
    with pytest.raises(ValueError, match="multiple of 16"):
        lin.panel_pack(_weight(40, 20))


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (1024, 37)])
def test_sums_are_an_fp32_sum_rounded_once(shape):
    """|y - exact| <= one bf16 rounding of the fp32 sum + the ordered fp32 sum's bound
    (Higham 3.1: K·u·Σ|x w|, u = 2^-24), against a float64 reference."""
    n, k = shape
    w, x = _weight(n, k), _rows(130, k)
    y = torch.ops.genserve.fma_linear(x, lin.panel_pack(w)).double()
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    fp32_bound = k * 2.0 ** -24 * magnitude
    assert torch.all((y - exact).abs() <= 2.0 ** -8 * (exact.abs() + fp32_bound) + fp32_bound)
    # and not a looser product: most outputs are the exact sum rounded to bf16
    assert (y == exact.to(torch.bfloat16).double()).double().mean() > 0.9


def test_a_rows_bits_do_not_depend_on_the_batch():
    """Every tile shape (1 row x 4 panels, 2 x 2, 1-6 rows x 1 panel), row blocks of 48, and a
    row at every position: the same chain per output, so the same bits."""
    n, k = 1040, 576                                  # 65 panels: a 4-panel tail of 1
    w = _weight(n, k)
    panels = lin.panel_pack(w)
    x = _rows(200, k)
    y = torch.ops.genserve.fma_linear(x, panels)
    for a, b in ((0, 1), (1, 3), (3, 6), (6, 13), (13, 49), (49, 97), (97, 200)):
        assert torch.equal(torch.ops.genserve.fma_linear(x[a:b], panels), y[a:b]), (a, b)
    for i in (0, 5, 47, 48, 199):
        assert torch.equal(torch.ops.genserve.fma_linear(x[i:i + 1], panels)[0], y[i])
        shifted = torch.cat([x[:i], x[i + 1:]]).roll(7, 0)[:50]
        batch = torch.cat([shifted[:3], x[i:i + 1], shifted[3:]])
        assert torch.equal(torch.ops.genserve.fma_linear(batch, panels)[3], y[i])


def test_bad_operands_raise_a_clear_error():
    panels = lin.panel_pack(_weight(32, 64))
    with pytest.raises(RuntimeError, match="x must be bf16"):
        torch.ops.genserve.fma_linear(_rows(2, 64).float(), panels)
    with pytest.raises(RuntimeError, match="K = 63"):
        torch.ops.genserve.fma_linear(_rows(2, 63), panels)
    with pytest.raises(RuntimeError, match=r"panels \[N/16, K, 16\]"):
        torch.ops.genserve.fma_linear(_rows(2, 64), _weight(32, 64))
    assert torch.ops.genserve.fma_linear(_rows(0, 64), panels).shape == (0, 32)


def test_pack_weights_takes_fma_linear_where_the_cpu_has_no_bf16_arithmetic(monkeypatch):
    weights = [_weight(192, 64), _weight(64, 192, seed=5)]
    monkeypatch.setattr(lin, "pack_weight", lambda w, k=None: None)    # oneDNN cannot pack bf16
    monkeypatch.setattr(lin, "_onednn_tiles", lambda w: None)
    monkeypatch.setattr(kernels, "packed_linear_available", lambda: False)
    monkeypatch.setattr(lin, "bf16_arithmetic", lambda: False)
    packed = lin.pack_weights(weights)
    assert all(p.fma and p.f32 is None and torch.equal(p.tensor, lin.panel_pack(w))
               for p, w in zip(packed, weights))
    x = _rows(5, 64)
    assert torch.equal(lin.linear(x, weights[0], packed[0]),
                       torch.ops.genserve.fma_linear(x, packed[0].tensor))
    # a matrix whose outputs are not a multiple of 16 keeps the whole model on fp32 copies
    odd = lin.pack_weights(weights + [_weight(40, 64, seed=6)])
    assert all(not p.fma for p in odd)
    monkeypatch.setattr(lin, "bf16_arithmetic", lambda: True)          # never where oneDNN has bf16
    assert lin.pack_weights(weights) == [None, None]
