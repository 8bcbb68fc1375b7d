"""`SimExecutor`: a cost model in place of the network, for virtual-time runs of the real scheduler.

Torch-free: the simulator (`loadgen.sim`) and the scheduler tests load it without the model.
"""

from __future__ import annotations

import os
import zlib

from engine.core.cost_model import CostModel, StepFeatures
from engine.core.outputs import SampledTokens
from engine.core.plan import StepPlan


class SimExecutor:
    """A cost model in place of the network, for virtual-time runs of the real scheduler.

    Step time is `engine.core.cost_model.CostModel.step_ms` of the step's features (B decode rows,
    C prefill tokens, K context tokens read by the decode rows, P prefill attention pairs): the
    same formula the scheduler predicts steps with, so in virtual time its predictions are exact
    when the scheduler is given the same terms. The defaults are the design's (docs/design.md):
    25 ms for 1 row, 40 ms for 32 (each step reads all 14 GB of weights once), 0.1 ms per prefill
    token (10,000 tokens/s), and no base or context terms. A measured model (`from_json`) sets all
    six.

    Token ids are deterministic: `crc32(request id, position) % vocab`, never the EOS id, so a
    request always runs to max_tokens. `last_step_s` holds the modelled time of the last step;
    the driver advances its virtual clock by it.

    Attributes:
        device_costs: the simulated device's true step costs (the scheduler gets its own copy,
            `CostModel(**device_costs.params())`, which it may refit; the device's do not move).
    """

    def __init__(self, decode_1_ms: float = 25.0, decode_32_ms: float = 40.0,
                 prefill_ms_per_token: float = 0.1, vocab_size: int = 32000,
                 eos_token_id: int | None = None, *, step_base_ms: float = 0.0,
                 decode_ms_per_context_token: float = 0.0, prefill_ms_per_kpair: float = 0.0) -> None:
        self.device_costs = CostModel(
            decode_1_ms=decode_1_ms, decode_32_ms=decode_32_ms,
            prefill_ms_per_token=prefill_ms_per_token, step_base_ms=step_base_ms,
            decode_ms_per_context_token=decode_ms_per_context_token,
            prefill_ms_per_kpair=prefill_ms_per_kpair, refit_every=0)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
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
            ValueError: an unknown field, or a value that is not a finite number >= 0.
        """
        return cls(**CostModel.from_json(source).params(), **kwargs)

    def step_seconds(self, num_rows: int, num_prefill_tokens: int, decode_context: int = 0,
                     prefill_pairs: int = 0) -> float:
        """Modelled step time in seconds for B decode rows, C prefill tokens, K context tokens
        read by the decode rows and P prefill attention pairs (`CostModel.step_ms`)."""
        features = StepFeatures(num_rows, num_prefill_tokens, decode_context, prefill_pairs)
        return self.device_costs.step_ms(features) / 1000.0

    def execute(self, plan: StepPlan) -> SampledTokens:
        """Modelled step: deterministic tokens, `last_step_s` set from the cost formula."""
        self.last_step_s = self.device_costs.step_ms(plan.features()) / 1000.0
        tokens = []
        for _, req in plan.draws:
            t = zlib.crc32(f"{req.request_id}:{req.num_tokens}".encode()) % self.vocab_size
            if t == self.eos_token_id:
                t = (t + 1) % self.vocab_size
            tokens.append(t)
        return SampledTokens(tokens, None, None, self.last_step_s)
