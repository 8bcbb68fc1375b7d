"""Real-model engines for the engine tests (session-scoped; built from the shared GGUF weights)."""

from __future__ import annotations

import itertools

import pytest

from engine import kernels as genserve_kernels
from engine.builder import engine_from_weights
from engine.config import EngineConfig
from engine.loop import Engine
from engine.request import Request, SamplingParams

_ids = itertools.count()


@pytest.fixture(params=["torch", "kernels"])
def kernels(request) -> bool:
    """Both compute paths: torch ops + SDPA, and genserve's CPU kernels (skipped, saying so, where
    they cannot be built)."""
    if request.param == "kernels" and not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?); torch path only")
    return request.param == "kernels"


@pytest.fixture(scope="session")
def bf16_engine(gguf_weights) -> Engine:
    """The serving configuration: bf16, 2,048 blocks (32,768 tokens), no thread (step by hand)."""
    args, state = gguf_weights
    return engine_from_weights(EngineConfig(num_blocks=2048, dtype="bfloat16"), args, state)


@pytest.fixture(scope="session")
def fp32_engine(gguf_weights) -> Engine:
    """fp32 weights and cache, for parity with transformers."""
    args, state = gguf_weights
    return engine_from_weights(EngineConfig(num_blocks=256, dtype="float32"), args, state)


def new_request(prompt_ids: list[int], max_tokens: int, events: list | None = None,
                eos_token_id: int | None = 2, **sampling) -> Request:
    """A request whose TokenEvents are appended to `events` (if given)."""
    return Request(f"t{next(_ids)}", "test", list(prompt_ids), max_tokens,
                   SamplingParams(**sampling), 0.0, 0.0,
                   on_event=events.append if events is not None else None,
                   eos_token_id=eos_token_id)


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int, **sampling) -> list[list[int]]:
    """Submit all prompts at once, step the engine until idle, return each request's tokens."""
    reqs = [new_request(p, max_tokens, **sampling) for p in prompts]
    for r in reqs:
        engine.submit(r)
    engine.run_until_idle()
    engine.pool.check_all_free()
    return [list(r.generated) for r in reqs]
