"""The C++ decode loop: every block of a pure-decode step in one call, from the model's packed
weights (CPU, genserve's kernels).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.model.layer_ops import KernelLayerOps
from engine.model.linear import ANY_ROWS, PACKED_LINEAR_MAX_ROWS
from engine.model.lora import LoraBatch
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
        scale: attention score scale, head_dim ** -0.5.
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
    scale: float
    k_chunks: list[int]
    max_rows: int = PACKED_LINEAR_MAX_ROWS
    q4: list[torch.Tensor] = dataclasses.field(default_factory=list)
    i8: list[torch.Tensor] = dataclasses.field(default_factory=list)
    q4q8: list[torch.Tensor] = dataclasses.field(default_factory=list)
    qk: list[torch.Tensor] = dataclasses.field(default_factory=list)
    qk_kinds: list[int] = dataclasses.field(default_factory=list)
    qk_counts: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def from_model(cls, model: Transformer) -> DecodeLoop | None:
        """From a packed model (`Transformer.pack`, or `engine.model.quant.attach_q4`); None unless
        every block matrix packed, with no oneDNN calls of fixed size and no fp32 copies (which
        the C++ loop does not run) unless its 4-bit blocks run every product (`fma_linear`'s
        panels it runs: the C++ `linear` tells them by their 3 dimensions), with int8 copies
        (`engine.model.int8`, row scales) on every block matrix or none, and with the GGUF's
        blocks for `q4q8_linear` (Q4_1) or `qk_linear` (Q4_K / Q6_K; `attach_q4q8`) on every
        block matrix or none (Q8_0 block matrices, on `q8q8_linear`: none)."""
        if not model.args.plain_llama:
            return None             # the C++ loop is the plain Llama block only
        layers = model.layers
        packed = [[layer.attention.wqkv_packed for layer in layers],
                  [layer.attention.wo_packed for layer in layers],
                  [layer.feed_forward.w13_packed for layer in layers],
                  [layer.feed_forward.w2_packed for layer in layers]]
        order = [ws[i] for i in range(len(layers)) for ws in packed]      # wqkv, wo, w13, w2 per layer
        if any(w is not None and w.q8q8 is not None for w in order):
            return None             # Q8_0 block matrices (`q8q8_linear`): the C++ loop has no such product
        with_q4q8 = [w is not None and w.q4q8 is not None for w in order]
        with_qk = [w is not None and w.qk is not None for w in order]
        if any(with_q4q8) or any(with_qk):
            if not all(a or b for a, b in zip(with_q4q8, with_qk)):
                return None         # the C++ loop takes the GGUF's blocks for every matrix or none
            none = torch.empty(0, dtype=torch.uint8)
            return cls.from_weights(
                model, packed, k_chunks=[0, 0, 0, 0], max_rows=0,
                q4q8=[w.q4q8 if w.q4q8 is not None else none for w in order] if any(with_q4q8) else [],
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
            model, packed, k_chunks=chunks, max_rows=min(w.max_rows for ws in packed for w in ws),
            q4=[ws[i].q4 for i in range(len(layers)) for ws in packed] if all(with_q4) else [],
            i8=[t for i in range(len(layers)) for ws in packed
                for t in (ws[i].i8.q, ws[i].i8.scale, ws[i].i8.outliers, ws[i].i8.outlier_q)]
            if all(with_i8) else [])

    @classmethod
    def from_weights(cls, model: Transformer, packed: list[list], **products) -> DecodeLoop:
        """The loop over `model`'s norms and shape with `packed` (per kind wqkv, wo, w13, w2, the
        layers' `PackedWeight`s) and `products` (the fields saying which kernel runs them)."""
        layers, args = model.layers, model.args
        wqkv, wo, w13, w2 = ([w.tensor for w in ws] for ws in packed)
        next_norm = [layer.attention_norm.weight for layer in layers[1:]] + [model.norm.weight]
        return cls(wqkv, wo, w13, w2,
                   ffn_norm=[layer.ffn_norm.weight for layer in layers], next_norm=next_norm,
                   eps=args.norm_eps, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                   scale=args.head_dim ** -0.5, **products)

    def run(self, model: Transformer, token_ids: torch.Tensor, positions: torch.Tensor,
            kv_layers: list[torch.Tensor], meta: AttentionMetadata,
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
        h, x = model.embed(token_ids, KernelLayerOps)
        return torch.ops.genserve.decode_layers(
            h, x, self.wqkv, self.wo, self.w13, self.w2, self.ffn_norm, self.next_norm, self.eps,
            model.rope, positions, kv_layers, meta.slots, meta.decode_blocks.view(meta.num_decode, -1),
            meta.decode_lens, self.n_heads, self.n_kv_heads, self.scale, self.k_chunks,
            self.max_rows, self.q4, self.i8, self.q4q8, self.qk, self.qk_kinds, self.qk_counts,
            rows, offsets, blobs, tables)

    @staticmethod
    def accepts(lora: LoraBatch | None) -> bool:
        """Whether `run` takes a step with these adapter rows: none, or every adapter with its
        `lora_delta_` tables (`LoraBatch.kernel_args`)."""
        return lora is None or lora.kernel_args is not None
