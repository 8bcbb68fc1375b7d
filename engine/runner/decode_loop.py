"""The C++ decode loop: every block of a pure-decode step in one call, from the model's packed
weights (CPU, genserve's kernels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine import kernels
from engine.attention.base import AttentionMetadata
from engine.attention.paged_sdpa import window_kernel_serves
from engine.model.layer_ops import KernelLayerOps
from engine.model.linear import (ANY_ROWS, FP32_OUT_CHUNK, PACKED_LINEAR_MAX_ROWS, PackedLinearMethod,
                                 QKMethod)
from engine.model.lora import LoraBatch
from engine.model.mlp import FeedForward, MoEFeedForward
from engine.model.transformer import Transformer

# The adapter rows of a step without any (an empty int64 tensor; never written).
_NO_ROWS = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class DecodeLoop:
    """Every block of a pure-decode step in one C++ call (`torch.ops.genserve.decode_layers`,
    engine/kernels/csrc/decode_layers.cpp): the per-model arguments, built once by `from_model`
    when the runner is made; `run` makes a step's call. The model runner chooses it (CPU kernels,
    no prefill piece in the step) beside its other fast path, the CUDA graphs.

    Attributes:
        wqkv, wo, w13, w2: per layer, the packed matrices (`PackedWeight.tensor`: oneDNN's, or
            `fma_linear`'s bf16 panels [out / 16, in, 16]).
        ffn_norm: per layer, fp32 [dim] weights of the FFN norm; next_norm: of the norm after the
            layer (the next layer's attention norm, the final norm after the last).
        eps: RMSNorm epsilon of every norm.
        n_heads, n_kv_heads: query and key/value heads.
        rope_index: per layer, which of the model's RoPE tables (`Transformer.ropes`) it reads.
        scales: per layer, the attention score scale (`AttentionSpec.scale`, else head_dim ** -0.5).
        windows: per layer, -1 where `paged_decode` computes its decode attention (head_dim 64,
            no `AttentionSpec`), else the sliding window `paged_decode_window` takes (0: none).
        bqkv, bo: per layer, the Q | K | V and output biases (model dtype), or empty (none).
        q_norm, k_norm: per layer, the per-head q / k RMSNorm weights (fp32 [head_dim]), or empty.
        post_attn_norm, post_ffn_norm: per layer, the sandwich norms' fp32 [dim] weights (Gemma),
            or empty.
        gelu: the MLP's gate is tanh-GELU (GeGLU), else SiLU (SwiGLU).
        moe: empty (every MLP dense), or per layer 0 (dense), 1 (a mixture of experts whose
            experts run `qk_linear`: one `qk_linear_grouped` call per matrix) or 2 (experts on
            `packed_linear`: `packed_linear_grouped`).
        routers: per mixture-of-experts layer, the router's fp32 copy [E, dim]
            (`PackedWeight.f32` of `MoEFeedForward.router_packed`); router_rows: its
            `fp32_linear` call sizes (the routers share a shape, so one list).
        expert_rows: per mixture-of-experts layer, its `MoEFeedForward.expert_rows` (the
            metrics' expert load), which each step adds to.
        top_k, norm_topk: experts per token, and whether their weights are renormalized.
        expert_w13, expert_kinds13, expert_segments13: every expert's w13 of every
            mixture-of-experts layer, layer by layer, expert by expert: with `moe` 1 its Q4_K /
            Q6_K segments, their kinds and per expert the segment count; with 2 its packed bf16
            matrix, its k chunk and 1. expert_w2, expert_kinds2, expert_segments2: the same of w2.
        k_chunks: the `PackedWeight.k_chunk` of wqkv, wo, w13, w2 (0: oneDNN runs that kind).
        max_rows: rows up to which the products run `packed_linear` (the weights' least
            `PackedWeight.max_rows`); above, oneDNN.
        q4: empty, or every block matrix's 4-bit blocks (`PackedWeight.q4`), layer by layer in
            the order wqkv, wo, w13, w2: then the products up to `max_rows` rows run `q4_linear`.
        i8: empty, or every block matrix's int8 copy (`PackedWeight.i8`: q, scale, outliers,
            outlier_q), in the same order: then every product runs `int8_linear`.
        q4q8: empty, or every block matrix's Q4_1 blocks in `q4q8_linear`'s layout
            (`PackedWeight.q4q8`, `engine.model.gguf_blocks.attach_q4q8`), in the same order, an empty
            tensor for a matrix without: then those products run `q4q8_linear` (llama.cpp's
            Q4_1 x Q8_1 arithmetic).
        qk, qk_kinds, qk_counts: empty, or every block matrix's Q4_K / Q6_K row segments in
            `qk_linear`'s layout (`PackedWeight.qk`, `engine.model.kquant.QKWeight`) one after
            another in the same order, each segment's kind, and per matrix its segment count (0:
            none): then those products run `qk_linear` (llama.cpp's Q4_K / Q6_K x Q8_K).
        q8q8: empty, or every block matrix's Q8_0 blocks in `q8q8_linear`'s layout
            (`PackedWeight.q8q8`) in the same order, an empty tensor for a matrix without: then
            those products run `q8q8_linear` (llama.cpp's Q8_0 x Q8_0).
    """

    wqkv: list[torch.Tensor]
    wo: list[torch.Tensor]
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    ffn_norm: list[torch.Tensor]
    next_norm: list[torch.Tensor]
    eps: float
    n_heads: int
    n_kv_heads: int
    rope_index: list[int]
    scales: list[float]
    windows: list[int]
    bqkv: list[torch.Tensor]
    bo: list[torch.Tensor]
    q_norm: list[torch.Tensor]
    k_norm: list[torch.Tensor]
    post_attn_norm: list[torch.Tensor]
    post_ffn_norm: list[torch.Tensor]
    gelu: bool
    k_chunks: list[int]
    max_rows: int = PACKED_LINEAR_MAX_ROWS
    moe: list[int] = dataclasses.field(default_factory=list)
    routers: list[torch.Tensor] = dataclasses.field(default_factory=list)
    router_rows: list[int] = dataclasses.field(default_factory=list)
    expert_rows: list[torch.Tensor] = dataclasses.field(default_factory=list)
    top_k: int = 0
    norm_topk: bool = False
    expert_w13: list[torch.Tensor] = dataclasses.field(default_factory=list)
    expert_kinds13: list[int] = dataclasses.field(default_factory=list)
    expert_segments13: list[int] = dataclasses.field(default_factory=list)
    expert_w2: list[torch.Tensor] = dataclasses.field(default_factory=list)
    expert_kinds2: list[int] = dataclasses.field(default_factory=list)
    expert_segments2: list[int] = dataclasses.field(default_factory=list)
    q4: list[torch.Tensor] = dataclasses.field(default_factory=list)
    i8: list[torch.Tensor] = dataclasses.field(default_factory=list)
    q4q8: list[torch.Tensor] = dataclasses.field(default_factory=list)
    qk: list[torch.Tensor] = dataclasses.field(default_factory=list)
    qk_kinds: list[int] = dataclasses.field(default_factory=list)
    qk_counts: list[int] = dataclasses.field(default_factory=list)
    q8q8: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @classmethod
    def from_model(cls, model: Transformer, cache_dtype: torch.dtype | None = None) -> DecodeLoop | None:
        """From a packed model (`Transformer.pack`, or `engine.model.quant.attach_q4`) whose KV
        pools hold `cache_dtype` (None: the model's dtype); None where the C++ loop cannot give
        the Python loop's bits: a layer whose decode attention genserve's kernels do not compute
        (`paged_sdpa.decode_attention`: a softcap, a head size or group size they are not built
        for, the 8-bit cache on a layer `paged_decode` does not serve), a mixture of experts the loop does not run
        (`moe_arguments`), a matrix not packed, oneDNN calls of fixed size or fp32 copies (which
        the C++ loop does not run) unless its 4-bit blocks run every product (`fma_linear`'s
        panels it runs: the C++ `linear` tells them by their 3 dimensions), int8 copies
        (`engine.model.int8`, row scales) on some block matrices only, or the GGUF's blocks
        (`attach_q4q8`: Q4_1 for `q4q8_linear`, Q8_0 for `q8q8_linear`, Q4_K / Q6_K for
        `qk_linear`) on some block matrices only. With a mixture of experts, the dense matrices
        must be the GGUF's blocks or plain `packed_linear` ones (no int8 or 4-bit copies)."""
        layers = model.layers
        attention = cls.attention_kernels(model, model.dtype if cache_dtype is None else cache_dtype)
        if attention is None:
            return None
        experts = cls.moe_arguments(model)
        if experts is None:
            return None
        dense = [isinstance(layer.feed_forward, FeedForward) for layer in layers]
        packed = [[layer.attention.wqkv_packed for layer in layers],
                  [layer.attention.wo_packed for layer in layers],
                  [layer.feed_forward.w13_packed if d else None for layer, d in zip(layers, dense)],
                  [layer.feed_forward.w2_packed if d else None for layer, d in zip(layers, dense)]]
        # wqkv, wo, w13, w2 per layer; `used`: the matrix exists (not a mixture of experts' MLP)
        order = [ws[i] for i in range(len(layers)) for ws in packed]
        used = [kind < 2 or dense[i] for i in range(len(layers)) for kind in range(4)]
        mats = [w for w, u in zip(order, used) if u]
        if any(w is not None and w.q8 is not None for w in mats):
            return None             # AMX Q8_0 blocks (`q8_amx_linear`): the C++ loop has no such product
        with_q4q8 = [w is not None and w.q4q8 is not None for w in mats]
        with_q8q8 = [w is not None and w.q8q8 is not None for w in mats]
        with_qk = [w is not None and w.qk is not None for w in mats]
        if any(with_q4q8) or any(with_q8q8) or any(with_qk):
            if not all(a or b or c for a, b, c in zip(with_q4q8, with_q8q8, with_qk)):
                return None         # the C++ loop takes the GGUF's blocks for every matrix or none
            none = torch.empty(0, dtype=torch.uint8)
            blocks = lambda name: [getattr(w, name) if u and getattr(w, name) is not None else none  # noqa: E731
                                   for w, u in zip(order, used)]
            return cls.from_weights(
                model, packed, attention, experts, k_chunks=[0, 0, 0, 0], max_rows=0,
                q4q8=blocks("q4q8") if any(with_q4q8) else [],
                q8q8=blocks("q8q8") if any(with_q8q8) else [],
                qk=[b for w in mats if w.qk is not None for b in w.qk.blocks],
                qk_kinds=[k for w in mats if w.qk is not None for k in w.qk.kinds],
                qk_counts=[len(w.qk.blocks) if u and w.qk is not None else 0 for w, u in zip(order, used)]
                if any(with_qk) else [])
        if any(w is None for w in mats):
            return None
        with_i8 = [w.i8 is not None for w in mats]
        with_q4 = [w.q4 is not None for w in mats]
        if experts and (any(with_i8) or any(with_q4)):
            return None             # with experts: plain packed products only
        if any(with_i8):
            if not all(with_i8) or any(w.i8.block for w in mats):
                return None         # int8 products (engine.model.int8) for every matrix or none
        elif any(w.f32 is not None or (w.tile_rows and not (w.q4 is not None and w.max_rows == ANY_ROWS))
                 for w in mats):
            return None             # the C++ loop runs no tiled or fp32 products: the Python loop does
        if any(with_q4) and not all(with_q4):
            return None             # the C++ loop takes 4-bit blocks for every matrix or none
        # One k chunk per kind: oneDNN's chunk follows the shape, which the layers share.
        chunk_sets = [{w.k_chunk for w in ws if w is not None} for ws in packed]
        chunks = [c.pop() if len(c) == 1 else 0 for c in chunk_sets]
        return cls.from_weights(
            model, packed, attention, experts, k_chunks=chunks,
            max_rows=min(w.max_rows for w in mats),
            q4=[w.q4 for w in order] if all(with_q4) else [],
            i8=[t for w in order for t in (w.i8.q, w.i8.scale, w.i8.outliers, w.i8.outlier_q)]
            if all(with_i8) else [])

    @staticmethod
    def moe_arguments(model: Transformer) -> dict | None:
        """The mixture-of-experts fields (`moe`, `routers` ... `expert_segments2`) for `model`:
        empty where every MLP is dense; None where a mixture of experts is not one the C++ loop
        runs with the Python loop's bits: its experts not all on `qk_linear` or all on
        `packed_linear` (with `packed_linear_grouped` built), a router without its fp32 copy
        for `fp32_linear` or one it computes in slices (more than 4 · `FP32_OUT_CHUNK` experts),
        routers with different call sizes, or the stacked experts of the GPU."""
        layers = model.layers
        if all(isinstance(layer.feed_forward, FeedForward) for layer in layers):
            return {}
        if model.dtype != torch.bfloat16:
            return None             # the grouped products (`MoEFeedForward._grouped_product`) are bf16's
        out: dict = {"moe": [], "routers": [], "router_rows": [], "expert_rows": [],
                     "top_k": model.args.moe.top_k, "norm_topk": model.args.moe.norm_topk_prob}
        for key in ("expert_w13", "expert_kinds13", "expert_segments13",
                    "expert_w2", "expert_kinds2", "expert_segments2"):
            out[key] = []
        for layer in layers:
            ff = layer.feed_forward
            if not isinstance(ff, MoEFeedForward):
                out["moe"].append(0)
                continue
            router = ff.router_packed
            if router is None or router.f32 is None or ff.w13_stacked is not None \
                    or router.f32.shape[0] > 4 * FP32_OUT_CHUNK:
                return None
            if out["router_rows"] and list(router.call_rows) != out["router_rows"]:
                return None
            pairs = [(e.w13_packed, e.w2_packed) for e in ff.experts]
            if any(a is None or b is None for a, b in pairs):
                return None
            methods = {type(p.method) for pair in pairs for p in pair}
            if methods == {QKMethod}:
                kind = 1
            elif methods == {PackedLinearMethod} and kernels.packed_linear_grouped_available():
                kind = 2
            else:
                return None
            out["moe"].append(kind)
            out["routers"].append(router.f32)
            out["router_rows"] = list(router.call_rows)
            out["expert_rows"].append(ff.expert_rows)
            for pair in pairs:
                for p, which in zip(pair, ("13", "2")):
                    if kind == 1:
                        out["expert_w" + which].extend(p.qk.blocks)
                        out["expert_kinds" + which].extend(p.qk.kinds)
                        out["expert_segments" + which].append(len(p.qk.blocks))
                    else:
                        out["expert_w" + which].append(p.tensor)
                        out["expert_kinds" + which].append(p.k_chunk)
                        out["expert_segments" + which].append(1)
        return out

    @staticmethod
    def attention_kernels(model: Transformer, cache_dtype: torch.dtype) -> tuple[list[float], list[int]] | None:
        """Per layer, the score scale and the `windows` entry of the kernel that computes its
        decode attention on the kernel path, exactly as `paged_sdpa.decode_attention` chooses it
        (`paged_decode` for head_dim 64 without a spec, else `paged_decode_window` where
        `window_kernel_serves`); None where some layer takes torch's SDPA there instead."""
        args = model.args
        scales, windows = [], []
        for layer in model.layers:
            spec = layer.attention.spec
            if spec is None and args.head_dim == 64:
                scales.append(args.head_dim ** -0.5)
                windows.append(-1)
            elif window_kernel_serves(args.n_heads, args.n_kv_heads, args.head_dim, model.dtype,
                                      cache_dtype, spec):
                scales.append(args.head_dim ** -0.5 if spec is None else spec.scale)
                windows.append(0 if spec is None or spec.sliding_window is None else spec.sliding_window)
            else:
                return None
        return scales, windows

    @classmethod
    def from_weights(cls, model: Transformer, packed: list[list],
                     attention: tuple[list[float], list[int]], experts: dict,
                     **products) -> DecodeLoop:
        """The loop over `model`'s norms, biases and shape with `packed` (per kind wqkv, wo, w13,
        w2, the layers' `PackedWeight`s; None for a mixture of experts' w13 and w2),
        `attention` (`attention_kernels`), `experts` (`moe_arguments`) and `products` (the
        fields saying which kernel runs them)."""
        layers, args = model.layers, model.args
        none = torch.empty(0)
        wqkv, wo, w13, w2 = ([none if w is None else w.tensor for w in ws] for ws in packed)
        next_norm = [layer.attention_norm.weight for layer in layers[1:]] + [model.norm.weight]
        attn = [layer.attention for layer in layers]
        scales, windows = attention
        return cls(wqkv, wo, w13, w2,
                   ffn_norm=[layer.ffn_norm.weight for layer in layers], next_norm=next_norm,
                   eps=args.norm_eps, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                   rope_index=[a.rope_index for a in attn], scales=scales, windows=windows,
                   bqkv=[a.bqkv for a in attn] if args.qkv_bias else [],
                   bo=[a.bo for a in attn] if args.o_bias else [],
                   q_norm=[a.q_norm.weight for a in attn] if args.qk_norm else [],
                   k_norm=[a.k_norm.weight for a in attn] if args.qk_norm else [],
                   post_attn_norm=[layer.post_attention_norm.weight for layer in layers]
                   if args.sandwich_norm else [],
                   post_ffn_norm=[layer.post_ffn_norm.weight for layer in layers]
                   if args.sandwich_norm else [],
                   gelu=layers[0].feed_forward.gelu, **experts, **products)

    def run(self, model: Transformer, token_ids: torch.Tensor, positions: torch.Tensor,
            kv_layers: list[torch.Tensor], meta: AttentionMetadata | Sequence[AttentionMetadata],
            lora: LoraBatch | None = None) -> torch.Tensor:
        """`model(token_ids, positions, kv_layers, meta, KernelLayerOps, lora)` for a pure-decode
        step, in one C++ call: the same ops, in the same order and with the same bits, as
        `Transformer.forward`'s Python loop with `KernelLayerOps`.

        Args:
            model: the network these weights were taken from.
            token_ids, positions: int64 [B]; kv_layers: per-layer K and V pools; meta: a
                pure-decode step's metadata (B rows, the genserve-kernels CPU backend): one for
                every layer, or one per layer (each layer its KV group's, as
                `Transformer.forward` takes them).
            lora: the step's adapter rows, or None; its `kernel_args` must be set
                (`accepts`), each product then adding the rows' deltas (`lora_delta_`).
        Returns:
            [B, dim] final-norm hidden states.
        Raises:
            ValueError: `lora` without `kernel_args`.
        """
        if lora is None:
            rows, offsets, blobs, tables = _NO_ROWS, [0], [], []
        elif lora.kernel_args is None:
            raise ValueError("DecodeLoop.run: the step's adapters have no lora_delta_ tables")
        else:
            rows, offsets, blobs, tables = lora.kernel_args
        if isinstance(meta, AttentionMetadata):
            groups, group = [meta], [0] * len(kv_layers)
        else:                       # one per layer: the distinct ones are the KV groups'
            first: dict[int, int] = {}
            group = [first.setdefault(id(m), len(first)) for m in meta]
            groups = list({id(m): m for m in meta}.values())
        h, x = model.embed(token_ids, KernelLayerOps)
        return torch.ops.genserve.decode_layers(
            h, x, self.wqkv, self.wo, self.w13, self.w2, self.ffn_norm, self.next_norm, self.eps,
            model.ropes, self.rope_index, positions, kv_layers, [m.slots for m in groups],
            [m.decode_blocks.view(m.num_decode, -1) for m in groups],
            [m.decode_lens for m in groups],
            group, self.n_heads, self.n_kv_heads, self.scales, self.windows, self.bqkv, self.bo,
            self.q_norm, self.k_norm, self.post_attn_norm, self.post_ffn_norm, self.gelu,
            self.moe, self.routers, self.router_rows, self.expert_rows, self.top_k, self.norm_topk,
            self.expert_w13, self.expert_kinds13, self.expert_segments13, self.expert_w2,
            self.expert_kinds2, self.expert_segments2, self.k_chunks, self.max_rows, self.q4, self.i8, self.q4q8, self.q8q8, self.qk,
            self.qk_kinds, self.qk_counts, rows, offsets, blobs, tables)

    @staticmethod
    def accepts(lora: LoraBatch | None) -> bool:
        """Whether `run` takes a step with these adapter rows: none, or every adapter with its
        `lora_delta_` tables (`LoraBatch.kernel_args`)."""
        return lora is None or lora.kernel_args is not None
