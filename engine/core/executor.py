"""The execute stage's interface: a `StepPlan` in, one sampled token per draw out.

Torch-free: the engine loop and the scheduler depend on this protocol, never on the model runner.
"""

from __future__ import annotations

from typing import Protocol

from engine.core.outputs import SampledTokens
from engine.core.plan import StepPlan


class Executor(Protocol):
    """Runs the forward and sample stages of one step: `ModelRunner` (engine/runner/model_runner.py)
    runs the network, `SimExecutor` (engine/core/sim_executor.py) a cost model in virtual time.
    The scheduler never sees it; the engine calls `execute` once per step.
    """

    def execute(self, plan: StepPlan) -> SampledTokens:
        """Compute `plan`'s tokens and sample one token per draw (`plan.draws`, in order)."""
        ...
