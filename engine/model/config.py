"""The model's configuration: one frozen record with every architectural option explicit.

Every family the registry serves (`engine.model.registry`) is the same decoder-only network
with options switched on or off: a family's module turns its checkpoint's config into a
`ModelArgs`, and the shared layers (`engine.model.transformer`) read nothing else. An option a
checkpoint asks for that `ModelArgs` cannot express is refused by the family's module at load,
never ignored.

The options, and the families that use them:

=============================  =====================================================
option                         used by
=============================  =====================================================
`head_dim` ≠ dim / n_heads     Qwen3, Gemma 2/3, Mistral-Nemo
`qkv_bias`                     Qwen2 / Qwen2.5
`qk_norm`                      Qwen3, Gemma 3 (per-head RMSNorm before RoPE)
`norm_offset` 1                Gemma 2/3 (the checkpoint stores w of (1 + w)·x̂)
`sandwich_norm`                Gemma 2/3 (norms after attention and after the MLP too)
`activation` "gelu_tanh"       Gemma 2/3 (GeGLU)
`embedding_scale`              Gemma 2/3 (√dim)
`attn_softcap`                 Gemma 2 (50)
`final_softcap`                Gemma 2 (30)
`query_scale`                  Gemma 2/3 (query_pre_attn_scalar^-½)
`layers[i].sliding_window`     Mistral, Gemma 2 (alternating), Gemma 3 (5 local : 1 global)
`layers[i].rope_theta`         Gemma 3 (10k local, 1M global)
`RopeScaling`                  Llama 3.1+ (llama3), Gemma 3 (linear), Phi-3 (longrope),
                               Qwen (yarn)
`partial_rotary`               Phi-4-mini (0.75)
`tie_embeddings`               Llama 3.2, Qwen small sizes, Gemma
`moe`                          Qwen3-MoE (top-8 of 128), Mixtral (top-2 of 8)
=============================  =====================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How a layer's RoPE frequencies are stretched past the context the model was trained on
    (`engine.model.rope.rope_inv_freq` computes them).

    Attributes:
        kind: "default" (none), "linear" (positions / factor; Chen et al. 2023), "llama3"
            (Meta's wavelength-banded smoothing of Llama 3.1), "yarn" (Peng et al. 2023),
            "longrope" (Ding et al. 2024, Phi-3), "freq_factors" (per-pair divisors as a GGUF
            stores them: llama.cpp writes Llama 3.1's scaling as the tensor `rope_freqs.weight`).
        factor: the context extension factor (linear, llama3, yarn; longrope's derived one).
        original_max_context: positions of the pre-training context (llama3, yarn, longrope).
        low_freq_factor, high_freq_factor: llama3's band edges (wavelengths longer than
            original / low_freq_factor are divided by `factor`, shorter than original /
            high_freq_factor kept, smoothed between).
        beta_fast, beta_slow: yarn's ramp bounds in rotations; truncate: round the ramp's
            dimension range outwards (transformers' default).
        attention_factor: scale of cos and sin (yarn: 0.1·ln(factor) + 1 unless given; longrope:
            √(1 + ln(factor) / ln(original)) unless given); 1 for the other kinds.
        short_factor, long_factor: longrope's per-pair divisors, head_dim_rotary / 2 each. The
            long ones serve when the served context (`ModelArgs.max_context`, which the builder
            lowers to `--max-context`) is longer than `original_max_context` (llama.cpp's rule:
            a fixed choice per server, so every request, every batch and the prefix cache see
            the same rotations; transformers chooses per forward by the sequence's length).
        freq_factors: "freq_factors"' per-pair divisors, head_dim_rotary / 2 of them (θ_j is
            divided by freq_factors[j]; ggml's `ggml_rope_ext` with `freq_factors`).
    """

    kind: str = "default"
    factor: float = 1.0
    original_max_context: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RoPE scaling {self.kind!r} is not supported; one of {', '.join(ROPE_KINDS)}")
        if self.kind in ("llama3", "yarn", "longrope") and self.original_max_context <= 0:
            raise ValueError(f"RoPE scaling {self.kind!r} needs original_max_position_embeddings")
        if self.kind == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("RoPE scaling 'longrope' needs short_factor and long_factor")
        if self.kind == "freq_factors" and not self.freq_factors:
            raise ValueError("RoPE scaling 'freq_factors' needs freq_factors")


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's attention kind.

    Attributes:
        sliding_window: None for global attention; else W, the keys a query sees: positions
            p - W + 1 .. p (transformers' `sliding_window`, the query's own key included).
        rope_theta: this layer's RoPE base.
        rope_scaling: this layer's RoPE scaling.
    """

    sliding_window: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 1")

    @property
    def rope_key(self) -> tuple[float, RopeScaling]:
        """What decides this layer's RoPE table (layers with equal keys share one)."""
        return self.rope_theta, self.rope_scaling


