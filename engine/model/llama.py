"""Llama-architecture transformer (RMSNorm, RoPE, GQA attention, SwiGLU), gpt-fast style."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.attention import AttentionMetadata, attend
from engine.model.layer_ops import KernelLayerOps, TorchLayerOps

# Most rows a product runs through genserve's `packed_linear` instead of oneDNN (same bits either
# way; see `linear`). Measured on the 2-core dev machine, SmolLM2-135M's 30 layers + output
# projection, time per step's products, A/B in one run: 1 row 3.0 against 5.7-6.7 ms (block
# matrices only), 32 rows 10.3 against 14.9, 64 rows 18.9 against 24.4, 128 rows 37.8 against
# 44.8, 256 rows 74.7 against 82.1, 512 rows 154.5 against 156.0, 1,024 rows 312.5 against 298.9
# (oneDNN's blocking wins once the products are long enough). In the model, though, 256-token
# prefill steps took the same time either way (1,024 tokens in 345 against 349 ms, A/B in one
# process), so prefill stays on oneDNN and the limit covers decode steps and small mixed steps.
PACKED_LINEAR_MAX_ROWS = 64


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


@dataclass(frozen=True)
class PackedWeight:
    """oneDNN's packed (blocked) copy of a bf16 CPU weight [out, in], from `pack_weight`.

    Attributes:
        tensor: the oneDNN tensor (`torch.ops.mkldnn._reorder_linear_weight`), 2 · out · in bytes.
        k_chunk: how many k oneDNN's kernel sums in one chain before adding the chains' sums
            (512 for in = 576, 1,024 for in = 1,536 on the dev machine), found by `pack_weight`;
            with it genserve's `packed_linear` reproduces oneDNN's bits. 0 where it does not
            (no AVX512-BF16 kernels, another layout or rounding), and oneDNN runs every product.
    """

    tensor: torch.Tensor
    k_chunk: int


def linear(x: torch.Tensor, weight: torch.Tensor,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """`x @ weight.T` whose rows do not depend on how many rows there are.

    With `packed` (`pack_weight`) the product reads the packed copy: for up to
    `PACKED_LINEAR_MAX_ROWS` rows, when the weight has a `k_chunk`, through genserve's
    `packed_linear` (engine/csrc/packed_linear.cpp; ≈ 1.6× oneDNN's weight-read rate for few
    rows), else through oneDNN. The two give the same bits (`pack_weight` checks it), and on this
    CPU oneDNN is faster than `F.linear` at every row count and gives `F.linear`'s bits. oneDNN
    and `F.linear` take a different kernel for a single row whose low bits differ from the
    many-row kernel's on some inputs (seen on real down-projection inputs of SmolLM2, not on
    random ones; every M >= 2 agrees), so there a one-row input is doubled: a decode step of 1 row
    computes exactly what the same row computes inside a batch of 32.

    Args:
        x: [M, in_features]; weight: [out_features, in_features], same dtype; packed: None or
            `pack_weight(weight)`.
    Returns:
        [M, out_features].
    """
    if packed is not None and packed.k_chunk and x.shape[0] <= PACKED_LINEAR_MAX_ROWS:
        return torch.ops.genserve.packed_linear(x.contiguous(), packed.tensor, packed.k_chunk)
    one_row = x.shape[0] == 1
    if one_row:
        x = torch.cat([x, x])
    if packed is not None:
        y = onednn_linear(x, packed.tensor)
    else:
        y = F.linear(x, weight)
    return y[:1] if one_row else y


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ Wᵀ through oneDNN's packed copy of W (`torch.ops.mkldnn._reorder_linear_weight`),
    [M, out] in x's dtype; no bias, no fused activation."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def pack_weight(weight: torch.Tensor,
                k_chunks: dict[tuple[int, int], int] | None = None) -> PackedWeight | None:
    """oneDNN's packed (blocked) copy of a bf16 CPU weight [out, in] for `linear`, or None.

    None when the weight is not bf16 on CPU, this torch has no oneDNN linear, or the packed
    product fails the check that makes it usable: on random rows, its M = 2, 7 and 64 results
    must equal `F.linear` at M = 64 bit for bit (so packed and unpacked engines, and rows of any
    batch, agree). Costs one more copy of the weight (bytes = 2 · out · in). The k chunk for
    genserve's `packed_linear` comes from `onednn_k_chunk`, or from `k_chunks` (shape → chunk,
    filled in here) when an earlier weight had the same shape: oneDNN picks its blocking from
    the shape, not the values.
    """
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        probe = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(0)
                            ).to(weight.dtype)
        want = F.linear(probe, weight)
        for m in (2, 7, 64):
            got = onednn_linear(probe[:m], packed)
            if not torch.equal(got, want[:m]):
                return None
    except (RuntimeError, AttributeError):
        return None
    k_chunks = {} if k_chunks is None else k_chunks
    shape = (weight.shape[0], weight.shape[1])
    if shape not in k_chunks:
        k_chunks[shape] = onednn_k_chunk(packed)
    return PackedWeight(packed, k_chunks[shape])


def onednn_k_chunk(packed: torch.Tensor) -> int:
    """The k chunk with which genserve's `packed_linear` gives oneDNN's bits for `packed`, or 0.

    oneDNN's bf16 kernel sums k in chunks (one vdpbf16ps chain per chunk, the chunks' sums added
    in order); the chunk length depends on the shape and is not documented, so it is found here:
    candidates go powers of two first, largest first (512 and 1,024 are what oneDNN 3.12 uses for
    in = 576 and 1,536 on the dev machine), then every other multiple of 32 up to `in`, and the
    first whose products equal oneDNN's on ≥ 2^20 random outputs (and on one row alone) is
    taken. Wrong chunks differ in ≈ 1 of 10^4 bf16 outputs, so the probe tells them apart. 0 when
    `packed_linear` is not built or no chunk matches (then oneDNN runs every product).
    """
    if not kernels.packed_linear_available():
        return 0
    n, k = packed.shape
    if n % 64 or k % 32:
        return 0
    rows = min(4096, max(64, -(-(1 << 20) // n)))
    probe = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = onednn_linear(probe, packed)
    powers = [2 ** i for i in range(k.bit_length() - 1, 4, -1)]        # ≤ k, largest first
    for chunk in powers + [c for c in range(32, k + 1, 32) if c not in powers]:
        try:
            if (torch.equal(torch.ops.genserve.packed_linear(probe, packed, chunk), want) and
                    torch.equal(torch.ops.genserve.packed_linear(probe[:1], packed, chunk),
                                want[:1])):
                return chunk
        except RuntimeError:        # a padded layout: not the one packed_linear reads
            return 0
    return 0


@dataclass(frozen=True)
class DecodeWeights:
    """What `torch.ops.genserve.decode_layers` takes of the model, one entry per layer.

    Attributes:
        wqkv, wo, w13, w2: the oneDNN packed matrices (`PackedWeight.tensor`).
        ffn_norm: fp32 [dim] weights of each layer's FFN norm; next_norm: of the norm after each
            layer (the next layer's attention norm, the final norm after the last).
        k_chunks: the `PackedWeight.k_chunk` of wqkv, wo, w13, w2 (0: oneDNN runs that kind).
    """

    wqkv: list[torch.Tensor]
    wo: list[torch.Tensor]
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    ffn_norm: list[torch.Tensor]
    next_norm: list[torch.Tensor]
    k_chunks: list[int]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in fp32 (Zhang & Sennrich 2019; HF Llama)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, dim]
        return TorchLayerOps.rms_norm(x, self.weight, self.eps)


def rope_tables(args: ModelArgs) -> torch.Tensor:
    """RoPE rotations e^(i·p·θ_j) as complex64 [max_context, head_dim / 2] (Su et al. 2021).

    θ_j = theta^(-2j / head_dim). Dimension pair j of a head is (2j, 2j + 1) — the interleaved
    layout of the original Llama code; `Transformer.from_state_dict` reorders the Q and K rows of
    Hugging Face's rotate-half layout (pair (j, j + head_dim / 2)) into it, which rotates the same
    pairs by the same angles in one complex product.
    """
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(args.max_context, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def interleave_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder the rows of a Q or K projection [heads · hd, dim] from rotate-half order
    (pair j = rows j and j + hd/2 of a head) to interleaved order (pair j = rows 2j, 2j + 1)."""
    hd = w.shape[0] // heads
    order = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], dim=1).reshape(-1)
    return w.view(heads, hd, -1)[:, order].reshape(w.shape)


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

    def pack(self, k_chunks: dict[tuple[int, int], int] | None = None) -> None:
        """Attach oneDNN-packed weights where usable (see `pack_weight`)."""
        self.wqkv_packed = pack_weight(self.wqkv, k_chunks)
        self.wo_packed = pack_weight(self.wo, k_chunks)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata, ops: type[TorchLayerOps]) -> torch.Tensor:
        qkv = linear(x, self.wqkv, self.wqkv_packed)                     # x: [T, dim]
        q = ops.rope_store_kv(qkv, rope, positions, cache, meta.slots,   # [T, H, hd]; K, V stored
                              self.n_heads, self.n_kv)
        o = attend(q, cache, meta)
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

    def pack(self, k_chunks: dict[tuple[int, int], int] | None = None) -> None:
        """Attach oneDNN-packed weights where usable (see `pack_weight`)."""
        self.w13_packed = pack_weight(self.w13, k_chunks)
        self.w2_packed = pack_weight(self.w2, k_chunks)

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
        self.register_buffer("rope_freqs", rope_tables(args), persistent=False)
        self.output_packed: PackedWeight | None = None
        self.decode_weights: DecodeWeights | None = None

    @classmethod
    def from_state_dict(cls, args: ModelArgs, state: dict[str, torch.Tensor],
                        dtype: torch.dtype) -> "Transformer":
        """Build from loader names (`layers.{i}.attention.wq.weight` ...; see weights.py).

        Q, K, V are concatenated into `wqkv` [(H + 2·KVH)·hd, dim] (Q and K rows reordered for
        interleaved RoPE, see `rope_tables`; attention scores are unchanged since q and k share
        the order) and gate, up into `w13` [2·ffn, dim]. Norm weights stay fp32 (they scale fp32
        activations); the RoPE table stays complex64. Raises KeyError on a missing tensor.
        """
        with torch.device("meta"):
            model = cls(args)
        fused: dict[str, torch.Tensor] = {
            "tok_embeddings.weight": state["tok_embeddings.weight"],
            "norm.weight": state["norm.weight"],
            "output": state["output.weight"],
        }
        for i in range(args.n_layers):
            p = f"layers.{i}."
            fused[p + "attention.wqkv"] = torch.cat([
                interleave_rope_rows(state[p + "attention.wq.weight"], args.n_heads),
                interleave_rope_rows(state[p + "attention.wk.weight"], args.n_kv_heads),
                state[p + "attention.wv.weight"]])
            fused[p + "attention.wo"] = state[p + "attention.wo.weight"]
            fused[p + "feed_forward.w13"] = torch.cat(
                [state[p + "feed_forward.w1.weight"], state[p + "feed_forward.w3.weight"]])
            fused[p + "feed_forward.w2"] = state[p + "feed_forward.w2.weight"]
            for norm in ("attention_norm", "ffn_norm"):
                fused[p + norm + ".weight"] = state[p + norm + ".weight"]
        fused = {k: (t.float() if k.endswith("norm.weight") else t.to(dtype)).contiguous()
                 for k, t in fused.items()}
        model.load_state_dict(fused, strict=False, assign=True)
        model.rope_freqs = rope_tables(args)
        model = model.eval().requires_grad_(False)
        model.pack()
        return model

    def pack(self) -> None:
        """Attach oneDNN-packed copies of every matrix (bf16 on CPU only; see `pack_weight`).

        When every block matrix packed, also sets `decode_weights`: the per-layer lists
        (wqkv, wo, w13, w2 packed; ffn_norm and the next norm's weights; the k chunks) that
        `torch.ops.genserve.decode_layers` takes for a pure-decode step.
        """
        k_chunks: dict[tuple[int, int], int] = {}      # one probe per shape
        for layer in self.layers:
            layer.attention.pack(k_chunks)
            layer.feed_forward.pack(k_chunks)
        self.output_packed = pack_weight(self.output, k_chunks)
        packed = [[layer.attention.wqkv_packed for layer in self.layers],
                  [layer.attention.wo_packed for layer in self.layers],
                  [layer.feed_forward.w13_packed for layer in self.layers],
                  [layer.feed_forward.w2_packed for layer in self.layers]]
        if all(w is not None for ws in packed for w in ws):
            norms = [layer.ffn_norm.weight for layer in self.layers]
            next_norms = [layer.attention_norm.weight for layer in self.layers[1:]] + [self.norm.weight]
            # One k chunk per kind: oneDNN's chunk follows the shape, which the layers share.
            chunks = [ws[0].k_chunk if len({w.k_chunk for w in ws}) == 1 else 0 for ws in packed]
            self.decode_weights = DecodeWeights(*([w.tensor for w in ws] for ws in packed),
                                                norms, next_norms, chunks)

    @property
    def dtype(self) -> torch.dtype:
        """Weight dtype of the matrix products (bf16 or fp32)."""
        return self.output.dtype

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_layers: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a flat batch.

        Args:
            token_ids: int64 [T]; positions: int64 [T] (each token's position in its request).
            kv_layers: per-layer K and V pools `[2, num_blocks, block_size, kv_heads, hd]`.
            meta: where to write this step's K/V, which context each request reads, and whether
                the step runs genserve's kernels (`KernelLayerOps`) or torch ops (`TorchLayerOps`).
        Returns:
            [T, dim] final-norm hidden states in the model dtype.
        """
        ops = KernelLayerOps if meta.kernels else TorchLayerOps
        rope = torch.view_as_real(self.rope_freqs)                       # [ctx, hd / 2, 2] fp32
        h = self.tok_embeddings(token_ids)                               # [T, dim] residual
        first = self.layers[0].attention_norm
        x = ops.rms_norm(h, first.weight, first.eps)
        if meta.kernels and not meta.seqs and self.decode_weights is not None:
            # A pure-decode step: the loop below, run in C++ (engine/csrc/decode_layers.cpp).
            args, w = self.args, self.decode_weights
            return torch.ops.genserve.decode_layers(
                h, x, w.wqkv, w.wo, w.w13, w.w2, w.ffn_norm, w.next_norm, args.norm_eps, rope,
                positions, kv_layers, meta.slots, meta.decode_blocks.view(meta.num_decode, -1),
                meta.decode_lens, args.n_heads, args.n_kv_heads, args.head_dim ** -0.5,
                w.k_chunks, PACKED_LINEAR_MAX_ROWS)
        norms = [layer.attention_norm for layer in self.layers[1:]] + [self.norm]
        for layer, cache, next_norm in zip(self.layers, kv_layers, norms):
            x = layer.forward(h, x, rope, positions, cache, meta, ops, next_norm)  # no hooks
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output projection of the rows that sample: [R, dim] → fp32 [R, vocab]."""
        return linear(hidden, self.output, self.output_packed).float()
