"""The block's MLPs: the dense gated MLP every family has, and the sparse mixture of experts
(Qwen3-MoE, Mixtral) whose experts are gated MLPs themselves.

Dense: down(act(gate(x)) · up(x)), gate | up fused (Shazeer 2020).

Mixture of experts (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; transformers'
`Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock`): router logits x · Rᵀ in fp32, a softmax over
the experts, the top k kept (divided by their sum where `MoEArgs.norm_topk_prob` says), and the
token's output Σ p_e · expert_e(x) over its k experts. A step groups its (token, expert) pairs by
expert: each chosen expert runs once, over the tokens that chose it, so its weights are read once
per step and experts no token chose are not read at all. Every token's output is summed in fp32 in
expert order and rounded once, and each product's rows are independent of the other rows
(`engine.model.linear.linear`), so a token's bits do not depend on which other tokens share its
experts or how many there are.

On a CUDA device whose torch has a grouped GEMM for it (`grouped_mm_device`: `torch._grouped_mm`,
bf16 on sm_90 / sm_100) the experts' matrices are one stacked tensor per layer and the step runs
both products of every expert in one call each (`MoEFeedForward.forward_grouped`), without
reading the group sizes back to the host. On the CPU, where every chosen expert's matrices run
genserve's `packed_linear` (bf16) or `qk_linear` (a GGUF's Q4_K / Q6_K experts), each matrix's
products are one `packed_linear_grouped` or `qk_linear_grouped` call (the same rows' bits, the
threads sharing every expert's column blocks). Elsewhere (Q8_0 or int8 experts, other devices),
the loop over the experts that have tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine import kernels
from engine.model.config import ModelArgs, MoEArgs
from engine.model.layer_ops import TorchLayerOps
from engine.model.linear import PackedLinearMethod, PackedWeight, QKMethod, linear, pack_fp32
from engine.model.lora import LoraBatch

# torch._grouped_mm's bf16 CUTLASS kernel (aten/src/ATen/native/cuda/GroupedBlas.cpp) runs on
# compute capability 9.x and 10.x; elsewhere torch falls back to a loop over the groups that reads
# the offsets back to the host (`offs.cpu()`), once per product. It takes fewer than 1,024 groups,
# and rows whose length is a multiple of 16 bytes.
GROUPED_MM_CAPABILITIES = (9, 10)
GROUPED_MM_MAX_GROUPS = 1024


def grouped_mm_device(moe: MoEArgs, dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the mixture-of-experts layers of a model of width `dim` in `dtype` on `device` run
    their experts through `torch._grouped_mm` (over stacked expert matrices): a CUDA device of
    compute capability 9.x or 10.x (Hopper, Blackwell), bf16, fewer than 1,024 experts, and
    `dim` and the expert size multiples of 8 (16-byte rows). False when this torch has no
    `_grouped_mm`."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and moe.n_experts < GROUPED_MM_MAX_GROUPS and dim % 8 == 0 and moe.expert_size % 8 == 0
            and torch.cuda.get_device_capability(device)[0] in GROUPED_MM_CAPABILITIES)


def gated(gate_up: torch.Tensor, gelu: bool, ops: type[TorchLayerOps]) -> torch.Tensor:
    """act(gate) · up for gate_up [N, 2·F] (gate columns, then up): [N, F], SiLU or tanh-GELU."""
    return ops.gelu_tanh_mul(gate_up) if gelu else ops.silu_mul(gate_up)


class FeedForward(nn.Module):
    """Gated MLP: down(act(gate(x)) · up(x)), gate and up fused (Shazeer 2020); act SiLU
    (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma).

    Args:
        dim: model width; hidden: the MLP's hidden size; activation: "silu" or "gelu_tanh".
    Attributes:
        w13 [2·hidden, dim] (gate rows, then up rows), w2 [dim, hidden]; `*_packed` beside them.
    """

    def __init__(self, dim: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.ffn = hidden
        self.gelu = activation == "gelu_tanh"
        self.w13 = nn.Parameter(torch.empty(2 * hidden, dim))
        self.w2 = nn.Parameter(torch.empty(dim, hidden))
        self.w13_packed: PackedWeight | None = None
        self.w2_packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor, ops: type[TorchLayerOps], lora: LoraBatch | None = None,
                layer: int = 0) -> torch.Tensor:                                     # x: [T, dim]
        """x [T, dim] → [T, dim]; with `lora`, the adapter rows' deltas of layer `layer` are added
        to the gate | up and down products."""
        gate_up = linear(x, self.w13, self.w13_packed)                               # [T, 2·ffn]
        if lora is not None:
            lora.add(gate_up, x, layer, "feed_forward.w13")
        hidden = gated(gate_up, self.gelu, ops)                                      # [T, ffn]
        out = linear(hidden, self.w2, self.w2_packed)                                # [T, dim]
        if lora is not None:
            lora.add(out, hidden, layer, "feed_forward.w2")
        return out

    def matrices(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of its matrices: w13, w2."""
        return [(self, "w13"), (self, "w2")]


