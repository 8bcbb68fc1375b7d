"""Batch invariance under time-sized prefill: the step budget changes how many pieces run, never the bits."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.runner.builder import engine_from_weights
from tests.engine.conftest import generate
from tests.engine.model.test_model import mixed_prompts


@pytest.mark.slow
def test_greedy_tokens_under_time_sized_steps_equal_each_prompt_alone(gguf_weights, bf16_engine, gguf_tokenizer):
    args, state = gguf_weights
    # A 64-token cap and 40 ms / 60 ms targets with the design's cost model: a step with 8
    # decode rows (28.4 ms) has room for one 64-token piece, a step without rows for 600
    # tokens (9 whole pieces and tails of short prompts), so prompts are prefilled in other
    # groupings than each prompt alone (whole, within the 1,024-token cap with few rows).
    paced = engine_from_weights(EngineConfig(num_blocks=2048, dtype="bfloat16", prefill_token_budget=64,
                                             prefill_token_budget_few_rows=64, tpot_target_ms=40.0,
                                             gap_target_ms=60.0), args, state)
    prompts = mixed_prompts(gguf_tokenizer)
    pieces = []
    paced.step_listeners.append(lambda plan, ev, s: pieces.append(plan.num_prefill_tokens))
    alone = [generate(bf16_engine, [p], 12, temperature=0.0, ignore_eos=True)[0] for p in prompts]
    together = generate(paced, prompts, 12, temperature=0.0, ignore_eos=True)
    assert together == alone
    assert 64 < max(pieces) <= 600, pieces
    assert sum(pieces) == sum(len(p) for p in prompts)
