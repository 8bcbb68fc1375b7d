"""Executors run a `StepPlan`: the real model, or a cost model in virtual time.

The scheduler cannot tell them apart: both take a plan and return one token per sampling
segment (`SampledTokens`).
"""

from __future__ import annotations

import time
import zlib
from typing import Protocol

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model.llama import Transformer
from engine.request import Request
from engine.sampler import make_generator, sample
from engine.scheduler import CostModel
from engine.step import SampledTokens, StepPlan


class Executor(Protocol):
    """Runs one step. `cost_model` feeds admission control."""

    cost_model: CostModel

    def execute(self, plan: StepPlan) -> SampledTokens:
        """Compute `plan`'s tokens and sample one token per sampling segment."""
        ...


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

    One step builds the flat batch `token_ids[B + C]`, `positions[B + C]` (the tokens of each
    segment, in plan order), runs the forward pass, projects to logits only the last position
    of each sampling segment (`logits[R, vocab]`), and samples.
    """

    def __init__(self, model: Transformer, kv: KVCache, cost_model: CostModel | None = None) -> None:
        self.model = model
        self.kv = kv
        self.cost_model = cost_model or CostModel()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> SampledTokens:
        """Forward + sample; raises whatever the model raises (the loop turns it into errors)."""
        t0 = time.perf_counter()
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
            for layer in self.kv.layers:
                layer[dst].copy_(layer[src])
        meta = AttentionMetadata.build(
            [(s.start, s.length, s.block_table, s.decode) for s in plan.segments], self.kv.block_size)
        hidden = self.model(torch.tensor(token_ids, dtype=torch.long),
                            torch.tensor(positions, dtype=torch.long), self.kv.layers, meta)
        if not sample_rows:
            return SampledTokens([], [], [], time.perf_counter() - t0)
        logits = self.model.logits(hidden[sample_rows])              # [R, vocab] fp32
        draws = plan.draws
        rows = torch.tensor([row for row, _ in draws], dtype=torch.long)
        tokens, logprobs, top = sample(logits[rows], [r.sampling for _, r in draws],
                                       [request_generator(r) for _, r in draws])
        return SampledTokens(tokens, logprobs, top, time.perf_counter() - t0)


class SimExecutor:
    """A cost model in place of the network, for virtual-time runs of the real scheduler.

    Step time (seconds) = decode time of B rows + C prefill tokens × prefill cost, where the
    decode time interpolates linearly between `decode_1_ms` for 1 row and `decode_32_ms` for 32
    rows (design card: 25 ms and 40 ms, because each step reads all 14 GB of weights once) and
    prefill costs `prefill_ms_per_token` (design: 0.1 ms, 10,000 tokens/s).

    Token ids are deterministic: `crc32(request id, position) % vocab`, never the EOS id, so a
    request always runs to max_tokens. `last_step_s` holds the modelled time of the last step;
    the driver advances its virtual clock by it.
    """

    def __init__(self, decode_1_ms: float = 25.0, decode_32_ms: float = 40.0,
                 prefill_ms_per_token: float = 0.1, vocab_size: int = 32000,
                 eos_token_id: int | None = None) -> None:
        self.decode_1_ms = decode_1_ms
        self.decode_32_ms = decode_32_ms
        self.prefill_ms_per_token = prefill_ms_per_token
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cost_model = CostModel(prefill_ms_per_token, decode_32_ms / 32.0)
        self.last_step_s = 0.0

    def step_seconds(self, num_rows: int, num_prefill_tokens: int) -> float:
        """Modelled step time in seconds for B decode rows and C prefill tokens."""
        decode_ms = 0.0
        if num_rows:
            decode_ms = self.decode_1_ms + (self.decode_32_ms - self.decode_1_ms) * (num_rows - 1) / 31.0
        return (decode_ms + num_prefill_tokens * self.prefill_ms_per_token) / 1000.0

    def execute(self, plan: StepPlan) -> SampledTokens:
        """Modelled step: deterministic tokens, `last_step_s` set from the cost formula."""
        self.last_step_s = self.step_seconds(plan.num_decode_rows, plan.num_prefill_tokens)
        tokens = []
        for _, req in plan.draws:
            t = zlib.crc32(f"{req.request_id}:{req.num_tokens}".encode()) % self.vocab_size
            if t == self.eos_token_id:
                t = (t + 1) % self.vocab_size
            tokens.append(t)
        return SampledTokens(tokens, None, None, self.last_step_s)
