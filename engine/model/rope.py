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

import torch


def rope_tables(head_dim: int, max_context: int, theta: float) -> torch.Tensor:
    """RoPE rotations e^(i·p·θ_j) as complex64 [max_context, head_dim / 2] (Su et al. 2021).

    θ_j = theta^(-2j / head_dim). Dimension pair j of a head is (2j, 2j + 1) — the interleaved
    layout of the original Llama code; `interleave_rope_rows` reorders the Q and K rows of
    Hugging Face's rotate-half layout (pair (j, j + head_dim / 2)) into it, which rotates the same
    pairs by the same angles in one complex product.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_context, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def interleave_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder the rows of a Q or K projection [heads · hd, dim] from rotate-half order
    (pair j = rows j and j + hd/2 of a head) to interleaved order (pair j = rows 2j, 2j + 1)."""
    hd = w.shape[0] // heads
    order = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], dim=1).reshape(-1)
    return w.view(heads, hd, -1)[:, order].reshape(w.shape)


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
