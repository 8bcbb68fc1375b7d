"""EngineConfig.batching: each mode's defining property, on the real scheduler over SimExecutor.

* continuous (default): joins at every step, prefill in chunks of `prefill_token_budget` tokens.
* continuous_unchunked: joins at every step, a whole prompt prefilled in one step.
* static: waits for `max_rows` queued requests, then runs that batch with no joins until it ends.
* dynamic: as static, but also fires once the oldest request has waited `dynamic_window_s`.
"""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig
from tests.engine.sim import CAPS_ONLY, make_request, sim_engine


def _record(engine):
    plans = []
    engine.step_listeners.append(lambda plan, events, s: plans.append(plan) if not plan.empty else None)
    return plans


def test_default_is_continuous_and_unknown_modes_are_refused():
    assert EngineConfig().batching == "continuous" and EngineConfig().dynamic_window_s == 0.010
    with pytest.raises(ValueError, match="batching"):
        EngineConfig(batching="bulk")
    with pytest.raises(ValueError, match="dynamic_window_s"):
        EngineConfig(dynamic_window_s=-1.0)


def test_continuous_admits_a_newcomer_into_a_running_batch():
    engine, _ = sim_engine(max_rows=4, prefill_token_budget_few_rows=256)
    engine.submit(make_request(16, 50))
    engine.step()
    assert engine.scheduler.join_wait_s(0.0) == 0.0
    engine.submit(make_request(16, 5))
    plans = _record(engine)
    engine.step()
    assert plans[0].num_decode_rows == 1 and plans[0].num_prefill_tokens == 16


def test_continuous_unchunked_prefills_a_long_prompt_in_one_step_beside_decoding_rows():
    plans_by_mode = {}
    for mode in ("continuous", "continuous_unchunked"):
        # chunk 256 at any row count, nothing beyond it
        engine, _ = sim_engine(max_rows=8, few_rows=0, batching=mode, **CAPS_ONLY)
        engine.submit(make_request(10, 50))
        engine.step()
        engine.submit(make_request(3000, 5))
        plans = _record(engine)
        engine.step()
        plans_by_mode[mode] = plans[0]
    assert plans_by_mode["continuous"].num_prefill_tokens == 256
    unchunked = plans_by_mode["continuous_unchunked"]
    assert unchunked.num_decode_rows == 1 and unchunked.num_prefill_tokens == 3000
    # Still cut on the prefill_piece grid (batch invariance), just all pieces in one step.
    assert all(s.length == 64 for s in unchunked.segments if not s.decode and s.end < 3000)


def test_static_waits_for_a_full_batch_then_admits_no_one_until_it_ends():
    engine, clock = sim_engine(max_rows=4, batching="static", queue_budget_s=100.0)
    events = []
    first = [make_request(32, n, events=events) for n in (2, 3, 4)]
    for r in first:
        engine.submit(r)
    clock.now = 500.0                           # static has no timeout: three requests wait on
    assert not engine.step() and engine.scheduler.join_wait_s(clock.now) == math.inf
    last = make_request(32, 12, events=events)
    engine.submit(last)                         # the 4th fills the batch
    assert engine.scheduler.join_wait_s(clock.now) == 0.0
    plans = _record(engine)
    engine.step()
    assert len(engine.scheduler.running) == 4
    assert plans[0].num_prefill_tokens == 4 * 32         # whole prompts in one step
    late = [make_request(16, 2) for _ in range(4)]       # a full batch's worth arrives meanwhile
    for r in late:
        engine.submit(r)
    running_ids = set()
    while not last.finished:
        engine.step()
        running_ids |= {r.request_id for r in engine.scheduler.running}
    # Short rows left early, but nobody joined while the longest (12 tokens) still ran.
    assert running_ids <= {r.request_id for r in [*first, last]}
    assert all(r.finished for r in first) and all(not r.finished for r in late)
    assert [p.num_decode_rows for p in plans[1:4]] == [4, 3, 2]
    engine.step()                               # the batch ended: the next one forms at once
    assert {r.request_id for r in engine.scheduler.running} == {r.request_id for r in late}


def test_dynamic_fires_on_a_full_batch_or_when_the_oldest_has_waited_the_window():
    engine, clock = sim_engine(max_rows=4, batching="dynamic", dynamic_window_s=0.010, queue_budget_s=100.0)
    a = make_request(16, 20)
    engine.submit(a)                            # arrival_s = 0.0
    clock.now = 0.004
    assert not engine.step()
    assert engine.scheduler.join_wait_s(clock.now) == pytest.approx(0.006)
    clock.now = 0.010
    assert engine.step() and engine.scheduler.running == [a]        # fired by the window
    b = make_request(16, 2)
    clock.now = 0.5
    engine.submit(b)
    clock.now = 1.0                             # b has waited far past the window, but a runs
    engine.step()
    assert b not in engine.scheduler.running and engine.scheduler.join_wait_s(clock.now) == math.inf
    while not a.finished:
        engine.step()
    engine.step()
    assert b in engine.scheduler.running
    while not b.finished:
        engine.step()
    # A full batch does not wait for the window.
    clock.now = 2.0
    batch = [make_request(16, 2) for _ in range(4)]
    for r in batch:
        engine.submit(r)
    assert engine.scheduler.join_wait_s(clock.now) == 0.0
    engine.step()
    assert len(engine.scheduler.running) == 4
