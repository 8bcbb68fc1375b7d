"""How many LoRA adapters one step may use: at most `max_loras` distinct ones (vLLM's
`--max-loras`), the base model not counted.

A step's rows come from the running requests alone (`Scheduler._build`), so the cap holds at
the join: a queued request whose adapter none of the running rows uses joins only while fewer
than `max_loras` adapters run. Otherwise it waits; it is neither failed nor preempts anyone, and
the rows already running keep running on their adapters. It holds back only its own key's
queue (FIFO per key): other keys' requests join past it, the base model's and those on a
running adapter, so one waiting adapter does not stall every tenant.

It is not passed over for ever: once it has waited `StepBudget.aged_after_s` nothing joins
while it is the fair queue's candidate, so the running adapters' rows end (every request has
`max_tokens`) and its adapter takes the slot that frees.

Pure bookkeeping over the running rows: no clock, no blocks, no tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core.request import Request

__all__ = ["LoraCap", "step_adapters"]


def step_adapters(requests: Iterable[Request]) -> set[int]:
    """The distinct adapters of `requests`: their load ids (`LoraRequest.lora_id`); requests of
    the base model add none."""
    return {r.lora.lora_id for r in requests if r.lora is not None}


class LoraCap:
    """The join's cap on a step's distinct LoRA adapters (the module docstring says it whole).

    Args:
        max_loras: the most distinct adapters a step may use (`EngineConfig.max_loras`), >= 1.

    Raises:
        ValueError: `max_loras` < 1.
    """

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras

    def fits(self, running: Sequence[Request], req: Request) -> bool:
        """Whether `req` may join the `running` rows as far as adapters go: it runs on the base
        model, or its adapter runs already, or fewer than `max_loras` adapters run."""
        if req.lora is None:
            return True
        running_ids = step_adapters(running)
        return req.lora.lora_id in running_ids or len(running_ids) < self.max_loras
