"""The decoder-only transformer every family shares (gpt-fast style: shapes as comments, short
forwards), with each option of `engine.model.config.ModelArgs` switched on where a checkpoint
asks for it.

A block is pre-norm attention and a gated MLP, each added to the residual stream:

    h += post_attention_norm?(attention(attention_norm(h)))
    h += post_ffn_norm?(mlp(ffn_norm(h)))

Attention: one fused Q | K | V projection (+ bias: Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3),
RoPE from the layer's table (its base, scaling and rotary share), K and V stored in the paged
pool, then the backend's paged attention with the layer's `AttentionSpec` (score scale, sliding
window, softcap; None for the plain case, which every backend's fast path serves). MLP
(`engine.model.mlp`): down(act(gate(x)) · up(x)), gate | up fused, act SiLU (SwiGLU) or tanh-GELU
(GeGLU); in a mixture-of-experts layer (Qwen3-MoE, Mixtral) a router's top-k of such experts.

The plain Llama block (`ModelArgs.plain_llama`) takes exactly the path it always took. Every
block runs this Python loop with genserve's fused CPU kernels (`engine.model.layer_ops.
KernelLayerOps`) where genserve's decode attention computes its layers
(`engine.runner.model_runner.kernel_layers`), else with `TorchLayerOps` (the model runner
decides); pure-decode steps run the same kernels from the C++ decode loop
(`engine.runner.decode_loop`) instead where it serves the model, with the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.attention.base import AttentionMetadata, AttentionSpec
from engine.model.config import ModelArgs
from engine.model.layer_ops import TorchLayerOps
from engine.model.linear import PackedWeight, linear, pack_weights
from engine.model.lora import LoraBatch
from engine.model.mlp import FeedForward, MoEFeedForward, grouped_mm_device
from engine.model.rope import interleave_rope_rows, rope_tables


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in fp32 (Zhang & Sennrich 2019; HF Llama).
    A checkpoint's (1 + w) form (Gemma) is folded into `weight` at load."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, dim]
        return TorchLayerOps.rms_norm(x, self.weight, self.eps)


def fused_block_matrices(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The fused matrices (and biases) of every block from the loader's separate ones
    (`engine.model.weights` names): `layers.{i}.attention.wqkv` = Q | K | V rows, Q and K in
    interleaved-RoPE order (`interleave_rope_rows`, whole rows moved, so it serves the GGUF's
    4-bit blocks as well as numbers), `attention.wo`, `feed_forward.w13` = gate | up rows,
    `feed_forward.w2`; with `args.qkv_bias` `attention.bqkv` in the same row order, with
    `args.o_bias` `attention.bo`. A mixture-of-experts layer has `feed_forward.router` and each
    expert's `feed_forward.experts.{e}.w13` / `w2` instead. Raises KeyError on a missing tensor."""
    fused: dict[str, torch.Tensor] = {}
    rot = args.rotary_dim
    for i in range(args.n_layers):
        p = f"layers.{i}."
        a = p + "attention."
        fused[a + "wqkv"] = torch.cat([
            interleave_rope_rows(state[a + "wq.weight"], args.n_heads, rot),
            interleave_rope_rows(state[a + "wk.weight"], args.n_kv_heads, rot),
            state[a + "wv.weight"]])
        fused[a + "wo"] = state[a + "wo.weight"]
        if args.qkv_bias:
            fused[a + "bqkv"] = torch.cat([
                interleave_rope_rows(state[a + "wq.bias"], args.n_heads, rot),
                interleave_rope_rows(state[a + "wk.bias"], args.n_kv_heads, rot),
                state[a + "wv.bias"]])
        if args.o_bias:
            fused[a + "bo"] = state[a + "wo.bias"]
        if args.is_sparse(i):
            fused[p + "feed_forward.router"] = state[p + "feed_forward.router.weight"]
            mlps = [f"{p}feed_forward.experts.{e}." for e in range(args.moe.n_experts)]
        else:
            mlps = [p + "feed_forward."]
        for m in mlps:
            fused[m + "w13"] = torch.cat([state[m + "w1.weight"], state[m + "w3.weight"]])
            fused[m + "w2"] = state[m + "w2.weight"]
    return fused


def layer_spec(args: ModelArgs, i: int) -> AttentionSpec | None:
    """Layer i's `AttentionSpec`, or None when its attention is the plain causal one with scale
    head_dim^-½ (then every backend's fast path serves it)."""
    window = args.layer(i).sliding_window
    if args.scale == args.head_dim ** -0.5 and window is None and args.attn_softcap is None:
        return None
    return AttentionSpec(args.scale, window, args.attn_softcap)


