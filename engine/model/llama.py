"""Llama-architecture transformer (RMSNorm, RoPE, GQA attention, SwiGLU), gpt-fast style."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.model.layer_ops import TorchLayerOps
from engine.model.linear import PackedWeight, linear, pack_weights
from engine.model.rope import interleave_rope_rows, rope_tables


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
        """Llama-2-7B, the reference deployment's model (docs/design.md): 32 layers, 32 heads, head
        dim 128, vocabulary 32,000."""
        return cls(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
                   vocab_size=32000, max_context=4096, rope_theta=10000.0, norm_eps=1e-5)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in fp32 (Zhang & Sennrich 2019; HF Llama)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, dim]
        return TorchLayerOps.rms_norm(x, self.weight, self.eps)


def fused_block_matrices(state: dict[str, torch.Tensor], n_layers: int, n_heads: int,
                         n_kv_heads: int) -> dict[str, torch.Tensor]:
    """The fused matrices of every block from the loader's separate ones (`weights.py` names):
    `layers.{i}.attention.wqkv` = Q | K | V rows, Q and K in interleaved-RoPE order
    (`interleave_rope_rows`, whole rows moved, so it serves the GGUF's 4-bit blocks as well as
    numbers), `attention.wo`, `feed_forward.w13` = gate | up rows, and `feed_forward.w2`.
    Raises KeyError on a missing tensor."""
    fused: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        p = f"layers.{i}."
        fused[p + "attention.wqkv"] = torch.cat([
            interleave_rope_rows(state[p + "attention.wq.weight"], n_heads),
            interleave_rope_rows(state[p + "attention.wk.weight"], n_kv_heads),
            state[p + "attention.wv.weight"]])
        fused[p + "attention.wo"] = state[p + "attention.wo.weight"]
        fused[p + "feed_forward.w13"] = torch.cat([state[p + "feed_forward.w1.weight"],
                                                   state[p + "feed_forward.w3.weight"]])
        fused[p + "feed_forward.w2"] = state[p + "feed_forward.w2.weight"]
    return fused


class Attention(nn.Module):
    """GQA self-attention with a fused QKV projection over the paged KV cache."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Parameter(torch.empty(qkv_out, args.dim))
        self.wo = nn.Parameter(torch.empty(args.dim, args.n_heads * args.head_dim))
        self.wqkv_packed: PackedWeight | None = None
        self.wo_packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata, ops: type[TorchLayerOps]) -> torch.Tensor:
        qkv = linear(x, self.wqkv, self.wqkv_packed)                     # x: [T, dim]
        q = ops.rope_store_kv(qkv, rope, positions, cache, meta.slots,   # [T, H, hd]; K, V stored
                              self.n_heads, self.n_kv)
        o = meta.backend.attend(q, cache, meta)
        return linear(o.reshape(x.shape[0], -1), self.wo, self.wo_packed)             # [T, dim]


class FeedForward(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused (Shazeer 2020)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.ffn = args.intermediate_size
        self.w13 = nn.Parameter(torch.empty(2 * args.intermediate_size, args.dim))
        self.w2 = nn.Parameter(torch.empty(args.dim, args.intermediate_size))
        self.w13_packed: PackedWeight | None = None
        self.w2_packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor, ops: type[TorchLayerOps]) -> torch.Tensor:    # x: [T, dim]
        gate_up = linear(x, self.w13, self.w13_packed)                               # [T, 2·ffn]
        return linear(ops.silu_mul(gate_up), self.w2, self.w2_packed)                # [T, dim]


