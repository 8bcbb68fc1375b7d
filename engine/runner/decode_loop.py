"""The C++ decode loop: every block of a pure-decode step in one call, from the model's packed
weights (CPU, genserve's kernels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.paged_sdpa import window_kernel_serves
from engine.model.layer_ops import KernelLayerOps
from engine.model.linear import ANY_ROWS, PACKED_LINEAR_MAX_ROWS
from engine.model.lora import LoraBatch
from engine.model.mlp import FeedForward
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
        the Python loop's bits: a mixture-of-experts layer, a layer whose decode attention
        genserve's kernels do not compute (`paged_sdpa.decode_attention`: a softcap, a head size
        or group size they are not built for, the 8-bit cache beyond head_dim 64), a matrix not
        packed, oneDNN calls of fixed size or fp32 copies (which the C++ loop does not run) unless
        its 4-bit blocks run every product (`fma_linear`'s panels it runs: the C++ `linear`
        tells them by their 3 dimensions), int8 copies (`engine.model.int8`, row scales) on some
        block matrices only, or the GGUF's blocks (`attach_q4q8`: Q4_1 for `q4q8_linear`, Q8_0
        for `q8q8_linear`, Q4_K / Q6_K for `qk_linear`) on some block matrices only."""
        layers = model.layers
        if any(not isinstance(layer.feed_forward, FeedForward) for layer in layers):
            return None             # the C++ loop runs the dense MLP only
        attention = cls.attention_kernels(model, model.dtype if cache_dtype is None else cache_dtype)
        if attention is None:
            return None
        packed = [[layer.attention.wqkv_packed for layer in layers],
                  [layer.attention.wo_packed for layer in layers],
                  [layer.feed_forward.w13_packed for layer in layers],
                  [layer.feed_forward.w2_packed for layer in layers]]
        order = [ws[i] for i in range(len(layers)) for ws in packed]      # wqkv, wo, w13, w2 per layer
        with_q4q8 = [w is not None and w.q4q8 is not None for w in order]
        with_q8q8 = [w is not None and w.q8q8 is not None for w in order]
        with_qk = [w is not None and w.qk is not None for w in order]
        if any(with_q4q8) or any(with_q8q8) or any(with_qk):
            if not all(a or b or c for a, b, c in zip(with_q4q8, with_q8q8, with_qk)):
                return None         # the C++ loop takes the GGUF's blocks for every matrix or none
            none = torch.empty(0, dtype=torch.uint8)
            return cls.from_weights(
                model, packed, attention, k_chunks=[0, 0, 0, 0], max_rows=0,
                q4q8=[w.q4q8 if w.q4q8 is not None else none for w in order] if any(with_q4q8) else [],
                q8q8=[w.q8q8 if w.q8q8 is not None else none for w in order] if any(with_q8q8) else [],
                qk=[b for w in order if w.qk is not None for b in w.qk.blocks],
                qk_kinds=[k for w in order if w.qk is not None for k in w.qk.kinds],
                qk_counts=[len(w.qk.blocks) if w.qk is not None else 0 for w in order]
                if any(with_qk) else [])
        with_i8 = [w is not None and w.i8 is not None for ws in packed for w in ws]
        if any(with_i8):
            if not all(with_i8) or any(w.i8.block for ws in packed for w in ws):
                return None         # int8 products (engine.model.int8) for every matrix or none
        elif any(w is None or w.f32 is not None
                 or (w.tile_rows and not (w.q4 is not None and w.max_rows == ANY_ROWS))
                 for ws in packed for w in ws):
            return None             # the C++ loop runs no tiled or fp32 products: the Python loop does
        with_q4 = [w.q4 is not None for ws in packed for w in ws]
        if any(with_q4) and not all(with_q4):
            return None             # the C++ loop takes 4-bit blocks for every matrix or none
        # One k chunk per kind: oneDNN's chunk follows the shape, which the layers share.
        chunks = [ws[0].k_chunk if len({w.k_chunk for w in ws}) == 1 else 0 for ws in packed]
        return cls.from_weights(
            model, packed, attention, k_chunks=chunks,
            max_rows=min(w.max_rows for ws in packed for w in ws),
            q4=[ws[i].q4 for i in range(len(layers)) for ws in packed] if all(with_q4) else [],
            i8=[t for i in range(len(layers)) for ws in packed
                for t in (ws[i].i8.q, ws[i].i8.scale, ws[i].i8.outliers, ws[i].i8.outlier_q)]
            if all(with_i8) else [])

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
                     attention: tuple[list[float], list[int]], **products) -> DecodeLoop:
        """The loop over `model`'s norms, biases and shape with `packed` (per kind wqkv, wo, w13,
        w2, the layers' `PackedWeight`s), `attention` (`attention_kernels`) and `products` (the
        fields saying which kernel runs them)."""
        layers, args = model.layers, model.args
        wqkv, wo, w13, w2 = ([w.tensor for w in ws] for ws in packed)
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
                   gelu=layers[0].feed_forward.gelu, **products)

    def run(self, model: Transformer, token_ids: torch.Tensor, positions: torch.Tensor,
            kv_layers: list[torch.Tensor], meta: AttentionMetadata | Sequence[AttentionMetadata],
            lora: LoraBatch | None = None) -> torch.Tensor:
        """`model(token_ids, positions, kv_layers, meta, KernelLayerOps, lora)` for a pure-decode
        step, in one C++ call: the same ops, in the same order and with the same bits, as
        `Transformer.forward`'s Python loop with `KernelLayerOps`.

        Args:
            model: the network these weights were taken from.
            token_ids, positions: int64 [B]; kv_layers: per-layer K and V pools; meta: a
                pure-decode step's metadata (B rows, the genserve-kernels CPU backend).
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
            [m.decode_blocks.view(m.num_decode, -1) for m in groups], [m.decode_lens for m in groups],
            group, self.n_heads, self.n_kv_heads, self.scales, self.windows, self.bqkv, self.bo,
            self.q_norm, self.k_norm, self.post_attn_norm, self.post_ffn_norm, self.gelu,
            self.k_chunks, self.max_rows, self.q4, self.i8, self.q4q8, self.q8q8, self.qk,
            self.qk_kinds, self.qk_counts, rows, offsets, blobs, tables)

    @staticmethod
    def accepts(lora: LoraBatch | None) -> bool:
        """Whether `run` takes a step with these adapter rows: none, or every adapter with its
        `lora_delta_` tables (`LoraBatch.kernel_args`)."""
        return lora is None or lora.kernel_args is not None
