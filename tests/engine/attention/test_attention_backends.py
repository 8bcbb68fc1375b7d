"""Every attention backend against genserve's own masks and a dense fp32 reference, on a random
step with decode rows, prefill pieces at offsets, GQA, shuffled blocks and a shared prompt block."""

from __future__ import annotations

import importlib

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.attention import CpuBackend, FlexBackend, SdpaBackend, XformersBackend, attend_step, choose_backend
from engine.attention.base import AttentionMetadata, StepLayout, build_metadata, store_kv
from engine.attention.xformers import xformers_step_bias
from tests.engine.attention_oracle import paged_step_mask, step_metadata

BS, KVH, GROUP, HD, NUM_BLOCKS = 16, 3, 3, 64, 96
H = KVH * GROUP


def xformers_or_skip():
    try:
        importlib.import_module("xformers.ops.fmha")
    except ImportError:
        pytest.skip("xformers is not installed (pip install --no-deps xformers==0.0.35; "
                    "its masks run on CPU, its kernels need CUDA)")


def random_step(seed: int = 0):
    """(spans, their tokens' count): 4 decode rows (contexts 1, 17, 64, 333), a first prefill
    piece [0, 64) and a later one [64, 150) of another request, a 40-token piece at [0, 40) that
    shares its first block with the previous request (prefix caching); block ids shuffled."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()

    def table(tokens: int) -> list[int]:
        return [free.pop() for _ in range(-(-tokens // BS))]

    spans = [(c - 1, 1, table(c), True) for c in (1, 17, 64, 333)]
    spans.append((0, 64, table(64), False))
    later = table(150)
    spans.append((64, 86, later, False))
    spans.append((0, 40, [later[0]] + table(40)[1:], False))         # block 0 shared
    return spans


def own_pool_mask(spans, meta: AttentionMetadata) -> torch.Tensor:
    """genserve's CPU masks (`build_metadata`'s decode_bias and each piece's causal bias
    over its logical keys) mapped onto pool slots through the block tables."""
    rows = []
    decode = [s for s in spans if s[3]]
    for i, (_, _, table, _) in enumerate(decode):
        allowed = meta.decode_bias[i, 0, 0] == 0                               # [nb · bs]
        row = torch.zeros(NUM_BLOCKS * BS, dtype=torch.bool)
        for j in allowed.nonzero()[:, 0].tolist():
            row[table[j // BS] * BS + j % BS] = True
        rows.append(row[None])
    for (start, length, table, _), seq in zip([s for s in spans if not s[3]], meta.pieces):
        block = torch.zeros(length, NUM_BLOCKS * BS, dtype=torch.bool)
        allowed = torch.ones(length, seq.context_len, dtype=torch.bool) if seq.bias is None \
            else seq.bias[0, 0] == 0
        for j in range(seq.context_len):
            block[:, table[j // BS] * BS + j % BS] = allowed[:, j]
        rows.append(block)
    return torch.cat(rows)


def dense_reference(q: torch.Tensor, cache: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 softmax(q·kᵀ/√d masked) · v over the whole pool; q [T, H, hd], mask [T, pool]."""
    keys = cache[0].reshape(-1, KVH, HD).float().repeat_interleave(GROUP, dim=1)   # [N, H, hd]
    values = cache[1].reshape(-1, KVH, HD).float().repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("thd,nhd->htn", q.float(), keys) * HD ** -0.5
    scores.masked_fill_(~mask[None], float("-inf"))
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), values)


def test_pool_mask_is_genserves_own_mask_for_the_same_segments():
    spans = random_step()
    meta = step_metadata(spans, BS, torch.float32)
    mask = paged_step_mask(spans, BS, NUM_BLOCKS)
    assert mask.shape == (4 + 64 + 86 + 40, NUM_BLOCKS * BS)
    assert torch.equal(mask, own_pool_mask(spans, meta))
    assert mask.sum(dim=1)[:4].tolist() == [1, 17, 64, 333]          # decode rows: whole context
    assert mask[4 + 64 + 85].sum().item() == 150                       # last token of [64, 150)


