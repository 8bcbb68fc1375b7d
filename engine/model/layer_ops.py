"""The per-token steps of a Llama block between its matrix products, in two implementations.

`TorchLayerOps` composes torch ops; `KernelLayerOps` calls genserve's fused CPU kernels
(`engine/kernels/csrc/layer_ops.cpp`, built by `engine.kernels`), one pass over the rows per step instead
of 3–12 torch ops with their dispatch and fp32 temporaries. Both compute the same formulas in fp32
and round once to the activation dtype (the kernels round `silu(gate) · up` and `gelu(gate) · up`
once where torch rounds the activation first, so bf16 results may differ in the last bit); every row is computed
alone, so neither makes a row depend on the rest of the batch. One process uses one of them,
chosen by the model runner with its attention backend (`Transformer.forward`'s `ops`).

Shapes: T tokens of the flat batch, D = dim, H / KVH query / KV heads, hd = head_dim,
F = intermediate size. Activations are bf16 or fp32; norm weights and the RoPE table fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import store_kv


class TorchLayerOps:
    """The block's elementwise steps as plain torch ops (the fallback; any device)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, D] / sqrt(mean(x²) + eps) · weight [D] fp32, in fp32, returned in x's dtype
        (Zhang & Sennrich 2019; HF Llama's order)."""
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)

    @staticmethod
    def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """h [T, D] += delta (in place, the residual stream), then `rms_norm(h)`."""
        h.add_(delta)
        return TorchLayerOps.rms_norm(h, weight, eps)

    @staticmethod
    def rope_store_kv(qkv: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor,
                      cache: torch.Tensor, slots: torch.Tensor, n_heads: int,
                      n_kv_heads: int) -> torch.Tensor:
        """RoPE (Su et al. 2021) on the Q and K parts of a fused projection; K and V stored.

        Args:
            qkv: [T, (H + 2·KVH)·hd], Q | K | V, Q and K in interleaved-pair order.
            rope: fp32 [max_context, hd / 2, 2], (cos, sin) of position p, pair j.
            positions: int64 [T]; slots: int64 [T], each token's row in the cache pools.
            cache: one layer's pools [2, num_blocks, block_size, KVH, hd] (K, V), or int8 rows of
                the 8-bit format (`engine.attention.kv_quant`), written.
        Returns:
            q [T, H, hd] rotated: (a, b) of pair j → (a·cos − b·sin, a·sin + b·cos).
        """
        t, hd = qkv.shape[0], qkv.shape[1] // (n_heads + 2 * n_kv_heads)
        qk, v = qkv.split([(n_heads + n_kv_heads) * hd, n_kv_heads * hd], dim=-1)
        freqs = torch.view_as_complex(rope[positions])                       # [T, hd / 2]
        xc = torch.view_as_complex(qk.float().reshape(t, n_heads + n_kv_heads, hd // 2, 2))
        qk = torch.view_as_real(xc * freqs[:, None]).flatten(-2).to(qkv.dtype)
        q, k = qk.split([n_heads, n_kv_heads], dim=1)
        store_kv(k, v.reshape(t, n_kv_heads, hd), cache, slots)
        return q

    @staticmethod
    def norm_rope_store_kv(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, rope: torch.Tensor, positions: torch.Tensor,
                           cache: torch.Tensor, slots: torch.Tensor, n_heads: int,
                           n_kv_heads: int) -> torch.Tensor:
        """`rope_store_kv` after each q head and each k head of `qkv` is RMS-normed over its hd
        dimensions (`rms_norm` with q_weight / k_weight, fp32 [hd] in interleaved-RoPE order;
        Qwen3, Gemma 3: before RoPE), v unchanged. Same arguments, result and errors as
        `rope_store_kv` otherwise."""
        t, hd = qkv.shape[0], qkv.shape[1] // (n_heads + 2 * n_kv_heads)
        q, k, v = qkv.split([n_heads * hd, n_kv_heads * hd, n_kv_heads * hd], dim=-1)
        q = TorchLayerOps.rms_norm(q.reshape(-1, hd), q_weight, eps).view(t, -1)
        k = TorchLayerOps.rms_norm(k.reshape(-1, hd), k_weight, eps).view(t, -1)
        return TorchLayerOps.rope_store_kv(torch.cat([q, k, v], dim=-1), rope, positions, cache,
                                           slots, n_heads, n_kv_heads)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's product (Shazeer 2020): gate_up [T, 2F] = gate | up → silu(gate) · up [T, F]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU's product (Gemma): gate_up [T, 2F] = gate | up → gelu_tanh(gate) · up [T, F],
        GELU's tanh approximation 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)


class KernelLayerOps:
    """The same steps in genserve's fused CPU kernels (`torch.ops.genserve.*`); same arguments,
    shapes and errors as `TorchLayerOps` (RuntimeError on a bad shape, dtype, position or slot).
    Only usable once `engine.kernels.available()` returned True."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """See `TorchLayerOps.rms_norm`."""
        return torch.ops.genserve.rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """See `TorchLayerOps.add_rms_norm_`."""
        return torch.ops.genserve.add_rms_norm_(h, delta, weight, eps)

    @staticmethod
    def rope_store_kv(qkv: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor,
                      cache: torch.Tensor, slots: torch.Tensor, n_heads: int,
                      n_kv_heads: int) -> torch.Tensor:
        """See `TorchLayerOps.rope_store_kv`."""
        return torch.ops.genserve.rope_store_kv(qkv, rope, positions, cache, slots,
                                                n_heads, n_kv_heads)

    @staticmethod
    def norm_rope_store_kv(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, rope: torch.Tensor, positions: torch.Tensor,
                           cache: torch.Tensor, slots: torch.Tensor, n_heads: int,
                           n_kv_heads: int) -> torch.Tensor:
        """See `TorchLayerOps.norm_rope_store_kv` (one pass: each head normed, rounded to qkv's
        dtype, rotated)."""
        return torch.ops.genserve.norm_rope_store_kv(qkv, q_weight, k_weight, eps, rope, positions,
                                                     cache, slots, n_heads, n_kv_heads)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """See `TorchLayerOps.silu_mul`."""
        return torch.ops.genserve.silu_mul(gate_up)

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """See `TorchLayerOps.gelu_tanh_mul` (rounded once, after the product)."""
        return torch.ops.genserve.gelu_tanh_mul(gate_up)
