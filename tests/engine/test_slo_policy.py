"""SLO-driven steps (`policy="slo"`): rows and prefill sized by the cost model, against the fixed caps."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.core.sched.admission import AdmissionRejected
from engine.core.sim_executor import SimExecutor
from loadgen.sim import design_config, simulate
from loadgen.workload import LengthMix, arrival_times, synthetic_workload
from tests.engine.sim import make_request, sim_engine


def _plans(engine):
    plans = []
    engine.step_listeners.append(lambda plan, events, s: plans.append(plan) if not plan.empty else None)
    return plans


def _ms(engine, plan) -> float:
    return engine.scheduler.cost.step_ms(plan.features())


def test_fixed_is_the_default_and_keeps_the_design_caps():
    assert EngineConfig().policy == "fixed"
    engine, _ = sim_engine(num_blocks=2048)
    plans = _plans(engine)
    for _ in range(40):
        engine.submit(make_request(64, 20))
    engine.run_until_idle()
    assert max(p.num_decode_rows for p in plans) == 32


def test_slo_adds_rows_while_the_decode_step_leaves_the_prefill_share():
    # Design costs: decode(B) = 25 + 15 (B - 1) / 31 ms; a new row joins while it stays within
    # 70 ms × (1 - 0.2) = 56 ms, i.e. B <= 65.
    engine, _ = sim_engine(num_blocks=2048, policy="slo")
    plans = _plans(engine)
    for _ in range(80):
        engine.submit(make_request(64, 20))
    engine.run_until_idle()
    assert max(p.num_decode_rows for p in plans) == 65
    assert all(_ms(engine, p) <= 100.0 + 1e-9 for p in plans)
    engine.pool.check_all_free()


def test_slo_prefill_budget_is_the_time_left_in_the_step():
    engine, clock = sim_engine(policy="slo")
    engine.submit(make_request(10, 50))
    engine.step()                                   # prefilled alone: its first token
    clock.now = engine.scheduler.running[0].last_token_s
    engine.submit(make_request(2000, 5))
    plans = _plans(engine)
    engine.step()
    # The row's first gap may take 70 ms: 25 ms of decode + 7 pieces of 64 (44.8 ms); an 8th is over.
    assert plans[0].num_decode_rows == 1
    assert [g.length for g in plans[0].segments if not g.decode] == [64] * 7
    assert _ms(engine, plans[0]) == pytest.approx(69.8)


def test_slo_steps_stretch_to_the_gap_target_when_every_row_has_slack():
    engine, clock = sim_engine(policy="slo")
    engine.submit(make_request(10, 200))
    for _ in range(21):                             # 20 decode steps of 25 ms: 900 ms of slack
        engine.step()
        clock.now += 0.025
    row = engine.scheduler.running[0]
    clock.now = row.last_token_s
    engine.submit(make_request(2000, 5))
    plans = _plans(engine)
    engine.step()
    # Limited by the 100 ms gap target now: 25 ms + 11 pieces (70.4 ms); a 12th would make 101.8.
    assert [g.length for g in plans[0].segments if not g.decode] == [64] * 11
    assert _ms(engine, plans[0]) == pytest.approx(95.4)


@pytest.mark.parametrize("policy", ["fixed", "slo"])
def test_prompts_are_cut_on_the_64_token_grid_under_both_policies(policy):
    engine, _ = sim_engine(policy=policy, prefill_token_budget_few_rows=256)
    engine.submit(make_request(10, 100))
    engine.step()
    long = make_request(1000, 3)
    engine.submit(long)
    plans = _plans(engine)
    engine.run_until_idle()
    pieces = [(g.start, g.end) for p in plans for g in p.segments if g.request is long and not g.decode]
    assert [s for s, _ in pieces] == list(range(0, 1000, 64))
    assert pieces[-1] == (960, 1000)


def test_slo_run_meets_tpot_and_gap_for_every_request_with_an_exact_model():
    items = synthetic_workload(arrival_times(2.0, duration_s=60.0, seed=3), LengthMix.design(), seed=3)
    res = simulate(items, design_config(policy="slo"))
    done = [r for r in res.records if r.completed]
    assert len(done) > 0.9 * len(items)
    assert max(r.tpot_s for r in done if r.tpot_s is not None) <= 0.070 + 1e-9
    assert max(r.max_gap_s for r in done) <= 0.100 + 1e-9
    assert max(s.num_decode_rows for s in res.steps) > 32      # more rows than the fixed cap
    fixed = simulate(items, design_config())
    assert max(r.max_gap_s for r in fixed.records if r.completed) > 0.100   # 25 + 102.4 ms steps


def test_slo_admission_estimates_with_the_rows_the_target_allows():
    fixed, _ = sim_engine(queue_budget_s=2.0)
    slo, _ = sim_engine(queue_budget_s=2.0, policy="slo")
    a, b = make_request(1000, 100), make_request(1000, 100)
    fixed.submit(a)
    slo.submit(b)
    # Fixed: 1000 × 0.1 + 100 × 40 / 32 = 225 ms. SLO: at the design's averages (1,250-token
    # prompts, 300-token answers) a row brings 125 / 300 ms of prefill to each step; 50 rows fit
    # in 70 ms (25 + 15 × 49 / 31 + 50 × 125 / 300 = 69.5; 51 give 70.4), so a token's share of
    # a step is (25 + 15 × 49 / 31) / 50 ms.
    assert a.est_device_ms == pytest.approx(225.0)
    assert slo.scheduler.full_rows() == 50
    assert b.est_device_ms == pytest.approx(100.0 + 100 * (25 + 15 * 49 / 31) / 50)
    with pytest.raises(AdmissionRejected):
        for _ in range(40):
            slo.submit(make_request(1000, 100))


def test_other_batching_modes_keep_the_caps_under_the_slo_policy():
    engine, _ = sim_engine(num_blocks=2048, policy="slo", batching="continuous_unchunked")
    plans = _plans(engine)
    for _ in range(40):
        engine.submit(make_request(64, 5))
    engine.run_until_idle()
    assert max(p.num_decode_rows for p in plans) == 32


def test_config_rejects_unknown_policies_and_bad_targets():
    with pytest.raises(ValueError, match="policy must be one of"):
        EngineConfig(policy="fast")
    with pytest.raises(ValueError, match="gap_target_ms"):
        EngineConfig(tpot_target_ms=70.0, gap_target_ms=50.0)
    with pytest.raises(ValueError, match="slo_prefill_share"):
        EngineConfig(slo_prefill_share=1.0)


def test_slo_rows_do_not_collapse_where_one_prefill_piece_takes_half_the_target():
    # Step costs fitted on this CPU (a step of any rows costs ≥ 31 ms; a 64-token piece ≈ 33 ms) at
    # targets of 64.5 / 92.2 ms. Rows that had to leave a whole piece inside the TPOT target ran
    # at most 2 rows: the queue grew without bound (TTFT p50 ≈ 40 s, 9 of 215 requests unfinished).
    # Rows leave their steady-state prefill inside the target and one piece inside the gap target.
    live = dict(step_base_ms=10.26, decode_1_ms=20.91, decode_32_ms=24.90, prefill_ms_per_token=0.502,
                decode_ms_per_context_token=0.00201, prefill_ms_per_kpair=0.456)
    items = synthetic_workload(arrival_times(4.0, duration_s=60.0, seed=0), LengthMix.design(0.064), seed=0)
    cfg = EngineConfig(num_blocks=4096, policy="slo", tpot_target_ms=64.5, gap_target_ms=92.2, queue_budget_s=60.0,
                       prefix_caching=False)       # as the simulator ran it: the synthetic prompts repeat one token
    res = simulate(items, cfg, SimExecutor(**live))
    done = [r for r in res.records if r.completed]
    assert len(done) == len(items)
    assert max(s.num_decode_rows for s in res.steps) == 8
    assert max(r.tpot_s for r in done if r.tpot_s is not None) <= 0.0645
    assert max(r.max_gap_s for r in done) <= 0.0922
    fixed = simulate(items, replace(cfg, policy="fixed"), SimExecutor(**live))
    assert statistics.median(r.ttft_s for r in done) < 1.1 * statistics.median(r.ttft_s for r in fixed.records)
