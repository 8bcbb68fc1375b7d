"""Scheduler snapshots (engine/core/snapshot.py) over the real scheduler with the simulated executor:
rows, queues per key, the block map, the step split and the latency window."""

from __future__ import annotations

from engine.core.snapshot import (BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED, LATENCY_WINDOW_S,
                             LatencySummary, SnapshotSource, read_scheduler)
from engine.core.plan import Segment, StepPlan
from tests.engine.sim import make_request, sim_engine


def test_idle_engine():
    engine, _ = sim_engine(num_blocks=32)
    snap = SnapshotSource(engine).snapshot()
    st = snap.state
    assert (st.running_rows, st.prefill_rows, st.queues, st.steps) == (0, 0, (), 0)
    assert st.kv_block_states == bytes([BLOCK_FREE]) * 32 and st.kv_blocks_free == 32
    assert st.kv_blocks_cached == 0
    assert st.queue_budget_s == engine.config.queue_budget_s and st.max_rows == engine.config.max_rows
    assert snap.steps == () and snap.ttft.count == 0 and snap.window_s == LATENCY_WINDOW_S


def test_rows_queues_and_blocks_while_requests_run():
    engine, clock = sim_engine(num_blocks=64, max_rows=2)
    source = SnapshotSource(engine)
    a1, a2 = make_request(40, 30, api_key="a"), make_request(40, 30, api_key="a")
    b1 = make_request(20, 30, api_key="b")
    for req in (a1, a2, b1):
        engine.submit(req)
    st = source.snapshot().state
    assert {q.key: (q.queued, q.running) for q in st.queues} == {"a": (2, 0), "b": (1, 0)}
    assert st.queued_device_s > 0
    engine.step()                       # two rows join (the row cap), both prefill their prompts
    clock.now += 0.05
    engine.step()                       # both decode now
    st = source.snapshot().state
    assert st.running_rows == 2 and st.prefill_rows == 0 and st.steps == 2
    assert sum(q.queued for q in st.queues) == 1 and sum(q.running for q in st.queues) == 2
    # The block map agrees with the pool, block by block.
    pool = engine.pool
    for block, state in enumerate(st.kv_block_states):
        assert state == min(pool.ref_count(block), BLOCK_SHARED)
    held = sum(1 for s in st.kv_block_states if s != BLOCK_FREE)
    assert held == 64 - st.kv_blocks_free == len(pool.table(a1.request_id)) + len(
        pool.table(a2.request_id) or pool.table(b1.request_id))
    assert BLOCK_USED in st.kv_block_states


def test_n_samples_share_prompt_blocks():
    engine, _ = sim_engine(num_blocks=64)
    source = SnapshotSource(engine)
    req = make_request(64, 20)
    req.fork(3, [1, 2, 3])
    engine.submit(req)
    for _ in range(3):
        engine.step()
    st = source.snapshot().state
    assert st.running_rows == 3
    assert st.kv_block_states.count(bytes([BLOCK_SHARED])) >= 4    # the 64-token prompt: 4 blocks, shared


def test_cached_blocks_are_their_own_state_and_not_free():
    engine, _ = sim_engine(num_blocks=64, prefix_caching=True)
    engine.submit(make_request(150, 2))                  # two whole pieces: 8 blocks stay cached
    engine.run_until_idle()
    st = read_scheduler(engine.scheduler, engine.num_steps)
    assert st.kv_block_states.count(bytes([BLOCK_CACHED])) == 8 == st.kv_blocks_cached
    assert st.kv_blocks_free == 64 - 8
    assert sorted(i for i, s in enumerate(st.kv_block_states) if s == BLOCK_CACHED) == \
        sorted(engine.pool.cached_unused_blocks())


def test_step_time_is_split_by_the_cost_model():
    engine, _ = sim_engine(num_blocks=64)
    source = SnapshotSource(engine)
    cost = engine.scheduler.cost
    req = make_request(10, 5)
    plan = StepPlan(segments=[Segment(req, 10, 1, True, (), decode=True), Segment(req, 0, 100, True, ())])
    source.history.on_step(plan, [], 0.2)
    [record] = source.history.steps()
    decode_est, prefill_est = 1 * cost.decode_ms_per_token, 100 * cost.prefill_ms_per_token
    assert record.decode_rows == 1 and record.prefill_tokens == 100
    assert abs(record.decode_ms + record.prefill_ms - 200.0) < 1e-9
    assert abs(record.decode_ms / record.prefill_ms - decode_est / prefill_est) < 1e-9
    source.history.on_step(StepPlan(), [], 0.0)          # an empty pass is not a step
    assert len(source.history.steps()) == 1


def test_latencies_cover_the_last_minute_only():
    engine, clock = sim_engine(num_blocks=128)
    source = SnapshotSource(engine)
    for _ in range(2):
        engine.submit(make_request(16, 3))
    while engine.scheduler.has_work:
        clock.now += 0.1
        engine.step()
    snap = source.snapshot()
    assert snap.ttft.count == 2 and snap.tpot.count == 2 and snap.max_gap.count == 2
    assert snap.ttft.p50_ms > 0 and snap.ttft.max_ms >= snap.ttft.p95_ms >= snap.ttft.p50_ms
    clock.now += LATENCY_WINDOW_S + 1
    assert source.snapshot().ttft.count == 0


def test_latency_summary_nearest_rank():
    s = LatencySummary.of([5.0, 1.0, 3.0, 2.0, 4.0] * 4)        # 20 values
    assert (s.count, s.p50_ms, s.p95_ms, s.max_ms) == (20, 3.0, 5.0, 5.0)
    assert LatencySummary.of([7.0]) == LatencySummary(1, 7.0, 7.0, 7.0)
    assert LatencySummary.of([]) == LatencySummary(0, 0.0, 0.0, 0.0)
