"""The block matrices' products on int8 arithmetic (`EngineConfig.weights` "int8").

A CPU with AVX512-VNNI (or AMX-INT8) multiplies and accumulates twice as many int8 pairs per
cycle as bf16 pairs, and oneDNN's int8 product (`torch._int_mm`) reaches much more of that than
its bf16 product does on these shapes (docs/benchmarks/int8.md has the figures). Here every
block matrix (wqkv, wo, w13, w2 of each layer) is held as int8 with one fp32 scale per output
row, and every product quantizes its input rows to int8 with one fp32 scale per row, the scheme
of LLM.int8()'s vector-wise quantization without its outlier columns (Dettmers et al. 2022,
arXiv:2208.07339, section 3.2) and of SmoothQuant's W8A8 per-token / per-channel baseline (Xiao
et al. 2022, arXiv:2211.10438, section 3):

    w_scale[n] = max_k |W[n, k]| / 127          Wq[n, k] = round(W[n, k] / w_scale[n])
    x_scale[m] = max_k |x[m, k]| / 127          xq[m, k] = round(x[m, k] / x_scale[m])
    y[m, n]    = bf16( fp32(Σ_k xq[m, k] · Wq[n, k]) · x_scale[m] · w_scale[n] )

The sum is exact in int32 (|Σ| ≤ K · 127² < 2³¹ for K < 133,000), so which kernel oneDNN picks
for a row count, and how it blocks k, cannot change it; the scales are per row. A row's result
therefore has the same bits whatever else is in the batch, the property the bf16 paths get from
`engine.model.linear` by matching oneDNN's rounding.

What it costs: the products are no longer the bf16 model's (the weights are rounded to 255 levels
per row, the activations to 255 levels per row); docs/benchmarks/int8.md measures the greedy
agreement and the perplexity against the exact bf16 path. The output projection stays in bf16
(its logits choose the tokens), and so do attention, the norms and the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels

QMAX = 127          # symmetric int8: levels -127..127 (-128 unused, so negation is exact)


@dataclass(frozen=True)
class Int8Weight:
    """A weight W [N, K] quantized per output row for `int8_linear`, with its outlier input
    channels apart.

    Attributes:
        q: int8 [N, K]: round(W / scale), the outlier columns zero (contiguous; the product reads
            its transpose view).
        scale: fp32 [N]: max_k |W[n, k]| / 127 (1 for an all-zero row).
        outliers: int64 [C], sorted: the input channels whose activations are quantized apart
            (C = 0: none).
        outlier_q: int8 [C, N]: the outlier columns of round(W / scale), transposed and
            contiguous (the order their sums read them in).
        observed: None, or fp32 [K], the running max of |x| per input channel over every
            product while `engine.model.int8_weights.attach_int8` calibrates (filled in place);
            None when serving.
        block: 0 (the scheme above), or k per scale block: then `scale` is fp32 [N, K / block],
            one per row and block of k, the input rows are quantized per block too, and there
            are no outliers: ggml's Q8_0 × Q8_0 product (llama.cpp's 8-bit arithmetic, blocks of
            32), exact sums per block, the blocks' products added in fp32 in k order. Slower
            (one int8 product per block); for comparing quality (benchmarks/int8.py).
        exact: None, or (with `block`) fp32 [N, K], the weight unrounded: then only the input
            rows are rounded, per block, and multiplied by it in fp32 (`q` and `scale` are
            unused): llama.cpp's arithmetic for a file of 4-bit weights (Q4_1 × Q8_1: the
            weights exact, the activations in 8-bit blocks of 32). For comparing quality only.
    """

    q: torch.Tensor
    scale: torch.Tensor
    outliers: torch.Tensor
    outlier_q: torch.Tensor
    observed: torch.Tensor | None = None
    block: int = 0
    exact: torch.Tensor | None = None


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales amax · (1/127), 1 where amax is 0 (an all-zero row or block)."""
    return torch.where(amax > 0, amax * (1 / QMAX), torch.ones_like(amax))


