"""`ModelExecutor`: runs a `StepPlan` through the real model over the paged KV cache.

It implements `engine.step.Executor`, as does the virtual-time cost model
(`engine.sim_executor.SimExecutor`); the scheduler cannot tell them apart: both take a plan and
return one token per draw (`SampledTokens`).
"""

from __future__ import annotations

import time

import torch

from engine import kernels as genserve_kernels
from engine.attention import AttentionMetadata, GatherBuffer
from engine.kv_cache import KVCache
from engine.model.llama import Transformer
from engine.request import Request
from engine.sampler import make_generator, sample
from engine.scheduler import CostModel
from engine.step import SampledTokens, StepPlan


def request_generator(req: Request) -> torch.Generator:
    """The request's own generator, created on first use from its seed (kept across preemption)."""
    if req.generator is None:
        req.generator = make_generator(req.sampling.seed)
    return req.generator


class ModelExecutor:
    """The real model over the paged KV cache.

    Args:
        model: the network (its dtype is the serving dtype).
        kv: the paged K/V tensors.
        cost_model: initial per-token costs; `calibrate()` measures real ones.
        kernels: run genserve's CPU kernels (`engine/kernels.py`: decode attention and the fused
            per-token steps of each block); None: when they build here (CPU, head_dim 64), else
            torch SDPA and plain torch ops.

    One step builds the flat batch `token_ids[B + C]`, `positions[B + C]` (the tokens of each
    segment, in plan order), runs the forward pass, projects to logits only the last position
    of each sampling segment (`logits[R, vocab]`), and samples.
    """

    def __init__(self, model: Transformer, kv: KVCache, cost_model: CostModel | None = None,
                 kernels: bool | None = None) -> None:
        self.model = model
        self.kv = kv
        self.cost_model = cost_model or CostModel()
        if kernels is None:
            kernels = (model.args.head_dim == 64 and kv.layers[0].device.type == "cpu"
                       and genserve_kernels.available())
        self.kernels = kernels
        self.gather = None if kernels else GatherBuffer()   # the SDPA decode path's keys, values

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> SampledTokens:
        """Forward + sample; raises whatever the model raises (the loop turns it into errors).

        The step's stages are `torch.profiler.record_function` ranges, so a profiler run sees
        them (benchmarks/engine.py reads them): "genserve.inputs" (flat batch, block copies,
        attention metadata), "genserve.forward" (`model(...)`), "genserve.logits" (the output
        projection of the sampling rows) and "genserve.sample". With no profiler running, a range
        records nothing.
        """
        t0 = time.perf_counter()
        with torch.profiler.record_function("genserve.inputs"):
            token_ids: list[int] = []
            positions: list[int] = []
            sample_rows: list[int] = []
            for seg in plan.segments:
                req = seg.request
                token_ids.extend(req.token_at(p) for p in range(seg.start, seg.end))
                positions.extend(range(seg.start, seg.end))
                if seg.samples:
                    sample_rows.append(len(token_ids) - 1)
            for src, dst in plan.block_copies:      # copy-on-write of shared prompt blocks
                self.kv.copy_block(src, dst)
            meta = AttentionMetadata.build(
                [(s.start, s.length, s.block_table, s.decode) for s in plan.segments],
                self.kv.block_size, self.model.dtype, self.kernels, self.gather)
            token_tensor = torch.tensor(token_ids, dtype=torch.long)
            position_tensor = torch.tensor(positions, dtype=torch.long)
        with torch.profiler.record_function("genserve.forward"):
            hidden = self.model(token_tensor, position_tensor, self.kv.layers, meta)
        if not sample_rows:
            return SampledTokens([], [], [], time.perf_counter() - t0)
        with torch.profiler.record_function("genserve.logits"):
            logits = self.model.logits(hidden[sample_rows])              # [R, vocab] fp32
        draws = plan.draws
        rows = [row for row, _ in draws]
        if rows != list(range(logits.shape[0])):       # n > 1: several draws share a row
            logits = logits[torch.tensor(rows, dtype=torch.long)]
        with torch.profiler.record_function("genserve.sample"):
            tokens, logprobs, top = sample(logits, [r.sampling for _, r in draws],
                                           [request_generator(r) for _, r in draws])
        return SampledTokens(tokens, logprobs, top, time.perf_counter() - t0)
