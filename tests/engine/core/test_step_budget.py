"""The step budget (`StepBudget`): the design's caps, and prefill beyond them in the time the
decoding rows can spare under the TPOT and gap targets. Costs are the design's (`CostModel()`:
25 ms for 1 decode row, 40 ms for 32, 0.1 ms a prompt token)."""

from __future__ import annotations

import statistics

import pytest

from engine.config import EngineConfig
from loadgen.sim import design_config, simulate
from loadgen.workload import LengthMix, arrival_times, synthetic_workload
from tests.engine.sim import CAPS_ONLY, make_request, sim_engine


def _plans(engine):
    plans = []
    engine.step_listeners.append(lambda plan, events, s: plans.append(plan) if not plan.empty else None)
    return plans


def _ms(engine, plan) -> float:
    return engine.scheduler.cost.step_ms(plan.features())


def test_rows_stop_at_the_row_cap():
    engine, _ = sim_engine(num_blocks=2048)
    plans = _plans(engine)
    for _ in range(40):
        engine.submit(make_request(64, 20))
    engine.run_until_idle()
    assert max(p.num_decode_rows for p in plans) == 32
    engine.pool.check_all_free()


def _step_after_first_token(decode_steps: int, **config):
    """One row that has decoded `decode_steps` steps of 25 ms, then a 2,000-token prompt
    arrives at its last token: the plan of the next step."""
    engine, clock = sim_engine(prefill_token_budget_few_rows=256, **config)
    engine.submit(make_request(10, 200))
    for _ in range(decode_steps + 1):
        engine.step()
        clock.now += 0.025
    clock.now = engine.scheduler.running[0].stats.last_token_s
    engine.submit(make_request(2000, 5))
    plans = _plans(engine)
    engine.step()
    return engine, plans[0]


def test_prefill_beyond_the_caps_fills_the_time_the_row_can_spare():
    # The row has just had its first token: its next may come 70 ms later (the TPOT target):
    # 25 ms of decode + 7 pieces of 64 (44.8 ms); an 8th would make 77.2.
    engine, plan = _step_after_first_token(0)
    assert plan.num_decode_rows == 1
    assert [g.length for g in plan.segments if not g.decode] == [64] * 7
    assert _ms(engine, plan) == pytest.approx(69.8)
    # With targets no step meets, the design's 256-token cap alone.
    _, caps = _step_after_first_token(0, **CAPS_ONLY)
    assert caps.num_prefill_tokens == 256


def test_steps_stretch_to_the_gap_target_when_the_row_has_banked_time():
    # 20 decode steps of 25 ms against a 70 ms pace: 900 ms banked, so a 100 ms gap target
    # limits: 25 ms + 11 pieces (70.4 ms); a 12th would make 101.8.
    engine, plan = _step_after_first_token(20, gap_target_ms=100.0)
    assert [g.length for g in plan.segments if not g.decode] == [64] * 11
    assert _ms(engine, plan) == pytest.approx(95.4)
    # A longer gap target lets the same step take more of the bank: 25 + 0.1 x 1,472 = 172.2 ms.
    engine, plan = _step_after_first_token(20, gap_target_ms=175.0)
    assert plan.num_prefill_tokens == 1472 and _ms(engine, plan) == pytest.approx(172.2)


@pytest.mark.parametrize("targets", [{}, CAPS_ONLY], ids=["default", "caps"])
def test_prompts_are_cut_on_the_64_token_grid_whatever_the_budget(targets):
    engine, _ = sim_engine(prefill_token_budget_few_rows=256, **targets)
    engine.submit(make_request(10, 100))
    engine.step()
    long = make_request(1000, 3)
    engine.submit(long)
    plans = _plans(engine)
    engine.run_until_idle()
    pieces = [(g.start, g.end) for p in plans for g in p.segments if g.request is long and not g.decode]
    assert [s for s, _ in pieces] == list(range(0, 1000, 64))
    assert pieces[-1] == (960, 1000)


def test_design_load_gets_earlier_first_tokens_and_keeps_the_tpot_target():
    # The design's load test at 2 req/s on the design's costs (the simulator's exact model): the
    # time the rows bank below 70 ms a token goes to prompts, so first tokens come sooner than
    # under the caps alone, and no stream's time per output token passes the target (the caps'
    # own steps are at most 25 + 15 + 25.6 = 65.6 ms at 32 rows).
    items = synthetic_workload(arrival_times(2.0, duration_s=60.0, seed=3), LengthMix.design(), seed=3)
    paced = simulate(items, design_config())
    caps = simulate(items, design_config(**CAPS_ONLY))
    done = [r for r in paced.records if r.completed]
    assert len(done) == len(items) == len([r for r in caps.records if r.completed])
    assert max(r.tpot_s for r in done if r.tpot_s is not None) <= 0.070 + 1e-9
    ttft_paced = statistics.quantiles([r.ttft_s for r in done], n=20)[18]
    ttft_caps = statistics.quantiles([r.ttft_s for r in caps.records], n=20)[18]
    assert ttft_paced < 0.9 * ttft_caps, (ttft_paced, ttft_caps)
    # beyond the 256-token cap while many rows decode: the time they banked
    assert any(s.num_prefill_tokens > 256 and s.num_decode_rows > 4 for s in paced.steps)
    assert not any(s.num_prefill_tokens > 256 and s.num_decode_rows > 4 for s in caps.steps)


def test_config_rejects_a_gap_target_below_the_tpot_target():
    with pytest.raises(ValueError, match="gap_target_ms"):
        EngineConfig(tpot_target_ms=70.0, gap_target_ms=50.0)
    with pytest.raises(ValueError, match="tpot_target_ms"):
        EngineConfig(tpot_target_ms=0.0)


def test_prefill_order_is_shortest_first_until_a_prompt_has_prefilled_twice_the_budget():
    """`prefill_tiebreak` at now = 10 s with a 1 s queue budget (aged after 2 s in the batch):
    prompts in the batch for 2 s or more first, earliest joined first whatever their length;
    then the rest by tokens left. Time spent queued before joining does not count."""
    from engine.core.sched.step_budget import StepBudget

    budget = StepBudget(EngineConfig(queue_budget_s=1.0), chunked_prefill=True)
    now = 10.0

    def prompt(tokens_left: int, joined_s: float, arrival_s: float = 0.0):
        req = make_request(tokens_left, 5)
        req.stats.arrival_s, req.joined_s = arrival_s, joined_s
        return req

    older_aged = prompt(1800, joined_s=7.0)
    newer_aged = prompt(900, joined_s=8.0)           # exactly 2 s in the batch: aged
    short = prompt(100, joined_s=9.5)
    long_queued = prompt(1500, joined_s=8.5, arrival_s=0.0)   # queued 8.5 s, in the batch 1.5 s
    order = sorted([short, long_queued, newer_aged, older_aged],
                   key=lambda r: budget.prefill_tiebreak(r, now))
    assert order == [older_aged, newer_aged, short, long_queued]
    assert budget.prefill_tiebreak(older_aged, now) == (0, 7.0)
    assert budget.prefill_tiebreak(long_queued, now) == (1, 1500)
