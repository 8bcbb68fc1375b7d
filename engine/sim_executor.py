"""`SimExecutor`: a cost model in place of the network, for virtual-time runs of the real scheduler.

Torch-free: the simulator (`loadgen.sim`) and the scheduler tests load it without the model.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import zlib

from engine.scheduler import CostModel
from engine.step import SampledTokens, StepPlan


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
    L·s + L(L + 1)/2 of causal attention. The defaults are the design's (docs/design.md): 25 ms
    for 1 row, 40 ms for 32 rows (each step reads all 14 GB of weights once), 0.1 ms per prefill
    token (10,000 tokens/s), and no base or context terms. A measured model (`from_json`) sets
    all six.

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