@dataclass(frozen=True, slots=True)
class MoEArgs:
    """A sparse mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Jiang et al. 2024): a
    router picks `top_k` of `n_experts` gated MLPs per token and adds their outputs, each weighted
    by its routing probability (`engine.model.mlp.MoEFeedForward`).

    Attributes:
        n_experts: experts per MoE layer (Qwen3-30B-A3B: 128, Mixtral: 8).
        top_k: experts each token runs (8 / 2).
        expert_size: each expert's gated MLP hidden size (`moe_intermediate_size`: 768; Mixtral's
            `intermediate_size`: 14,336).
        norm_topk_prob: the top-k probabilities are divided by their sum (Mixtral always,
            Qwen3-MoE where the config says); otherwise they are the softmax over all experts.
        sparse_layers: per layer, True where the MLP is the MoE one, False where it is the dense
            MLP of `ModelArgs.intermediate_size` (Qwen3-MoE's `mlp_only_layers` and
            `decoder_sparse_step`).
    """

    n_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top-{self.top_k} routing over {self.n_experts} experts")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """A decoder-only transformer, every option explicit (the module docstring's table).

    Attributes:
        dim: hidden size (576 for SmolLM2-135M, 4096 for Llama-2-7B).
        n_layers: transformer blocks (30 / 32).
        n_heads: query heads (9 / 32).
        n_kv_heads: key/value heads, GQA groups (3 / 32).
        intermediate_size: gated MLP hidden size (1536 / 11008).
        vocab_size: tokens (49,152 / 32,000).
        max_context: positions the RoPE tables cover (8,192 / 4,096).
        rope_theta: RoPE base of every layer not listed in `layers` (100,000 / 10,000).
        norm_eps: RMSNorm epsilon (1e-5).
        tie_embeddings: the output projection shares the token embedding matrix.
        architecture: the checkpoint's `architectures` name (or the GGUF's family), for messages.
        head_dim: per-head size; 0 means dim // n_heads (set in `__post_init__`).
        qkv_bias: Q, K and V projections carry biases; o_bias: the output projection does.
        qk_norm: per-head RMSNorm of q and k (weights [head_dim]) before RoPE.
        norm_offset: what the checkpoint's norm weights are stored as: 0 for w·x̂, 1 for
            (1 + w)·x̂ (Gemma). The loader folds it in, so the network computes w·x̂ always.
        sandwich_norm: RMSNorm of the attention and MLP outputs before their residual adds.
        activation: the gated MLP's gate function, "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
        embedding_scale: the token embeddings are multiplied by this (Gemma: √dim, rounded to
            the model dtype as transformers rounds it).
        attn_softcap: scores become c·tanh(s / c) before the softmax; None: off.
        final_softcap: the logits become c·tanh(z / c); None: off.
        query_scale: the attention score scale; 0 means head_dim^-½.
        rope_scaling: RoPE scaling of every layer not listed in `layers`.
        partial_rotary: the fraction of each head's dimensions RoPE rotates (the first ones).
        layers: per-layer attention kinds, n_layers of them; empty means every layer global
            with `rope_theta` and `rope_scaling`.
        moe: the mixture-of-experts MLP and the layers that have it; None: every MLP dense.
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
    architecture: str = "LlamaForCausalLM"
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norm: bool = False
    activation: str = "silu"
    embedding_scale: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float = 0.0
    rope_scaling: RopeScaling = RopeScaling()
    partial_rotary: float = 1.0
    layers: tuple[LayerAttention, ...] = ()
    moe: MoEArgs | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads do not split into {self.n_kv_heads} KV groups")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported; one of {', '.join(ACTIVATIONS)}")
        if self.layers and len(self.layers) != self.n_layers:
            raise ValueError(f"{len(self.layers)} layer kinds for {self.n_layers} layers")
        plain = LayerAttention(None, self.rope_theta, self.rope_scaling)
        if self.layers and all(layer == plain for layer in self.layers):
            object.__setattr__(self, "layers", ())       # one spelling of "every layer global"
        if self.moe is not None and len(self.moe.sparse_layers) != self.n_layers:
            raise ValueError(f"{len(self.moe.sparse_layers)} MoE layer flags for {self.n_layers} layers")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary {self.partial_rotary} of head_dim {self.head_dim} "
                             "is not an even number of dimensions")

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates: int(head_dim · partial_rotary)."""
        return int(self.head_dim * self.partial_rotary)

    @property
    def scale(self) -> float:
        """The attention score scale: `query_scale`, or head_dim^-½ (Vaswani et al. 2017)."""
        return self.query_scale or self.head_dim ** -0.5

    def layer(self, i: int) -> LayerAttention:
        """Layer i's attention kind (the model-wide RoPE and no window unless `layers` says)."""
        if self.layers:
            return self.layers[i]
        return LayerAttention(None, self.rope_theta, self.rope_scaling)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global)."""
        return tuple(self.layer(i).sliding_window for i in range(self.n_layers))

    @property
    def plain_llama(self) -> bool:
        """True when the network is the 2023 Llama block: no bias, no q/k norm, no sandwich
        norms, SwiGLU, no softcaps, the default score scale, no embedding scale, full rotary,
        every layer global and every MLP dense (the embedded model's; the 4-bit `--weights q4`
        reader takes only this block)."""
        return (not (self.qkv_bias or self.o_bias or self.qk_norm or self.sandwich_norm)
                and self.activation == "silu" and self.embedding_scale == 1.0
                and self.attn_softcap is None and self.final_softcap is None
                and self.query_scale in (0.0, self.head_dim ** -0.5) and self.partial_rotary == 1.0
                and all(w is None for w in self.sliding_windows) and self.moe is None)

    def is_sparse(self, i: int) -> bool:
        """Whether layer i's MLP is the mixture of experts (`moe`)."""
        return self.moe is not None and self.moe.sparse_layers[i]

    def replace(self, **changes) -> "ModelArgs":
        """A copy with `changes` (`dataclasses.replace`; head_dim recomputed if dim or heads change
        and head_dim is not given)."""
        if ({"dim", "n_heads"} & changes.keys()) and "head_dim" not in changes:
            changes["head_dim"] = 0
        return dataclasses.replace(self, **changes)

    @classmethod
    def smollm2_135m(cls) -> "ModelArgs":
        """SmolLM2-135M-Instruct (values from its GGUF metadata)."""
        return cls(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                   vocab_size=49152, max_context=8192, rope_theta=100000.0, norm_eps=1e-5,
                   tie_embeddings=True)

    @classmethod
    def llama2_7b(cls) -> "ModelArgs":
        """Llama-2-7B, the reference deployment's model (docs/design.md): 32 layers, 32 heads, head
        dim 128, vocabulary 32,000."""
        return cls(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
                   vocab_size=32000, max_context=4096, rope_theta=10000.0, norm_eps=1e-5)