class Attention(nn.Module):
    """GQA self-attention with a fused QKV projection over the paged KV cache.

    Attributes:
        wqkv [(H + 2·KVH)·hd, dim], wo [dim, H·hd]: the projections (`*_packed` beside them).
        bqkv, bo: their biases in the model dtype, or None.
        q_norm, k_norm: per-head RMSNorm weights fp32 [hd] (interleaved-RoPE order), or None.
        spec: the layer's `AttentionSpec`, or None (plain).
        rope_index: which of the model's RoPE tables this layer reads.
    """

    def __init__(self, args: ModelArgs, spec: AttentionSpec | None, rope_index: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Parameter(torch.empty(qkv_out, args.dim))
        self.wo = nn.Parameter(torch.empty(args.dim, args.n_heads * args.head_dim))
        self.bqkv = nn.Parameter(torch.empty(qkv_out)) if args.qkv_bias else None
        self.bo = nn.Parameter(torch.empty(args.dim)) if args.o_bias else None
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.spec = spec
        self.rope_index = rope_index
        self.wqkv_packed: PackedWeight | None = None
        self.wo_packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata, ops: type[TorchLayerOps],
                lora: LoraBatch | None = None, layer: int = 0) -> torch.Tensor:
        """x [T, dim] → [T, dim]; with `lora`, the adapter rows' deltas of layer `layer` are added
        to the Q | K | V and output products (before their biases)."""
        qkv = linear(x, self.wqkv, self.wqkv_packed)                     # x: [T, dim]
        if lora is not None:
            lora.add(qkv, x, layer, "attention.wqkv")
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        if self.q_norm is not None:      # per-head q/k norms (Qwen3, Gemma 3), then RoPE
            q = ops.norm_rope_store_kv(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                       rope, positions, cache, meta.slots, self.n_heads, self.n_kv)
        else:
            q = ops.rope_store_kv(qkv, rope, positions, cache, meta.slots,   # [T, H, hd]; K, V stored
                                  self.n_heads, self.n_kv)
        o = meta.backend.attend(q, cache, meta) if self.spec is None else \
            meta.backend.attend(q, cache, meta, self.spec)
        o = o.reshape(x.shape[0], -1)
        out = linear(o, self.wo, self.wo_packed)                         # [T, dim]
        if lora is not None:
            lora.add(out, o, layer, "attention.wo")
        return out if self.bo is None else out + self.bo


class Block(nn.Module):
    """Pre-norm transformer block: h + attn(norm(h)), then + ffn(norm(h)); with sandwich norms
    (Gemma) each output is normed again before its add.

    The residual stream h and its normed copy travel together (vLLM's fused add + norm): the
    block takes h and attention_norm(h), and returns next_norm(h) after updating h in place, so
    each residual add is fused with the norm that follows it.
    """

    def __init__(self, args: ModelArgs, i: int, rope_index: int) -> None:
        super().__init__()
        self.index = i
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_spec(args, i), rope_index)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoEFeedForward(args) if args.is_sparse(i) else \
            FeedForward(args.dim, args.intermediate_size, args.activation)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps) if args.sandwich_norm else None
        self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps) if args.sandwich_norm else None

    def forward(self, h: torch.Tensor, x: torch.Tensor, rope: torch.Tensor,
                positions: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                ops: type[TorchLayerOps], next_norm: RMSNorm, lora: LoraBatch | None = None) -> torch.Tensor:
        """h [T, dim] residual stream (updated in place); x = attention_norm(h). Returns
        next_norm(h) for the next block (or the final norm). `lora`: the step's adapter rows
        (their deltas on this block's dense projections), or None."""
        # Sub-modules are called through .forward: nn.Module.__call__ (hook dispatch) costs a few
        # µs per call, ~150 calls a step, and this model registers no hooks.
        if lora is not None:
            out = self.attention.forward(x, rope, positions, cache, meta, ops, lora, self.index)
        else:
            out = self.attention.forward(x, rope, positions, cache, meta, ops)
        if self.post_attention_norm is not None:
            out = ops.rms_norm(out, self.post_attention_norm.weight, self.post_attention_norm.eps)
        x = ops.add_rms_norm_(h, out, self.ffn_norm.weight, self.ffn_norm.eps)
        if lora is not None and isinstance(self.feed_forward, FeedForward):
            out = self.feed_forward.forward(x, ops, lora, self.index)
        else:
            out = self.feed_forward.forward(x, ops)
        if self.post_ffn_norm is not None:
            out = ops.rms_norm(out, self.post_ffn_norm.weight, self.post_ffn_norm.eps)
        return ops.add_rms_norm_(h, out, next_norm.weight, next_norm.eps)