class Block(nn.Module):
    """Pre-norm transformer block: h + attn(norm(h)), then + ffn(norm(h)).

    The residual stream h and its normed copy travel together (vLLM's fused add + norm): the
    block takes h and attention_norm(h), and returns next_norm(h) after updating h in place, so
    each residual add is fused with the norm that follows it.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, h: torch.Tensor, x: torch.Tensor, rope: torch.Tensor,
                positions: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                ops: type[TorchLayerOps], next_norm: RMSNorm) -> torch.Tensor:
        """h [T, dim] residual stream (updated in place); x = attention_norm(h). Returns
        next_norm(h) for the next block (or the final norm)."""
        # Sub-modules are called through .forward: nn.Module.__call__ (hook dispatch) costs a few
        # µs per call, ~150 calls a step, and this model registers no hooks.
        x = ops.add_rms_norm_(h, self.attention.forward(x, rope, positions, cache, meta, ops),
                              self.ffn_norm.weight, self.ffn_norm.eps)
        return ops.add_rms_norm_(h, self.feed_forward.forward(x, ops),
                                 next_norm.weight, next_norm.eps)


class Transformer(nn.Module):
    """The whole Llama network over a flat, unpadded batch of tokens.

    Args:
        args: model shape.
    Use `Transformer.from_state_dict` to build one from loader output (it fuses QKV and
    gate/up and casts to the serving dtype).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Parameter(torch.empty(args.vocab_size, args.dim))
        self.register_buffer("rope_freqs", rope_tables(args.head_dim, args.max_context, args.rope_theta),
                             persistent=False)
        self.output_packed: PackedWeight | None = None

    @classmethod
    def from_state_dict(cls, args: ModelArgs, state: dict[str, torch.Tensor],
                        dtype: torch.dtype, device: torch.device | str | None = None) -> "Transformer":
        """Build from loader names (`layers.{i}.attention.wq.weight` ...; see weights.py).

        Q, K, V are concatenated into `wqkv` [(H + 2·KVH)·hd, dim] (Q and K rows reordered for
        interleaved RoPE, see `rope_tables`; attention scores are unchanged since q and k share
        the order) and gate, up into `w13` [2·ffn, dim]. Norm weights stay fp32 (they scale fp32
        activations); the RoPE table stays complex64. Every tensor goes to `device` (None: where
        the loader's output weight is; packed copies exist on the CPU only, see `pack`). Raises
        KeyError on a missing tensor.
        """
        with torch.device("meta"):
            model = cls(args)
        device = state["output.weight"].device if device is None else torch.device(device)
        fused: dict[str, torch.Tensor] = {
            "tok_embeddings.weight": state["tok_embeddings.weight"],
            "norm.weight": state["norm.weight"],
            "output": state["output.weight"],
        }
        fused.update(fused_block_matrices(state, args.n_layers, args.n_heads, args.n_kv_heads))
        for i in range(args.n_layers):
            p = f"layers.{i}."
            for norm in ("attention_norm", "ffn_norm"):
                fused[p + norm + ".weight"] = state[p + norm + ".weight"]
        fused = {k: (t.float() if k.endswith("norm.weight") else t.to(dtype)).to(device).contiguous()
                 for k, t in fused.items()}
        model.load_state_dict(fused, strict=False, assign=True)
        model.rope_freqs = rope_tables(args.head_dim, args.max_context, args.rope_theta).to(device)
        model = model.eval().requires_grad_(False)
        model.pack()
        return model

    def pack(self) -> None:
        """Attach packed copies of every matrix (bf16 on CPU only; see `linear.pack_weights`).
        On another device every packed copy is None (the products run `F.linear`); call it again
        after moving the model."""
        attn = [layer.attention for layer in self.layers]
        ffn = [layer.feed_forward for layer in self.layers]
        owners = ([(a, "wqkv") for a in attn] + [(a, "wo") for a in attn] + [(f, "w13") for f in ffn]
                  + [(f, "w2") for f in ffn] + [(self, "output")])
        weights = [getattr(module, name) for module, name in owners]
        on_cpu = all(w.device.type == "cpu" for w in weights)
        packed = pack_weights(weights) if on_cpu else [None] * len(weights)
        for (module, name), p in zip(owners, packed):
            setattr(module, name + "_packed", p)

    @property
    def dtype(self) -> torch.dtype:
        """Weight dtype of the matrix products (bf16 or fp32)."""
        return self.output.dtype

    def embed(self, token_ids: torch.Tensor, ops: type[TorchLayerOps] = TorchLayerOps
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first block's inputs: (residual stream h [T, dim], attention_norm_0(h) [T, dim]),
        both in the model dtype, from token_ids int64 [T], the norm computed by `ops`."""
        h = self.tok_embeddings(token_ids)                               # [T, dim] residual
        first = self.layers[0].attention_norm
        return h, ops.rms_norm(h, first.weight, first.eps)

    @property
    def rope(self) -> torch.Tensor:
        """The RoPE table as fp32 (cos, sin) pairs [max_context, head_dim / 2, 2] (a view)."""
        return torch.view_as_real(self.rope_freqs)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_layers: list[torch.Tensor], meta: AttentionMetadata,
                ops: type[TorchLayerOps] = TorchLayerOps) -> torch.Tensor:
        """Hidden states of a flat batch.

        Args:
            token_ids: int64 [T]; positions: int64 [T] (each token's position in its request).
            kv_layers: per-layer K and V pools `[2, num_blocks, block_size, kv_heads, hd]`.
            meta: where to write this step's K/V, which context each request reads, and the
                backend that attends over it.
            ops: the per-token steps between the matrix products: `TorchLayerOps` (any device)
                or `KernelLayerOps` (genserve's CPU kernels, once `engine.kernels.available()`);
                the model runner chooses, with its attention backend.
        Returns:
            [T, dim] final-norm hidden states in the model dtype.
        """
        rope = self.rope                                                 # [ctx, hd / 2, 2] fp32
        h, x = self.embed(token_ids, ops)
        norms = [layer.attention_norm for layer in self.layers[1:]] + [self.norm]
        for layer, cache, next_norm in zip(self.layers, kv_layers, norms):
            x = layer.forward(h, x, rope, positions, cache, meta, ops, next_norm)  # no hooks
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output projection of the rows that sample: [R, dim] → fp32 [R, vocab]."""
        return linear(hidden, self.output, self.output_packed).float()


def block_matrices(model: Transformer) -> list[tuple[nn.Module, str]]:
    """(module, attribute name) of every block matrix of `model`: wqkv, wo, w13, w2 of each layer
    in turn (each has a `<name>_packed` beside it)."""
    return [(m, n) for layer in model.layers
            for m, n in ((layer.attention, "wqkv"), (layer.attention, "wo"),
                         (layer.feed_forward, "w13"), (layer.feed_forward, "w2"))]