class MoEFeedForward(nn.Module):
    """A sparse mixture of gated-MLP experts (module docstring).

    Args:
        args: the model; its `moe` gives the experts' count, size, top k and normalization.
    Attributes:
        router: fp32 [n_experts, dim], the routing matrix (transformers' `mlp.gate`); its
            `router_packed` is an fp32 copy run in fixed-size calls on the CPU (`pack_fp32`), so a
            token's logits do not depend on the batch; None elsewhere.
        experts: n_experts `FeedForward`s of `expert_size`.
        expert_rows: int64 [n_experts], how many tokens each expert has taken since the model was
            built (the metrics' expert load; a non-persistent buffer).
        w13_stacked: [n_experts, 2·expert_size, dim] in the model dtype, every expert's w13
            (gate rows, then up rows), and w2_stacked [n_experts, dim, expert_size] every w2;
            each expert's `w13` / `w2` is then a view of its slice, so the weights exist once
            (`stack_experts`). Non-persistent buffers, None unless the model was built for the
            grouped GEMM (`grouped_mm_device`); `forward` takes `forward_grouped` when they are
            set and on the input's device.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        moe = args.moe
        assert moe is not None
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.router = nn.Parameter(torch.empty(moe.n_experts, args.dim))
        self.router_packed: PackedWeight | None = None
        self.gelu = args.activation == "gelu_tanh"
        self.experts = nn.ModuleList(FeedForward(args.dim, moe.expert_size, args.activation)
                                     for _ in range(moe.n_experts))
        self.register_buffer("expert_rows", torch.zeros(moe.n_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("w13_stacked", None, persistent=False)
        self.register_buffer("w2_stacked", None, persistent=False)

    @staticmethod
    def stack_experts(matrices: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One tensor [n_experts, rows, cols] holding `matrices` (n_experts of [rows, cols], one
        per expert, in expert order) and a view of it per expert, to load in their place (the
        experts' own tensors can then be freed: the weights exist once)."""
        stacked = torch.stack(matrices)
        return stacked, list(stacked.unbind(0))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts: (weights fp32 [T, k], expert ids int64 [T, k]) for x [T, dim],
        the ids in descending probability (torch.topk's order; ties to the lower id)."""
        logits = linear(x.float(), self.router, self.router_packed)                  # fp32 [T, E]
        probs = torch.softmax(logits, dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, ops: type[TorchLayerOps]) -> torch.Tensor:    # x: [T, dim]
        """x [T, dim] → [T, dim] in x's dtype: each token's k experts' outputs, weighted, added in
        fp32 in expert-id order, rounded once. The products run as one grouped call per matrix
        where the device allows (`torch._grouped_mm` over the stacked experts on CUDA; on the CPU
        genserve's `packed_linear_grouped` or `qk_linear_grouped` when every chosen expert runs
        `packed_linear`, or `qk_linear`), else one call per chosen expert; the paths give a
        token the same bits on one device."""
        stacked = self.w13_stacked
        if stacked is not None and stacked.device == x.device:
            return self.forward_grouped(x, ops, self._stacked_product)
        weights, ids = self.route(x)
        flat = ids.flatten()                                                         # [T·k] pairs
        counts = torch.bincount(flat, minlength=len(self.experts))
        sizes = counts.tolist()
        product = self._grouped_product(x, sizes)
        if product is not None:
            return self.forward_grouped(x, ops, product, (weights, ids, counts))
        self.expert_rows += counts
        order = torch.argsort(flat, stable=True)           # pairs grouped by expert, tokens ascending
        tokens, pair_weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(sizes):                      # experts in id order: a fixed sum order
            if n:
                rows = tokens[start:start + n]
                y = self.experts[e].forward(x[rows], ops)                            # [n, dim]
                out.index_add_(0, rows, y.float() * pair_weights[start:start + n, None])
                start += n
        return out.to(x.dtype)

    def _grouped_product(self, x: torch.Tensor, sizes: list[int]
                         ) -> Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor] | None:
        """The CPU's one-call-per-matrix product for this step's chosen experts (`sizes`: rows per
        expert), or None (then one call per expert): on a bf16 CPU input with genserve's kernels
        built, `packed_linear_grouped` where every chosen expert's matrices run `packed_linear`
        (`PackedLinearMethod`, whose rows give oneDNN's bits at any count), `qk_linear_grouped`
        where they all run `qk_linear` (a GGUF's Q4_K / Q6_K experts). Each keeps every row's bits."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or not kernels.available():
            return None
        methods = {type(getattr(e, m + "_packed").method) if getattr(e, m + "_packed") is not None else None
                   for e, n in zip(self.experts, sizes) if n for m in ("w13", "w2")}
        if methods == {PackedLinearMethod} and kernels.packed_linear_grouped_available():
            return self._packed_product
        if methods == {QKMethod}:
            return self._qk_product
        return None

    def _packed_product(self, rows: torch.Tensor, which: str, counts: torch.Tensor) -> torch.Tensor:
        """rows [T·k, in] grouped by expert (`counts` int64 [E] rows each) times each group's
        expert matrix `which` ("w13" or "w2"), one `packed_linear_grouped` call → [T·k, out]."""
        packed, offsets = self._busy(which, counts)
        return torch.ops.genserve.packed_linear_grouped(rows.contiguous(), [p.tensor for p in packed],
                                                        offsets, [p.k_chunk for p in packed])

    def _qk_product(self, rows: torch.Tensor, which: str, counts: torch.Tensor) -> torch.Tensor:
        """The same over the experts' Q4_K / Q6_K blocks, one `qk_linear_grouped` call."""
        packed, offsets = self._busy(which, counts)
        return torch.ops.genserve.qk_linear_grouped(
            rows.contiguous(), [b for p in packed for b in p.qk.blocks],
            [kind for p in packed for kind in p.qk.kinds], [len(p.qk.blocks) for p in packed], offsets, -1)

    def _busy(self, which: str, counts: torch.Tensor) -> tuple[list[PackedWeight], list[int]]:
        """The packed matrix `which` of each expert with rows this step, and the row offsets of
        their groups ([0, n_0, n_0 + n_1, ...])."""
        sizes = counts.tolist()
        busy = [e for e, n in enumerate(sizes) if n]
        offsets = [0]
        for e in busy:
            offsets.append(offsets[-1] + sizes[e])
        return [getattr(self.experts[e], which + "_packed") for e in busy], offsets

    def _stacked_product(self, rows: torch.Tensor, which: str, counts: torch.Tensor) -> torch.Tensor:
        """The same through `torch._grouped_mm` over the stacked experts (views transposed as the
        kernel wants them), group ends int32 on the device: no read back to the host."""
        stacked = self.w13_stacked if which == "w13" else self.w2_stacked
        return torch._grouped_mm(rows, stacked.transpose(1, 2), offs=counts.cumsum(0, dtype=torch.int32))

    def forward_grouped(self, x: torch.Tensor, ops: type[TorchLayerOps],
                        product: Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor],
                        routed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`forward` with each matrix's products as one grouped call (`product(rows, "w13" |
        "w2", counts)`): x [T, dim] → [T, dim] in x's dtype. `routed`: (weights, ids, counts)
        already computed, else routed here with the counts made on the device (`scatter_add_`:
        no `bincount`, which reads back to the host on CUDA).

        The T·k (token, expert) pairs are sorted by expert (tokens ascending within one), so both
        products take every expert at once: [T·k, dim] → [T·k, 2F], the gate, then [T·k, F] →
        [T·k, dim]. Each token's k products are then added in fp32 in expert-id order, as the
        loop adds them: k gathers and adds of [T, dim], in a fixed order (no atomics, unlike
        `index_add_` on CUDA), rounded once to the model dtype.
        """
        if routed is None:
            weights, ids = self.route(x)                                 # fp32 [T, k], int64 [T, k]
            flat = ids.flatten()                                         # [T·k] pairs, token-major
            counts = torch.zeros(self.expert_rows.shape, dtype=torch.int64, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat))          # int64 [E]
        else:
            weights, ids, counts = routed
            flat = ids.flatten()
        t, k = ids.shape
        self.expert_rows += counts
        order = torch.argsort(flat, stable=True)                         # pairs grouped by expert
        rows = x[order // k]                                             # [T·k, dim]
        gate_up = product(rows, "w13", counts)                           # [T·k, 2F]
        y = product(gated(gate_up, self.gelu, ops), "w2", counts)        # [T·k, dim]
        where = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=x.device))
        at, pick = where.view(t, k).sort(dim=-1)     # each token's rows of y, in expert-id order
        pair_weights = weights.gather(1, pick)                           # fp32 [T, k]
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(k):
            out += y[at[:, j]].float() * pair_weights[:, j, None]
        return out.to(x.dtype)

    def matrices(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every expert's matrices, expert by expert (w13, w2); the router
        is not among them (it stays fp32, `router_packed`)."""
        return [pair for expert in self.experts for pair in expert.matrices()]

    def pack_router(self) -> None:
        """Attach `router_packed` (CPU only; None elsewhere or where no call size keeps rows
        independent, and then the router is plain `F.linear`)."""
        self.router_packed = pack_fp32(self.router) if self.router.device.type == "cpu" else None
