"""`torch.ops.genserve.paged_decode_window`: decode attention of head_dim 64, 128 and 256 with
another score scale and a sliding window (Qwen3's and Gemma 3's layers), against a dense fp32
reference on shuffled block tables, for every GQA group size the kernel takes, bf16 and fp32
pools, and a row's bits whatever else is in the call (batch invariance); and the backend's
decode path choosing it, against the SDPA path."""

from __future__ import annotations

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.attention.base import AttentionSpec
from engine.attention.paged_sdpa import window_kernel_serves
from tests.engine.attention.test_decode_attention import make_case as decode_attention_case


@pytest.fixture(autouse=True)
def _kernels_built():
    if not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?)")


def make_case(contexts: list[int], kv_heads: int, group: int, hd: int, block: int,
              dtype: torch.dtype, seed: int):
    """test_decode_attention's `make_case` at head size `hd`: (q [B, H, hd], k_pool, v_pool,
    tables, lens)."""
    return decode_attention_case(contexts, kv_heads, group, block, dtype, seed, hd=hd)


def dense_reference(q, k_pool, v_pool, tables, lens, scale: float, window: int) -> torch.Tensor:
    """fp32 softmax(q·kᵀ·scale)·v of each row over its last `window` positions (0: all),
    [B, H, hd]."""
    out = []
    group = q.shape[1] // k_pool.shape[2]
    for row in range(len(q)):
        n = int(lens[row])
        blocks = tables[row, :-(-n // k_pool.shape[1])]
        first = max(0, n - window) if window else 0
        k = k_pool[blocks].flatten(0, 1)[first:n].float().repeat_interleave(group, dim=1)
        v = v_pool[blocks].flatten(0, 1)[first:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("window", [0, 12, 40])
def test_matches_dense_reference(dtype, hd, group, window):
    contexts = [1, 11, 16, 17, 45, 130]
    q, k, v, tables, lens = make_case(contexts, 2, group, hd, 16, dtype, seed=hd + group + window)
    scale = 256 ** -0.5 if hd == 256 else 0.1
    out = torch.ops.genserve.paged_decode_window(q, k, v, tables, lens, scale, window)
    want = dense_reference(q, k, v, tables, lens, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.float() - want).abs()
    # bf16: the output's rounding (half an ulp ≤ |x|·2⁻⁸) plus fp32 summation error
    bound = want.abs() * 2.0 ** -8 + 2e-5 if dtype == torch.bfloat16 else torch.full_like(want, 1e-5)
    assert bool((err <= bound).all()), err.max().item()


@pytest.mark.parametrize("hd", [128, 256])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(hd):
    contexts = [70, 3, 129, 16, 33]
    q, k, v, tables, lens = make_case(contexts, 1, 4, hd, 16, torch.bfloat16, seed=5)
    together = torch.ops.genserve.paged_decode_window(q, k, v, tables, lens, 0.0625, 24)
    for row in range(len(contexts)):
        alone = torch.ops.genserve.paged_decode_window(q[row:row + 1], k, v, tables[row:row + 1],
                                                       lens[row:row + 1], 0.0625, 24)
        assert torch.equal(alone[0], together[row]), row
    flipped = torch.ops.genserve.paged_decode_window(q.flip(0).contiguous(), k, v, tables.flip(0).contiguous(),
                                                     lens.flip(0).contiguous(), 0.0625, 24)
    assert torch.equal(flipped.flip(0), together)


def test_bad_inputs_raise():
    q, k, v, tables, lens = make_case([5], 1, 2, 96 + 32, 16, torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="window"):
        torch.ops.genserve.paged_decode_window(q, k, v, tables, lens, 0.1, -1)
    q, k, v, tables, lens = make_case([5], 1, 2, 96, 16, torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.genserve.paged_decode_window(q, k, v, tables, lens, 0.1, 0)
    q, k, v, tables, lens = make_case([5], 1, 6, 128, 16, torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="query heads per KV head"):
        torch.ops.genserve.paged_decode_window(q, k, v, tables, lens, 0.1, 0)


def test_serves_only_what_it_computes():
    spec = AttentionSpec(0.0625, 512)
    assert window_kernel_serves(4, 1, 256, torch.bfloat16, torch.bfloat16, spec)
    assert window_kernel_serves(32, 4, 128, torch.bfloat16, torch.bfloat16, None)
    assert not window_kernel_serves(4, 1, 256, torch.bfloat16, torch.int8, spec)       # 8-bit pools
    assert not window_kernel_serves(4, 1, 256, torch.bfloat16, torch.bfloat16,
                                    AttentionSpec(0.0625, None, 50.0))                  # softcap
    assert not window_kernel_serves(4, 1, 96, torch.bfloat16, torch.bfloat16, None)
    assert not window_kernel_serves(12, 2, 128, torch.bfloat16, torch.bfloat16, None)  # group 6


@pytest.mark.parametrize("hd", [128, 256])
def test_backend_decode_rows_match_the_sdpa_path(hd):
    """The "cpu-kernels" backend's decode rows of a windowed, rescaled layer (`paged_sdpa.attend`
    with a spec) against the same step through torch SDPA, bf16."""
    from engine.attention import CpuBackend
    from engine.attention.base import GatherBuffer, StepLayout, build_metadata

    block = 16
    g = torch.Generator().manual_seed(hd)
    cache = torch.randn(2, 12, block, 1, hd, generator=g).to(torch.bfloat16)
    segments = [(40, 1, [3, 7, 1], True), (9, 1, [5], True), (100, 1, [0, 2, 4, 6, 8, 9, 10], True)]
    q = torch.randn(3, 4, hd, generator=g).to(torch.bfloat16)
    spec = AttentionSpec(hd ** -0.5 * 0.7, 20)
    layout = StepLayout.from_segments(segments, block)
    outs = []
    for kernels in (True, False):
        backend = CpuBackend(kernels)
        meta, _ = build_metadata(backend, layout, q.dtype, cache.device, cache.shape[1], GatherBuffer())
        outs.append(backend.attend(q, cache, meta, spec).float())
    assert (outs[0] - outs[1]).abs().max().item() < 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("hd", [128, 256])
def test_the_avx2_build_matches_dense_reference(request, hd):
    """The x86-64-v3 build (AVX2 without AVX512: the generic loop) of the same op, on a host
    whose own build is AVX512's (the fixture `avx2_attention` skips elsewhere)."""
    request.getfixturevalue("avx2_attention")
    from tests.engine.avx2_builds import ATTENTION_LIBRARY

    op = getattr(torch.ops, ATTENTION_LIBRARY).paged_decode_window
    for window in (0, 20):
        q, k, v, tables, lens = make_case([1, 17, 45, 130], 2, 4, hd, 16, torch.bfloat16, seed=hd + window)
        out = op(q, k, v, tables, lens, 0.0625, window)
        want = dense_reference(q, k, v, tables, lens, 0.0625, window)
        assert bool(((out.float() - want).abs() <= want.abs() * 2.0 ** -8 + 2e-5).all())