def test_xformers_biases_materialised_equal_genserves_mask():
    xformers_or_skip()
    spans = random_step(1)
    want = paged_step_mask(spans, BS, NUM_BLOCKS)
    t = want.shape[0]
    width = max(-(-(s + n) // BS) for s, n, _, _ in spans)
    paged = xformers_step_bias(spans, BS, paged_keys=True)
    physical = (max(b for s in spans for b in s[2]) + 1) * BS
    # xformers materialises the paged mask from its logical shape onto the physical pages.
    got = paged.materialize((t, len(spans) * width * BS)) == 0
    assert got.shape == (t, physical)
    assert torch.equal(got, want[:, :physical]) and not want[:, physical:].any()
    # The gathered layout: segment i's keys at [i · width · bs, ...) in logical order.
    gathered = xformers_step_bias(spans, BS, paged_keys=False)
    got = gathered.materialize((t, len(spans) * width * BS)) == 0
    expect = torch.zeros_like(got)
    q = 0
    for i, (start, length, table, _) in enumerate(spans):
        for j in range(start + length):
            expect[q:q + length, i * width * BS + j] = want[q:q + length, table[j // BS] * BS + j % BS]
        q += length
    assert torch.equal(got, expect)


def test_flex_block_mask_equals_genserves_mask_and_covers_every_allowed_key():
    spans = random_step(2)
    want = paged_step_mask(spans, BS, NUM_BLOCKS)
    t = want.shape[0]
    backend = FlexBackend(compiled=False)
    meta = step_metadata(spans, BS, torch.float32, backend=backend, device="cpu",
                                   num_blocks=NUM_BLOCKS)
    bm = meta.state
    rows = bm.seq_lengths[0]
    assert rows == 256 > t                                  # queries padded to a power of two
    q_idx, kv_idx = torch.arange(rows)[:, None], torch.arange(NUM_BLOCKS * BS)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    elementwise = bm.mask_mod(zero, zero, q_idx, kv_idx)
    assert not elementwise[t:].any()                        # padding rows attend nothing
    elementwise = elementwise[:t]
    tiles = bm.to_dense()[0, 0].bool()                                   # [query tiles, key tiles]
    qt, kt = bm.BLOCK_SIZE
    covered = tiles.repeat_interleave(qt, 0).repeat_interleave(kt, 1)[:t, :NUM_BLOCKS * BS]
    assert torch.equal(elementwise & covered, want)
    assert torch.equal(elementwise, want)                     # the tiles drop no allowed key
    assert covered.sum() < covered.numel()                    # and do skip some tiles


def cpu_backends():
    out = [pytest.param(CpuBackend(False), id="cpu-sdpa"), pytest.param(SdpaBackend(), id="sdpa"),
           pytest.param(FlexBackend(compiled=False), id="flex-eager")]
    out.append(pytest.param("kernels", id="cpu-kernels"))
    return out


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_backends_match_dense_fp32_reference(backend, dtype, tol):
    if backend == "kernels":
        if not genserve_kernels.available():
            pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?)")
        backend = CpuBackend(True)
    spans = random_step(3)
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(2, NUM_BLOCKS, BS, KVH, HD, generator=g).to(dtype)
    t = sum(n for _, n, _, _ in spans)
    q = torch.randn(t, H, HD, generator=g).to(dtype)
    meta = step_metadata(spans, BS, dtype)
    store_kv(torch.randn(t, KVH, HD, generator=g).to(dtype),
             torch.randn(t, KVH, HD, generator=g).to(dtype), cache, meta.slots)
    out = attend_step(backend, q, cache, spans, BS)
    want = dense_reference(q, cache, paged_step_mask(spans, BS, NUM_BLOCKS))
    err = (out.float() - want).abs().max().item()
    assert out.dtype == dtype and out.shape == (t, H, HD)
    assert err < tol, (backend.name, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="xformers and compiled FlexAttention "
                    "kernels need a CUDA device; none here")
@pytest.mark.parametrize("name", ["xformers", "xformers-gathered", "flex", "sdpa"])
def test_cuda_backends_match_dense_fp32_reference(name):
    if name.startswith("xformers"):
        xformers_or_skip()
        backend = XformersBackend(name == "xformers")
    elif name == "flex":
        backend = FlexBackend(compiled=True)
    else:
        backend = SdpaBackend()
    spans = random_step(5)
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(2, NUM_BLOCKS, BS, KVH, HD, generator=g).half()
    t = sum(n for _, n, _, _ in spans)
    q = torch.randn(t, H, HD, generator=g).half()
    want = dense_reference(q, cache, paged_step_mask(spans, BS, NUM_BLOCKS))
    out = attend_step(backend, q.cuda(), cache.cuda(), spans, BS)
    assert (out.float().cpu() - want).abs().max().item() < 2e-2


def test_choice_is_made_once_and_named():
    cpu = choose_backend("cpu", torch.bfloat16, BS, H, KVH, HD, kernels=False)
    assert isinstance(cpu, CpuBackend) and cpu.name == "cpu-sdpa"
    assert choose_backend("cpu", torch.bfloat16, BS, H, KVH, HD, kernels=False) is cpu
    flex = choose_backend("cpu", torch.float32, BS, H, KVH, HD, preferred="flex")
    assert flex.name == "flex" and isinstance(flex, FlexBackend)
    assert choose_backend("cpu", torch.float32, BS, H, KVH, HD, preferred="sdpa").name == "sdpa"
    with pytest.raises(ValueError, match="one of cpu, sdpa, flex, xformers"):
        choose_backend("cpu", torch.float32, BS, H, KVH, HD, preferred="flash")
    with pytest.raises(RuntimeError, match="'xformers' cannot run on cpu"):
        choose_backend("cpu", torch.float32, BS, H, KVH, HD, preferred="xformers")


def test_every_backend_gets_the_same_metadata_and_the_callers_ints():
    """One builder for every backend: the CPU backend's metadata and the SDPA backend's have the
    same slots, tables, lengths and masks, and the caller's lists ride in the same copy."""
    spans = random_step(7)
    host = step_metadata(spans, BS, torch.bfloat16)
    dev, extra = build_metadata(SdpaBackend(), StepLayout.from_segments(spans, BS), torch.bfloat16,
                                "cpu", NUM_BLOCKS, extra=([5, 6, 7], [1]))
    for name in ("slots", "decode_blocks", "decode_bias", "decode_lens"):
        assert torch.equal(getattr(host, name), getattr(dev, name)), name
    for a, b in zip(host.pieces, dev.pieces, strict=True):
        assert (a.q_start, a.q_end, a.context_len) == (b.q_start, b.q_end, b.context_len)
        assert torch.equal(a.blocks, b.blocks)
        assert (a.bias is None and b.bias is None) or torch.equal(a.bias, b.bias)
    assert [x.tolist() for x in extra] == [[5, 6, 7], [1]]