def quantize_weight(weight: torch.Tensor, outliers: torch.Tensor | None = None,
                    observe: bool = False, block: int = 0, exact: bool = False) -> Int8Weight:
    """`weight` [N, K] (any float dtype) as int8 rows with one fp32 scale each (module
    docstring), the columns `outliers` (int64 [C]) kept apart; with `observe`, an `observed`
    buffer of zeros for calibration; with `block` > 0, one scale per row and block of k instead
    (`Int8Weight.block`; raises ValueError unless it divides K, or with outliers); with `exact`
    as well, the weight kept unrounded beside (`Int8Weight.exact`; raises ValueError without
    `block`)."""
    w = weight.float()
    n, k = w.shape
    if exact and not block:
        raise ValueError("an exact weight is only for scale blocks of the input (block > 0)")
    if block:
        if k % block or outliers is not None:
            raise ValueError(f"int8 blocks of {block}: K = {k} must be a multiple, and no outliers")
        scale = _scales(w.view(n, k // block, block).abs().amax(dim=2))          # [N, K / block]
        q = torch.round(w.view(n, k // block, block) / scale[:, :, None]).view(n, k)
    else:
        scale = _scales(w.abs().amax(dim=1))                                    # [N]
        q = torch.round(w / scale[:, None])
    q = q.clamp_(-QMAX, QMAX).to(torch.int8)
    outliers = torch.empty(0, dtype=torch.int64) if outliers is None else outliers.sort().values
    outlier_q = q[:, outliers].t().contiguous()
    q[:, outliers] = 0
    observed = torch.zeros(k) if observe else None
    return Int8Weight(q.contiguous(), scale.contiguous(), outliers, outlier_q, observed, block,
                      w.contiguous() if exact else None)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `x` [M, K] as int8 [M, K] and their fp32 scales [M, 1] (module docstring); each
    row's result depends on that row alone."""
    xf = x.float()
    scale = _scales(xf.abs().amax(dim=1, keepdim=True))
    return torch.round(xf * scale.reciprocal()).clamp_(-QMAX, QMAX).to(torch.int8), scale


def _blocked_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`int8_linear` for a weight with scale blocks (`Int8Weight.block`): [M, N] fp32."""
    m, k = x.shape
    b = weight.block
    xq, x_scale = quantize_rows(x.reshape(m * (k // b), b))      # a row per block of each row
    xq, x_scale = xq.view(m, k), x_scale.view(m, k // b)
    if weight.exact is not None:
        rounded = (xq.view(m, k // b, b).float() * x_scale[:, :, None]).view(m, k)
        return rounded @ weight.exact.t()
    acc = torch.zeros(m, weight.q.shape[0])
    for j in range(k // b):
        part = torch._int_mm(xq[:, j * b:(j + 1) * b].contiguous(), weight.q[:, j * b:(j + 1) * b].t())
        acc += part.float() * x_scale[:, j:j + 1] * weight.scale[:, j]
    return acc


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [M, K] @ Wᵀ on int8 arithmetic: [M, N] in x's dtype.

    The input rows are quantized per row (`quantize_rows`) twice: the outlier channels alone and
    the others alone (so a few large channels do not coarsen every other channel's levels, the
    point of LLM.int8()'s decomposition), each multiplied by its columns of `weight` with exact
    int32 sums (`torch._int_mm`, oneDNN's u8·s8 VNNI / AMX kernel on CPU), scaled back in fp32
    by its row scale, added, multiplied by the output column's scale and rounded once to x's
    dtype. Every step is per row or exact, so a row's bits do not depend on the other rows.

    A bf16 input runs genserve's `int8_linear` kernel where the kernels are built (the same
    formula in one call, engine/kernels/csrc/int8_linear.cpp); otherwise `int8_linear_torch`.
    The two can differ in the last bit of an output and, where x / scale falls within an fp32
    rounding of a tie (n + 1/2), by one level of that input (the kernel is built with
    -ffast-math), so an engine uses one of the two for all of its products.
    While calibrating (`weight.observed`) the input's channel maxima are recorded first.
    """
    if weight.observed is not None:
        torch.maximum(weight.observed, x.detach().float().abs().amax(dim=0), out=weight.observed)
    if weight.block:
        return _blocked_linear(x, weight).to(x.dtype)
    if x.dtype == torch.bfloat16 and kernels.available():
        return torch.ops.genserve.int8_linear(x.contiguous(), weight.q, weight.scale,
                                              weight.outliers, weight.outlier_q)
    return int8_linear_torch(x, weight)


def int8_linear_torch(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`int8_linear` in torch ops (where genserve's kernels are not built): x [M, K] → [M, N] in
    x's dtype, for a weight without scale blocks."""
    if weight.outliers.numel():
        xo, o_scale = quantize_rows(x[:, weight.outliers])
        xq, x_scale = quantize_rows(x.index_fill(1, weight.outliers, 0))
        acc = torch._int_mm(xq, weight.q.t()).float() * x_scale                 # fp32 [M, N]
        # int32 mm: exact, and right at C = 1 (torch 2.13's CPU _int_mm is not at K = 1)
        acc += torch.mm(xo.to(torch.int32), weight.outlier_q.to(torch.int32)).float() * o_scale
    else:
        xq, x_scale = quantize_rows(x)
        acc = torch._int_mm(xq, weight.q.t()).float() * x_scale
    return (acc * weight.scale).to(x.dtype)


def int8_exact(n: int, k: int) -> bool:
    """Whether `torch._int_mm` gives exact int32 sums here for an [·, k] @ [k, n] product, the
    weight read as `int8_linear` reads it (the transposed view of an [n, k] tensor): probed at 1,
    7 and 64 rows of random int8 values (the whole range, -128 included, which a saturating
    16-bit intermediate would get wrong) against a float64 product, exact at these sizes."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    x = torch.randint(-128, 128, (64, k), dtype=torch.int8, generator=gen)
    want = (x.double() @ w.double().t()).to(torch.int64)
    rhs = w.t()
    try:
        for m in (1, 7, 64):
            if not torch.equal(torch._int_mm(x[:m], rhs).to(torch.int64), want[:m]):
                return False
    except RuntimeError:
        return False
    return True
