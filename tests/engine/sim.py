"""Helpers that drive the real Scheduler with the SimExecutor (no model)."""

from __future__ import annotations

import itertools

from engine.config import CAPS_ALONE, EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams
from engine.core.sim_executor import SimExecutor

CAPS_ONLY = dict(CAPS_ALONE)
"""`engine.config.CAPS_ALONE` as keyword arguments: the design's token caps alone size each
step's prefill (`StepBudget`)."""


class FakeClock:
    """A settable clock in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sim_engine(num_blocks: int = 512, kv_windows: tuple[int | None, ...] = (None,),
               **config) -> tuple[Engine, FakeClock]:
    """An Engine over SimExecutor with a fake clock (advance it yourself), its pool in the KV
    groups `kv_windows` (`engine.core.kv_groups`). Prefix caching is off unless
    `prefix_caching=True` is given: `make_request`'s prompts all share their first tokens."""
    cfg = EngineConfig(num_blocks=num_blocks, **{"prefix_caching": False, **config})
    clock = FakeClock()
    return Engine(cfg, SimExecutor(), num_blocks, kv_windows=kv_windows, clock=clock), clock


_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int, api_key: str = "", events=None, *,
                 prompt_ids: list[int] | None = None, cache_salt: str = "", lora=None,
                 **sampling) -> Request:
    """A request with a synthetic prompt of `prompt_len` tokens (or `prompt_ids`, when given),
    its rows on LoRA adapter `lora` (a `LoraRequest`; None: the base model); events, if a list,
    collects its TokenEvents."""
    rid = f"r{next(_ids)}"
    prompt = prompt_ids if prompt_ids is not None else [1 + (i % 1000) for i in range(prompt_len)]
    return Request(rid, api_key, prompt, max_tokens, SamplingParams(**sampling), 0.0, 0.0,
                   on_event=events.append if events is not None else None, cache_salt=cache_salt,
                   lora=lora)
