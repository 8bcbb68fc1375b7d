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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelArgs
from engine.model.layer_ops import TorchLayerOps
from engine.model.linear import PackedWeight, linear, pack_fp32


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

    def forward(self, x: torch.Tensor, ops: type[TorchLayerOps]) -> torch.Tensor:    # x: [T, dim]
        gate_up = linear(x, self.w13, self.w13_packed)                               # [T, 2·ffn]
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.gelu(gate, approximate="tanh").mul_(up)
        else:
            hidden = ops.silu_mul(gate_up)
        return linear(hidden, self.w2, self.w2_packed)                               # [T, dim]

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
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        moe = args.moe
        assert moe is not None
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.router = nn.Parameter(torch.empty(moe.n_experts, args.dim))
        self.router_packed: PackedWeight | None = None
        self.experts = nn.ModuleList(FeedForward(args.dim, moe.expert_size, args.activation)
                                     for _ in range(moe.n_experts))
        self.register_buffer("expert_rows", torch.zeros(moe.n_experts, dtype=torch.int64), persistent=False)

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
        weights, ids = self.route(x)
        flat = ids.flatten()                                                         # [T·k] pairs
        counts = torch.bincount(flat, minlength=len(self.experts))
        self.expert_rows += counts
        order = torch.argsort(flat, stable=True)           # pairs grouped by expert, tokens ascending
        tokens, pair_weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):            # experts in id order: a fixed sum order
            if n:
                rows = tokens[start:start + n]
                y = self.experts[e].forward(x[rows], ops)                            # [n, dim]
                out.index_add_(0, rows, y.float() * pair_weights[start:start + n, None])
                start += n
        return out.to(x.dtype)

    def matrices(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every expert's matrices, expert by expert (w13, w2); the router
        is not among them (it stays fp32, `router_packed`)."""
        return [pair for expert in self.experts for pair in expert.matrices()]

    def pack_router(self) -> None:
        """Attach `router_packed` (CPU only; None elsewhere or where no call size keeps rows
        independent, and then the router is plain `F.linear`)."""
        self.router_packed = pack_fp32(self.router) if self.router.device.type == "cpu" else None
