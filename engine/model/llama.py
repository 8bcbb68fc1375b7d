"""Llama-architecture transformer (RMSNorm, RoPE, GQA attention, SwiGLU), gpt-fast style."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Shape of a Llama-architecture model.

    Attributes:
        dim: hidden size (576 for SmolLM2-135M, 4096 for Llama-2-7B).
        n_layers: transformer blocks (30 / 32).
        n_heads: query heads (9 / 32).
        n_kv_heads: key/value heads, GQA groups (3 / 32).
        intermediate_size: SwiGLU hidden size (1536 / 11008).
        vocab_size: tokens (49,152 / 32,000).
        max_context: positions the RoPE table covers (8,192 / 4,096).
        rope_theta: RoPE base (100,000 / 10,000).
        norm_eps: RMSNorm epsilon (1e-5).
        tie_embeddings: output projection shares the token embedding matrix.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_context: int = 8192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        """Per-head size: dim // n_heads (64 / 128)."""
        return self.dim // self.n_heads

    @classmethod
    def smollm2_135m(cls) -> "ModelArgs":
        """SmolLM2-135M-Instruct (values from its GGUF metadata)."""
        return cls(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                   vocab_size=49152, max_context=8192, rope_theta=100000.0, norm_eps=1e-5,
                   tie_embeddings=True)

    @classmethod
    def llama2_7b(cls) -> "ModelArgs":
        """Llama-2-7B, the design card's model: 32 layers, 32 heads, head dim 128, vocab 32,000."""
        return cls(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
                   vocab_size=32000, max_context=4096, rope_theta=10000.0, norm_eps=1e-5)