class Transformer(nn.Module):
    """The whole network over a flat, unpadded batch of tokens.

    Args:
        args: the model's configuration.
    Use `Transformer.from_state_dict` to build one from loader output (it fuses QKV and
    gate/up and casts to the serving dtype).

    Attributes:
        rope_freqs: the RoPE tables (non-persistent buffers), complex64 [max_context, hd / 2]
            each, one per distinct (base, scaling) among the layers (Gemma 3: local and global);
            layer i reads `rope_freqs[layers[i].attention.rope_index]`.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        keys = list(dict.fromkeys(args.layer(i).rope_key for i in range(args.n_layers)))
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i, keys.index(args.layer(i).rope_key))
                                    for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Parameter(torch.empty(args.vocab_size, args.dim))
        self.rope_keys = keys
        for k, table in enumerate(self.make_rope_tables()):
            self.register_buffer(f"rope_freqs_{k}", table, persistent=False)
        self.output_packed: PackedWeight | None = None

    @property
    def rope_freqs(self) -> list[torch.Tensor]:
        """The RoPE tables (buffers `rope_freqs_0`, `rope_freqs_1` ...), in `rope_keys` order."""
        return [getattr(self, f"rope_freqs_{k}") for k in range(len(self.rope_keys))]

    def make_rope_tables(self, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """The RoPE tables of `rope_keys`, complex64 [max_context, hd / 2] each, on `device`."""
        a = self.args
        return [rope_tables(a.head_dim, a.max_context, theta, scaling, a.rotary_dim).to(device)
                for theta, scaling in self.rope_keys]

    @classmethod
    def from_state_dict(cls, args: ModelArgs, state: dict[str, torch.Tensor],
                        dtype: torch.dtype, device: torch.device | str | None = None) -> "Transformer":
        """Build from loader names (`layers.{i}.attention.wq.weight` ...; see weights.py).

        Q, K, V are concatenated into `wqkv` [(H + 2·KVH)·hd, dim] (Q and K rows reordered for
        interleaved RoPE, see `rope_tables`; attention scores are unchanged since q and k share
        the order; the q/k norm weights reordered alike) and gate, up into `w13` [2·ffn, dim].
        Norm weights and MoE routers stay fp32 (they scale fp32 activations; router logits are
        fp32); the RoPE tables stay complex64. Every tensor goes to `device` (None: where the loader's output weight is; packed copies
        exist on the CPU only, see `pack`). Where the experts run through the grouped GEMM
        (`engine.model.mlp.grouped_mm_device`: bf16 on a Hopper or Blackwell GPU) each MoE
        layer's expert matrices are stacked, `w13_stacked` [E, 2·F, dim] and `w2_stacked`
        [E, dim, F], and every expert's `w13` / `w2` is a view of its slice (one copy of the
        weights). Raises KeyError on a missing tensor.
        """
        with torch.device("meta"):
            model = cls(args)
        device = state["output.weight"].device if device is None else torch.device(device)
        fused: dict[str, torch.Tensor] = {
            "tok_embeddings.weight": state["tok_embeddings.weight"],
            "norm.weight": state["norm.weight"],
            "output": state["output.weight"],
        }
        fused.update(fused_block_matrices(state, args))
        norms = ["attention_norm", "ffn_norm"] + (["post_attention_norm", "post_ffn_norm"]
                                                  if args.sandwich_norm else [])
        for i in range(args.n_layers):
            p = f"layers.{i}."
            for norm in norms:
                fused[p + norm + ".weight"] = state[p + norm + ".weight"]
            if args.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    weight = state[p + f"attention.{norm}.weight"]
                    fused[p + f"attention.{norm}.weight"] = interleave_rope_rows(weight, 1, args.rotary_dim)
        fused = {k: (t.float() if k.endswith(("norm.weight", "router")) else t.to(dtype)).to(device).contiguous()
                 for k, t in fused.items()}
        stacked: dict[str, torch.Tensor] = {}
        if args.moe is not None and grouped_mm_device(args.moe, args.dim, dtype, device):
            for i in range(args.n_layers):
                for name in ("w13", "w2") if args.is_sparse(i) else ():
                    keys = [f"layers.{i}.feed_forward.experts.{e}.{name}" for e in range(args.moe.n_experts)]
                    whole, views = MoEFeedForward.stack_experts([fused.pop(key) for key in keys])
                    fused.update(zip(keys, views))       # a layer at a time: its copies freed
                    stacked[f"layers.{i}.feed_forward.{name}_stacked"] = whole
        model.load_state_dict(fused, strict=True, assign=True)
        for key, whole in stacked.items():
            owner, _, name = key.rpartition(".")
            setattr(model.get_submodule(owner), name, whole)
        for k, table in enumerate(model.make_rope_tables(device)):
            setattr(model, f"rope_freqs_{k}", table)
        for moe in model.moe_layers:
            moe.expert_rows = torch.zeros_like(moe.expert_rows, device=device)
        model = model.eval().requires_grad_(False)
        model.pack()
        return model

    def pack(self) -> None:
        """Attach packed copies of every matrix (bf16 on CPU only; see `linear.pack_weights`).
        On another device every packed copy is None (the products run `F.linear`); call it again
        after moving the model."""
        owners = block_matrices(self) + [(self, "output")]
        weights = [getattr(module, name) for module, name in owners]
        on_cpu = all(w.device.type == "cpu" for w in weights)
        packed = pack_weights(weights) if on_cpu else [None] * len(weights)
        for (module, name), p in zip(owners, packed):
            setattr(module, name + "_packed", p)
        for moe in self.moe_layers:
            moe.pack_router()

    @property
    def moe_layers(self) -> list[MoEFeedForward]:
        """The mixture-of-experts MLPs, in layer order (empty for a dense model)."""
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoEFeedForward)]

    @property
    def dtype(self) -> torch.dtype:
        """Weight dtype of the matrix products (bf16 or fp32)."""
        return self.output.dtype

    def embed(self, token_ids: torch.Tensor, ops: type[TorchLayerOps] = TorchLayerOps
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first block's inputs: (residual stream h [T, dim], attention_norm_0(h) [T, dim]),
        both in the model dtype, from token_ids int64 [T], the norm computed by `ops`. With an
        embedding scale (Gemma: √dim) h is multiplied by it rounded to the model dtype, as
        transformers does."""
        h = self.tok_embeddings(token_ids)                               # [T, dim] residual
        if self.args.embedding_scale != 1.0:
            h = h * torch.tensor(self.args.embedding_scale, dtype=h.dtype)
        first = self.layers[0].attention_norm
        return h, ops.rms_norm(h, first.weight, first.eps)

    @property
    def rope(self) -> torch.Tensor:
        """The first RoPE table as fp32 (cos, sin) pairs [max_context, head_dim / 2, 2] (a view);
        the only one unless the layers use several bases (`ropes`)."""
        return torch.view_as_real(self.rope_freqs[0])

    @property
    def ropes(self) -> list[torch.Tensor]:
        """Every RoPE table as fp32 (cos, sin) pairs [max_context, head_dim / 2, 2] (views)."""
        return [torch.view_as_real(t) for t in self.rope_freqs]

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_layers: list[torch.Tensor], meta: AttentionMetadata | Sequence[AttentionMetadata],
                ops: type[TorchLayerOps] = TorchLayerOps, lora: LoraBatch | None = None) -> torch.Tensor:
        """Hidden states of a flat batch.

        Args:
            token_ids: int64 [T]; positions: int64 [T] (each token's position in its request).
            kv_layers: per-layer K and V pools `[2, num_blocks, block_size, kv_heads, hd]`.
            meta: where to write this step's K/V, which context each request reads, and the
                backend that attends over it: one for every layer, or one per layer (the KV
                groups of a model mixing sliding-window and global layers each have their own
                block tables, `engine.runner.kv_cache.KVCache`).
            ops: the per-token steps between the matrix products: `TorchLayerOps` (any device)
                or `KernelLayerOps` (genserve's CPU kernels, once `engine.kernels.available()`);
                the model runner chooses, with its attention backend.
            lora: the step's rows grouped by LoRA adapter (`engine.model.lora.LoraBatch`): each
                dense projection adds their deltas to its base product; None: the base model.
        Returns:
            [T, dim] final-norm hidden states in the model dtype.
        """
        ropes = self.ropes                                               # [ctx, hd / 2, 2] fp32
        h, x = self.embed(token_ids, ops)
        norms = [layer.attention_norm for layer in self.layers[1:]] + [self.norm]
        metas = [meta] * len(self.layers) if isinstance(meta, AttentionMetadata) else meta
        for layer, cache, m, next_norm in zip(self.layers, kv_layers, metas, norms):
            x = layer.forward(h, x, ropes[layer.attention.rope_index], positions, cache, m, ops,
                              next_norm, lora)                          # no hooks
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output projection of the rows that sample: [R, dim] → fp32 [R, vocab]; with a final
        softcap c (Gemma 2) c·tanh(z / c), in fp32."""
        logits = linear(hidden, self.output, self.output_packed).float()
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def block_matrices(model: Transformer) -> list[tuple[nn.Module, str]]:
    """(module, attribute name) of every block matrix of `model`: wqkv, wo, then the MLP's w13, w2
    (a mixture-of-experts layer: each expert's w13, w2 in expert order) of each layer in turn
    (each has a `<name>_packed` beside it)."""
    return [(m, n) for layer in model.layers
            for m, n in [(layer.attention, "wqkv"), (layer.attention, "wo"), *layer.feed_forward.matrices()]]
