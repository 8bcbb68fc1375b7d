"""SimExecutor's cost model: the design's defaults, context terms, and a measured model from JSON."""

from __future__ import annotations

import json

import pytest

from engine.core.plan import Segment, StepPlan
from engine.core.request import Request, SamplingParams
from engine.core.sim_executor import SimExecutor
from loadgen.sim import design_config, simulate
from loadgen.workload import LengthMix, arrival_times, synthetic_workload

MEASURED = {"decode_1_ms": 12.0, "decode_32_ms": 30.0, "prefill_ms_per_token": 0.5, "step_base_ms": 3.0,
            "decode_ms_per_context_token": 0.002, "prefill_ms_per_kpair": 0.01}


def _req(rid: str, prompt: int = 100) -> Request:
    return Request(rid, "k", [1] * prompt, 10, SamplingParams(ignore_eos=True), 0.0, 0.0)


def test_defaults_are_the_design_card():
    sim = SimExecutor()
    assert sim.device_costs.params() == {"decode_1_ms": 25.0, "decode_32_ms": 40.0, "prefill_ms_per_token": 0.1,
                                 "step_base_ms": 0.0, "decode_ms_per_context_token": 0.0,
                                 "prefill_ms_per_kpair": 0.0}
    # Context does not change the design's step: 25 ms for 1 row, 40 ms for 32, + 0.1 ms per token.
    assert sim.step_seconds(1, 0, decode_context=5000) == pytest.approx(0.025)
    assert sim.step_seconds(32, 256, decode_context=50_000, prefill_pairs=10**6) == pytest.approx(0.0656)
    assert sim.step_seconds(0, 1000) == pytest.approx(0.1)
    assert sim.device_costs.prefill_ms_per_token == 0.1 and sim.device_costs.decode_ms_per_token == 1.25


def test_plan_features_count_context_and_causal_pairs():
    a, b, c = _req("a"), _req("b"), _req("c", 600)
    plan = StepPlan([Segment(a, 120, 1, True, (), decode=True), Segment(b, 9, 1, True, (), decode=True),
                     Segment(c, 256, 64, False, ()), Segment(c, 320, 30, False, ())])
    rows, prefill, context, pairs = plan.features().as_tuple()
    assert (rows, prefill) == (2, 94)
    assert context == 121 + 10                               # each row reads its position + 1 keys
    assert pairs == (64 * 256 + 64 * 65 // 2) + (30 * 320 + 30 * 31 // 2)
    sim = SimExecutor(**MEASURED)
    expected_ms = 3.0 + (12.0 + 18.0 * 1 / 31) + 94 * 0.5 + 131 * 0.002 + pairs / 1000 * 0.01
    sim.execute(plan)
    assert sim.last_step_s == pytest.approx(expected_ms / 1000)
    # A pure prefill step pays no decode term.
    assert sim.step_seconds(0, 64, prefill_pairs=2080) == pytest.approx((3.0 + 32.0 + 0.0208) / 1000)


def test_from_json_file_dict_and_wrapped(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"sim_executor": MEASURED, "fit": {"r2": 0.99}}))
    for source in (path, str(path), MEASURED, {"sim_executor": MEASURED}):
        assert SimExecutor.from_json(source).device_costs.params() == MEASURED
    partial = SimExecutor.from_json({"prefill_ms_per_token": 0.2})
    assert partial.device_costs.decode_32_ms == 40.0 and partial.device_costs.prefill_ms_per_token == 0.2
    assert SimExecutor.from_json(MEASURED, vocab_size=49152).vocab_size == 49152
    with pytest.raises(ValueError, match="unknown"):
        SimExecutor.from_json({"decode_64_ms": 1.0})
    with pytest.raises(ValueError, match="finite number"):
        SimExecutor.from_json({"decode_1_ms": "fast"})


def test_simulated_steps_take_the_measured_models_time():
    items = synthetic_workload(arrival_times(4.0, num_requests=40, seed=6), LengthMix.design(0.1), seed=6)
    sim = SimExecutor.from_json(MEASURED)
    res = simulate(items, design_config(), sim)
    assert all(r.completed for r in res.records)
    assert any(s.decode_context for s in res.steps) and any(s.prefill_pairs for s in res.steps)
    for s in res.steps:
        assert s.step_s == pytest.approx(sim.step_seconds(s.num_decode_rows, s.num_prefill_tokens,
                                                          s.decode_context, s.prefill_pairs), abs=1e-12)
    # Longer contexts cost more: the same workload with the context terms off runs faster.
    flat = SimExecutor.from_json({**MEASURED, "decode_ms_per_context_token": 0.0, "prefill_ms_per_kpair": 0.0})
    assert simulate(items, design_config(), flat).virtual_s < res.virtual_s
