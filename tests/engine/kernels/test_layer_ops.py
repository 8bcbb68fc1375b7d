"""The block's per-token steps: both implementations against the formulas, against each other,
row by row (batch invariance), and their errors."""

from __future__ import annotations

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.model.layer_ops import KernelLayerOps, TorchLayerOps
from engine.model.config import ModelArgs
from engine.model.rope import rope_tables

H, KVH, HD, D, F = 9, 3, 64, 576, 1536          # SmolLM2-135M's shapes
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def ops_for(kernels: bool):
    return KernelLayerOps if kernels else TorchLayerOps


def require_kernels() -> None:
    if not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?)")


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """Within the dtype's rounding, relative to the values' scale."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.float().abs().max().item()), err


def rope_table(max_context: int = 64) -> torch.Tensor:
    args = ModelArgs(dim=H * HD, n_layers=1, n_heads=H, n_kv_heads=KVH, intermediate_size=F,
                     vocab_size=10, max_context=max_context, rope_theta=100000.0)
    return torch.view_as_real(rope_tables(args.head_dim, args.max_context, args.rope_theta))                         # [ctx, hd / 2, 2]


def reference_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd] fp32, interleaved pairs rotated by p · 100000^(-2j / hd) (Su et al. 2021)."""
    j = torch.arange(HD // 2, dtype=torch.float64)
    angle = positions.double()[:, None] * 100000.0 ** (-2 * j / HD)       # [T, hd / 2]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_the_formula(kernels, dtype):
    ops = ops_for(kernels)
    x, w, delta = rand(7, D, dtype=dtype), rand(D, seed=1), rand(7, D, dtype=dtype, seed=2)

    def formula(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()

    close(ops.rms_norm(x, w, 1e-5), formula(x), dtype)
    h = x.clone()
    normed = ops.add_rms_norm_(h, delta, w, 1e-5)
    assert torch.equal(h, (x.float() + delta.float()).to(dtype))         # one rounding, in place
    close(normed, formula(h), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_rotates_q_and_k_and_writes_k_and_v_to_their_slots(kernels, dtype):
    ops = ops_for(kernels)
    t = 5
    qkv = rand(t, (H + 2 * KVH) * HD, dtype=dtype)
    positions = torch.tensor([0, 1, 7, 30, 63])
    slots = torch.tensor([3, 40, 17, 0, 63])
    cache = torch.zeros(2, 4, 16, KVH, HD, dtype=dtype)
    q = ops.rope_store_kv(qkv, rope_table(), positions, cache, slots, H, KVH)
    assert q.shape == (t, H, HD) and q.dtype == dtype
    q_in, k_in, v_in = qkv.float().split([H * HD, KVH * HD, KVH * HD], dim=-1)
    close(q, reference_rope(q_in.view(t, H, HD), positions), dtype)
    rows = cache.view(2, -1, KVH, HD)
    close(rows[0, slots], reference_rope(k_in.view(t, KVH, HD), positions), dtype)
    assert torch.equal(rows[1, slots].float(), v_in.view(t, KVH, HD))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not rows[:, untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_formula(kernels, dtype):
    gate_up = rand(6, 2 * F, dtype=dtype)
    g, u = gate_up.double().chunk(2, dim=-1)
    close(ops_for(kernels).silu_mul(gate_up), g / (1 + torch.exp(-g)) * u, dtype)


def test_kernels_give_each_row_the_same_bits_alone_as_in_a_batch():
    require_kernels()
    ops, dtype = KernelLayerOps, torch.bfloat16
    t = 300                                     # large enough to split across threads
    x, w, delta = rand(t, D, dtype=dtype), rand(D, seed=1), rand(t, D, dtype=dtype, seed=2)
    qkv, gate_up = rand(t, (H + 2 * KVH) * HD, dtype=dtype, seed=3), rand(t, 2 * F, dtype=dtype, seed=4)
    positions, slots = torch.arange(t), torch.randperm(t, generator=torch.Generator().manual_seed(5))
    rope = rope_table(512)
    cache = torch.zeros(2, 20, 16, KVH, HD, dtype=dtype)
    norm_all, silu_all = ops.rms_norm(x, w, 1e-5), ops.silu_mul(gate_up)
    h_all = x.clone()
    add_all = ops.add_rms_norm_(h_all, delta, w, 1e-5)
    q_all = ops.rope_store_kv(qkv, rope, positions, cache, slots, H, KVH)
    for i in (0, 1, 150, 299):
        r = slice(i, i + 1)
        assert torch.equal(ops.rms_norm(x[r], w, 1e-5), norm_all[r])
        assert torch.equal(ops.silu_mul(gate_up[r]), silu_all[r])
        h = x[r].clone()
        assert torch.equal(ops.add_rms_norm_(h, delta[r], w, 1e-5), add_all[r])
        alone = torch.zeros_like(cache)
        assert torch.equal(ops.rope_store_kv(qkv[r], rope, positions[r], alone, slots[r], H, KVH),
                           q_all[r])
        assert torch.equal(alone.view(2, -1, KVH, HD)[:, slots[i]],
                           cache.view(2, -1, KVH, HD)[:, slots[i]])


def test_kernel_rope_store_kv_rejects_positions_and_slots_out_of_range():
    require_kernels()
    qkv = rand(2, (H + 2 * KVH) * HD)
    cache = torch.zeros(2, 4, 16, KVH, HD)
    with pytest.raises(RuntimeError, match="position 64 outside the RoPE table"):
        KernelLayerOps.rope_store_kv(qkv, rope_table(64), torch.tensor([0, 64]), cache,
                                     torch.tensor([0, 1]), H, KVH)
    with pytest.raises(RuntimeError, match="slot 64 outside the cache"):
        KernelLayerOps.rope_store_kv(qkv, rope_table(64), torch.tensor([0, 1]), cache,
                                     torch.tensor([0, 64]), H, KVH)
    assert not cache.any()                       # checked before anything is written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_the_formula(kernels, dtype):
    gate_up = rand(6, 2 * F, dtype=dtype, seed=7)
    g, u = gate_up.double().chunk(2, dim=-1)
    gelu = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))
    close(ops_for(kernels).gelu_tanh_mul(gate_up), gelu * u, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("hd", [128, 256])
def test_norm_rope_store_kv_is_the_norms_then_rope_store_kv(dtype, kv_heads, hd):
    """The fused per-head q/k norms + RoPE + K/V store (Qwen3, Gemma 3) against the torch ops'
    norms and RoPE, at their head sizes; with one KV head too (Gemma 3 270M)."""
    require_kernels()
    heads, t = 4, 5
    qkv = rand(t, (heads + 2 * kv_heads) * hd, dtype=dtype, seed=11)
    qw, kw = rand(hd, seed=12) + 1.0, rand(hd, seed=13) + 1.0
    rope = torch.view_as_real(rope_tables(hd, 64, 10000.0))
    positions, slots = torch.tensor([0, 3, 9, 31, 63]), torch.tensor([5, 0, 62, 17, 33])
    caches = [torch.zeros(2, 4, 16, kv_heads, hd, dtype=dtype) for _ in range(2)]
    qs = [ops.norm_rope_store_kv(qkv, qw, kw, 1e-6, rope, positions, cache, slots, heads, kv_heads)
          for ops, cache in zip((KernelLayerOps, TorchLayerOps), caches)]
    close(qs[0], qs[1], dtype)
    close(caches[0], caches[1], dtype)
    assert torch.equal(caches[0][1], caches[1][1])            # v copied, not normed
    # batch invariance: each row alone gives the bits it has in the batch
    for i in range(t):
        alone = torch.zeros_like(caches[0])
        q = KernelLayerOps.norm_rope_store_kv(qkv[i:i + 1], qw, kw, 1e-6, rope, positions[i:i + 1],
                                              alone, slots[i:i + 1], heads, kv_heads)
        assert torch.equal(q[0], qs[0][i])
        rows = slice(int(slots[i]), int(slots[i]) + 1)
        assert torch.equal(alone.view(2, -1, kv_heads, hd)[:, rows], caches[0].view(2, -1, kv_heads, hd)[:, rows])


def test_gelu_tanh_mul_rows_alone_and_in_a_batch():
    require_kernels()
    gate_up = rand(300, 2 * F, dtype=torch.bfloat16, seed=8)
    together = KernelLayerOps.gelu_tanh_mul(gate_up)
    for i in (0, 1, 150, 299):
        assert torch.equal(KernelLayerOps.gelu_tanh_mul(gate_up[i:i + 1]), together[i:i + 1])
