"""Rotary position embeddings (RoPE, Su et al. 2021): the rotation table, and the Q/K row orders
the three places a checkpoint's rows come from use.

A head's dimension pairs are rotated together. Hugging Face checkpoints pair dimension j with
j + head_dim / 2 ("rotate half"); llama.cpp's GGUF files and the original Llama code pair 2j with
2j + 1 ("interleaved"). genserve's model computes in the interleaved order (one complex product
per pair, `rope_tables`), so a Hugging Face Q or K projection is reordered at load
(`interleave_rope_rows`), and a GGUF one is read as it is stored. `unpermute_rope_rows` turns a
GGUF projection back into Hugging Face order, for comparing with transformers.
"""

from __future__ import annotations

import math

import torch

from engine.model.config import RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling = RopeScaling(),
                  max_context: int = 0) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies θ_j, fp32 [rotary_dim / 2], and the factor cos and sin are
    scaled by, for `scaling` (`engine.model.config.RopeScaling`).

    θ_j = theta^(-2j / rotary_dim) (Su et al. 2021), then per kind, with the formulas of
    transformers' `modeling_rope_utils` (the reference the tests compare with):

    * linear: θ_j / factor (Chen et al. 2023, position interpolation).
    * llama3: wavelengths λ_j = 2π / θ_j above original / low_freq_factor are divided by
      factor, below original / high_freq_factor kept, and between them blended with
      s = (original / λ_j − low) / (high − low): (1 − s)·θ_j / factor + s·θ_j (Meta, Llama 3.1).
    * yarn: θ_j blended between θ_j / factor and θ_j by a linear ramp over the dimensions whose
      rotations in the original context lie between beta_slow and beta_fast; cos and sin scaled
      by 0.1·ln(factor) + 1 unless `attention_factor` says (Peng et al. 2023, eqs. 17–21).
    * longrope: θ_j / long_factor_j when `max_context` > the original context, else
      / short_factor_j; cos and sin scaled by √(1 + ln(factor) / ln(original)) with factor =
      max_context / original unless given (Ding et al. 2024; transformers computes the same).
    * freq_factors: θ_j / freq_factors_j (llama.cpp's `rope_freqs.weight`; for Llama 3.1 it
      holds exactly llama3's per-pair divisors, computed by llama.cpp's converter).

    Args:
        rotary_dim: dimensions RoPE rotates (even).
        theta: the base.
        scaling: the scaling.
        max_context: the server's context, positions (longrope's choice of factors and default
            factor).
    Returns:
        (θ fp32 [rotary_dim / 2], attention factor).
    Raises:
        ValueError: longrope factors or freq_factors of the wrong length.
    """
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponent)
    kind, factor = scaling.kind, scaling.factor
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "freq_factors":
        if len(scaling.freq_factors) != rotary_dim // 2:
            raise ValueError(f"freq_factors: {len(scaling.freq_factors)} given, {rotary_dim // 2} rotated pairs")
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32), 1.0
    original = scaling.original_max_context
    if kind == "llama3":
        low_wavelen = original / scaling.low_freq_factor
        high_wavelen = original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        attention = scaling.attention_factor
        if attention is None:
            attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

        def correction_dim(rotations: float) -> float:
            return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention)
    # longrope
    factors = scaling.long_factor if max_context > original else scaling.short_factor
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"longrope factors: {len(factors)} given, {rotary_dim // 2} rotated pairs")
    attention = scaling.attention_factor
    if attention is None:
        ratio = factor if factor > 1 else max_context / original
        attention = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0
    return inv_freq / torch.tensor(factors, dtype=torch.float32), float(attention)


def rope_tables(head_dim: int, max_context: int, theta: float, scaling: RopeScaling = RopeScaling(),
                rotary_dim: int | None = None) -> torch.Tensor:
    """RoPE rotations a·e^(i·p·θ_j) as complex64 [max_context, head_dim / 2] (Su et al. 2021).

    θ_j and the magnitude a come from `rope_inv_freq` for the first rotary_dim / 2 pairs; the
    remaining pairs (partial rotary: only the first `rotary_dim` dimensions rotate) get 1, an
    exact identity. Dimension pair j of a head is (2j, 2j + 1) — the interleaved layout of the
    original Llama code; `interleave_rope_rows` reorders the Q and K rows of Hugging Face's
    rotate-half layout (pair (j, j + rotary_dim / 2)) into it, which rotates the same pairs by
    the same angles in one complex product.

    Args:
        head_dim: per-head size (even); max_context: positions; theta: the RoPE base;
        scaling: the RoPE scaling; rotary_dim: rotated dimensions (None: all of head_dim).
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    inv_freq, attention = rope_inv_freq(rotary_dim, theta, scaling, max_context)
    angles = torch.outer(torch.arange(max_context, dtype=torch.float32), inv_freq)
    table = torch.polar(torch.full_like(angles, attention), angles)
    if rotary_dim == head_dim:
        return table
    identity = torch.ones(max_context, (head_dim - rotary_dim) // 2, dtype=table.dtype)
    return torch.cat([table, identity], dim=1)


def interleave_rope_rows(w: torch.Tensor, heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Reorder the rows of a Q or K projection [heads · hd, ...] (or a bias [heads · hd], or a
    per-head norm weight [hd] with heads = 1) from rotate-half order (pair j = rows j and
    j + rotary_dim / 2 of a head) to interleaved order (pair j = rows 2j, 2j + 1); the rows past
    `rotary_dim` (partial rotary; None: all rotate) stay where they are."""
    hd = w.shape[0] // heads
    rot = hd if rotary_dim is None else rotary_dim
    half = torch.arange(rot // 2)
    order = torch.cat([torch.stack([half, half + rot // 2], dim=1).reshape(-1), torch.arange(rot, hd)])
    return w.reshape(heads, hd, *w.shape[1:])[:, order].reshape(w.shape)


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's RoPE row permutation of a Q or K projection weight.

    llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the rows of each head
    from the Hugging Face ``rotate_half`` layout ``[x_0 .. x_{h/2-1}, y_0 .. y_{h/2-1}]`` to the
    interleaved layout ``[x_0, y_0, x_1, y_1, ...]`` its own RoPE kernel expects::

        w.reshape(n_heads, 2, hd // 2, in).swapaxes(1, 2).reshape(w.shape)

    This is the inverse, as in transformers' ``LlamaTensorProcessor._reverse_permute_weights``::

        w.reshape(n_heads, hd // 2, 2, in).swapaxes(1, 2).reshape(w.shape)

    Args:
        weight: ``[n_heads * head_dim, in_features]``, GGUF row order.
        n_heads: heads the rows belong to (``n_heads`` for Q, ``n_kv_heads`` for K).

    Returns:
        A new contiguous tensor of the same shape and dtype, Hugging Face row order.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    if rows % n_heads or head_dim % 2:
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of even size")
    return (weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())
