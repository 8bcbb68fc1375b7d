"""Executors run a `StepPlan`: the real model, or a cost model in virtual time.

The scheduler cannot tell them apart: both take a plan and return one token per sampling
segment (`SampledTokens`).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import time
import zlib
from typing import Protocol

import torch

from engine import kernels as genserve_kernels
from engine.attention import AttentionMetadata, GatherBuffer
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
            self.kv.copy_block(src, dst)
        meta = AttentionMetadata.build(
            [(s.start, s.length, s.block_table, s.decode) for s in plan.segments],
            self.kv.block_size, self.model.dtype, self.kernels, self.gather)
        hidden = self.model(torch.tensor(token_ids, dtype=torch.long),
                            torch.tensor(positions, dtype=torch.long), self.kv.layers, meta)
        if not sample_rows:
            return SampledTokens([], [], [], time.perf_counter() - t0)
        logits = self.model.logits(hidden[sample_rows])              # [R, vocab] fp32
        draws = plan.draws
        rows = [row for row, _ in draws]
        if rows != list(range(logits.shape[0])):       # n > 1: several draws share a row
            logits = logits[torch.tensor(rows, dtype=torch.long)]
        tokens, logprobs, top = sample(logits, [r.sampling for _, r in draws],
                                       [request_generator(r) for _, r in draws])
        return SampledTokens(tokens, logprobs, top, time.perf_counter() - t0)


class SimExecutor:
    """A cost model in place of the network, for virtual-time runs of the real scheduler.

    Step time (ms) of a step with B decode rows and C prefill tokens:

        step_base_ms                                            every step (loop overhead)
      + decode_1_ms + (decode_32_ms - decode_1_ms)(B - 1)/31    if B > 0 (weights read once)
      + C × prefill_ms_per_token
      + K × decode_ms_per_context_token                         K = Σ context read by decode rows
      + P / 1000 × prefill_ms_per_kpair                         P = (query, key) pairs in prefill

    K sums, over the decode rows, the tokens each row attends to (its position + 1): the design's
    "attention reads grow with context". P sums, over the prefill chunks [s, s + L), the pairs
    L·s + L(L + 1)/2 of causal attention. The defaults are the design card's: 25 ms for 1 row,
    40 ms for 32 rows (each step reads all 14 GB of weights once), 0.1 ms per prefill token
    (10,000 tokens/s), and no base or context terms. A measured model (`from_json`) sets all six.

    Token ids are deterministic: `crc32(request id, position) % vocab`, never the EOS id, so a
    request always runs to max_tokens. `last_step_s` holds the modelled time of the last step;
    the driver advances its virtual clock by it.
    """

    COST_FIELDS = ("decode_1_ms", "decode_32_ms", "prefill_ms_per_token", "step_base_ms",
                   "decode_ms_per_context_token", "prefill_ms_per_kpair")

    def __init__(self, decode_1_ms: float = 25.0, decode_32_ms: float = 40.0,
                 prefill_ms_per_token: float = 0.1, vocab_size: int = 32000,
                 eos_token_id: int | None = None, *, step_base_ms: float = 0.0,
                 decode_ms_per_context_token: float = 0.0, prefill_ms_per_kpair: float = 0.0) -> None:
        self.decode_1_ms = decode_1_ms
        self.decode_32_ms = decode_32_ms
        self.prefill_ms_per_token = prefill_ms_per_token
        self.step_base_ms = step_base_ms
        self.decode_ms_per_context_token = decode_ms_per_context_token
        self.prefill_ms_per_kpair = prefill_ms_per_kpair
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cost_model = CostModel(prefill_ms_per_token, (step_base_ms + decode_32_ms) / 32.0)
        self.last_step_s = 0.0

    @classmethod
    def from_json(cls, source: str | os.PathLike | dict, **kwargs) -> "SimExecutor":
        """A SimExecutor with a measured cost model.

        Args:
            source: a JSON file path or its parsed dict: either the cost fields themselves or an
                object holding them under "sim_executor" (what `loadgen.calibrate` writes).
                Fields not given keep the design's defaults.
            kwargs: vocab_size / eos_token_id.
        Raises:
            ValueError: an unknown or non-numeric field.
        """
        data = source if isinstance(source, dict) else json.loads(pathlib.Path(source).read_text())
        data = data.get("sim_executor", data)
        unknown = set(data) - set(cls.COST_FIELDS)
        if unknown:
            raise ValueError(f"unknown cost model fields {sorted(unknown)}; known: {cls.COST_FIELDS}")
        params = {}
        for k, v in data.items():
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"cost model field {k} must be a finite number, got {v!r}")
            params[k] = float(v)
        return cls(**params, **kwargs)

    def cost_params(self) -> dict[str, float]:
        """The six cost fields (what `from_json` reads)."""
        return {k: getattr(self, k) for k in self.COST_FIELDS}

    def step_seconds(self, num_rows: int, num_prefill_tokens: int, decode_context: int = 0,
                     prefill_pairs: int = 0) -> float:
        """Modelled step time in seconds for B decode rows, C prefill tokens, K context tokens
        read by the decode rows and P prefill attention pairs (see the class docstring)."""
        decode_ms = 0.0
        if num_rows:
            decode_ms = self.decode_1_ms + (self.decode_32_ms - self.decode_1_ms) * (num_rows - 1) / 31.0
        return (self.step_base_ms + decode_ms + num_prefill_tokens * self.prefill_ms_per_token
                + decode_context * self.decode_ms_per_context_token
                + prefill_pairs / 1000.0 * self.prefill_ms_per_kpair) / 1000.0

    @staticmethod
    def plan_features(plan: StepPlan) -> tuple[int, int, int, int]:
        """(B decode rows, C prefill tokens, K decode context tokens, P prefill pairs) of `plan`."""
        rows = prefill = context = pairs = 0
        for seg in plan.segments:
            if seg.decode:
                rows += 1
                context += seg.end
            else:
                prefill += seg.length
                pairs += seg.length * seg.start + seg.length * (seg.length + 1) // 2
        return rows, prefill, context, pairs

    def execute(self, plan: StepPlan) -> SampledTokens:
        """Modelled step: deterministic tokens, `last_step_s` set from the cost formula."""
        self.last_step_s = self.step_seconds(*self.plan_features(plan))
        tokens = []
        for _, req in plan.draws:
            t = zlib.crc32(f"{req.request_id}:{req.num_tokens}".encode()) % self.vocab_size
            if t == self.eos_token_id:
                t = (t + 1) % self.vocab_size
            tokens.append(t)
        return SampledTokens(tokens, None, None, self.last_step_s)
