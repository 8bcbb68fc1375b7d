"""The virtual-time driver: the real scheduler over SimExecutor, at the design's scale."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.sim_executor import SimExecutor
from loadgen.sim import design_config, simulate
from loadgen.stats import percentiles
from loadgen.workload import LengthMix, WorkItem, arrival_times, synthetic_workload, with_disconnects


def test_each_step_takes_the_sim_executors_modelled_time():
    items = synthetic_workload(arrival_times(3.0, num_requests=60, seed=1), LengthMix.design(0.25), seed=1)
    res = simulate(items)
    formula = SimExecutor()
    assert len(res.steps) > 100
    assert any(s.num_prefill_tokens and s.num_decode_rows for s in res.steps)
    for s in res.steps:
        assert s.step_s == pytest.approx(formula.step_seconds(s.num_decode_rows, s.num_prefill_tokens), abs=1e-12)
    # Back-to-back steps: each starts where the previous ended (no sleeping, no drift).
    starts = np.array([s.start_s for s in res.steps])
    ends = starts + np.array([s.step_s for s in res.steps])
    touching = np.isclose(starts[1:], ends[:-1], atol=1e-9)
    assert touching.mean() > 0.9 and np.all(starts[1:] >= ends[:-1] - 1e-9)
    # The design's anchors: 1 row 25 ms, 32 rows 40 ms, plus 0.1 ms per prefill token.
    assert formula.step_seconds(1, 0) == pytest.approx(0.025)
    assert formula.step_seconds(32, 256) == pytest.approx(0.0656)


def test_requests_get_their_lengths_and_blocks_all_come_back():
    items = synthetic_workload(arrival_times(1.0, num_requests=40, seed=2), LengthMix.design(0.5), seed=2)
    res = simulate(items)
    assert all(r.completed for r in res.records)
    assert [r.output_tokens for r in res.records] == [it.output_tokens for it in items]
    for r in res.records:
        assert 0 < r.ttft_s <= r.e2e_s and r.queue_s is not None and r.queue_s <= r.ttft_s
        assert r.output_tokens == 1 or r.tpot_s >= 0.025 - 1e-9    # a step is at least 25 ms
        assert r.max_gap_s is not None
    assert res.kv_blocks_free_end == res.config.num_blocks == 7152
    eng = res.engine_summary()
    assert eng["num_steps"] == len(res.steps) and 0 < eng["pool_use"]["max"] < 1


def test_alone_a_request_sees_exactly_the_cost_model():
    # 600-token prompt: chunks of 256, 256, 88 (first token after chunk 3), then 9 decode steps of 1 row.
    res = simulate([WorkItem(0, 5.0, "k", 600, 10)])
    r = res.records[0]
    assert r.ttft_s == pytest.approx(0.1 * 600 / 1000)        # prefill steps carry no decode row
    assert r.tpot_s == pytest.approx(0.025)
    assert r.queue_s == pytest.approx(0.0) and r.e2e_s == pytest.approx(0.060 + 9 * 0.025)


def test_queue_over_budget_is_a_429_and_retries_honour_retry_after():
    burst = [WorkItem(i, 0.0, "k", 6000, 1000) for i in range(40)]
    res = simulate(burst)
    statuses = [r.status for r in res.records]
    # 375 blocks each: 18 fit the 7,152-block pool beside its 358-block margin and wait for
    # nothing; each costs ≈ 600 + 300 × 1.25 = 975 ms of estimated device time, so 2 more may wait
    # within the 2 s budget.
    assert statuses.count(200) == 20 and statuses.count(429) == 20 and res.num_rejected == 20
    retried = simulate(burst, max_retries=200)
    assert all(r.completed for r in retried.records)
    assert max(r.retries for r in retried.records) > 0


def test_disconnects_stop_costing_at_the_next_step():
    items = with_disconnects(synthetic_workload(arrival_times(2.0, num_requests=50, seed=3),
                                                LengthMix.design(0.25), seed=3), 0.3, seed=3)
    res = simulate(items)
    gone = [(it, r) for it, r in zip(items, res.records) if it.disconnect_after is not None]
    assert len(gone) >= 8
    for it, r in gone:
        assert r.disconnected and r.output_tokens == it.disconnect_after and r.status == 200
    # The cancel flag is read at the next step boundary: no token is sampled after a disconnect.
    assert res.extra["tokens_after_disconnect"] == 0
    assert res.kv_blocks_free_end == 7152


def _fairness(max_retries: int) -> tuple[dict, dict, object]:
    """Key A: 100 long requests at t = 0. Key B: one short request per second for 60 s."""
    items = [WorkItem(i, 0.0, "A", 6000, 1000) for i in range(100)]
    items += [WorkItem(100 + j, float(j), "B", 100, 20) for j in range(60)]
    res = simulate(items, design_config(), max_retries=max_retries)
    out = {}
    for key in "AB":
        recs = [r for r in res.records if r.api_key == key]
        p = percentiles(r.ttft_s for r in recs)          # over requests that got a first token
        out[key] = {"sent": len(recs), "completed": sum(r.completed for r in recs),
                    "429": sum(r.status == 429 for r in recs), "retries": sum(r.retries for r in recs),
                    "p50": p["p50"], "p95": p["p95"]}
        print(f"\n  retries<={max_retries} key {key}: completed {out[key]['completed']}/{len(recs)}, "
              f"429s {out[key]['429']}, retries {out[key]['retries']}, "
              f"TTFT p50 {p['p50']:.3f} s, p95 {p['p95']:.3f} s (from first arrival)", end="")
    return out["A"], out["B"], res


def test_fairness_long_burst_against_a_short_stream():
    """The design's fairness test, open loop: a 429 is final (no client retries)."""
    a, b, res = _fairness(max_retries=0)
    assert b["completed"] == b["sent"] and b["p95"] < 1.0
    assert a["completed"] >= 1
    # Admission control takes the burst: the 18 that have blocks and 2 more (2 device-seconds may
    # wait) are queued, A's other 80 are 429s, so this run says little about fair queueing itself;
    # see the retrying variant below.
    assert a["429"] == 80 and b["429"] == 0
    assert res.kv_blocks_free_end == 7152


def test_fairness_when_the_long_key_retries_its_429s():
    """Same scenario, but A retries each 429 after Retry-After (up to 100 times), as clients do."""
    a, b, _ = _fairness(max_retries=100)
    assert a["completed"] >= 1
    assert b["completed"] == b["sent"] and b["p95"] < 1.0


def test_an_hour_at_the_design_rate_is_fast(capsys):
    """Not the hour itself (tests stay fast): 2 virtual minutes, scaled to an hour in the report."""
    items = synthetic_workload(arrival_times(1.5, duration_s=120, seed=4), LengthMix.design(), seed=4)
    res = simulate(items)
    assert res.virtual_s >= 120 and all(r.status in (200, 429) for r in res.records)
    with capsys.disabled():
        print(f"\n  sim: {res.virtual_s:.0f} virtual s at 1.5 req/s in {res.wall_s:.2f} s wall "
              f"(≈ {res.wall_s * 3600 / res.virtual_s:.0f} s per simulated hour)")
    assert res.wall_s * 3600 / res.virtual_s < 60


def test_batching_modes_in_virtual_time():
    """Static waits for full batches (a last partial batch never runs); dynamic jumps its window."""
    items = synthetic_workload(arrival_times(2.0, num_requests=70, seed=5, process="constant"),
                               LengthMix.design(0.1), seed=5)
    out = {}
    for mode in ("continuous", "continuous_unchunked", "static", "dynamic"):
        res = simulate(items, design_config(batching=mode, max_rows=32, queue_budget_s=100.0))
        out[mode] = res
        done = sum(r.completed for r in res.records)
        if mode == "static":
            assert done == 64 and sum(r.status == 0 for r in res.records) == 6   # 2 batches of 32
        else:
            assert done == 70 and res.kv_blocks_free_end == 7152
    # Static holds the first request until the 32nd arrives (31 gaps of 0.5 s).
    assert out["static"].records[0].queue_s == pytest.approx(15.5)
    # Dynamic fires 10 ms after a lone arrival: the first request waits exactly the window.
    assert out["dynamic"].records[0].queue_s == pytest.approx(0.010)
    # Unchunked prefill puts each whole prompt into one step: at most one prefill step per request.
    assert sum(1 for s in out["continuous_unchunked"].steps if s.num_prefill_tokens) <= len(items)
    assert max(s.num_prefill_tokens for s in out["continuous_unchunked"].steps) >= max(
        it.prompt_tokens for it in items)


def test_submit_delay_moves_the_engine_arrival_but_not_the_clients():
    alone = simulate([WorkItem(0, 5.0, "k", 600, 10)], submit_delay_s=0.040)
    r = alone.records[0]
    assert r.ttft_s == pytest.approx(0.040 + 0.060)           # path latency + 600 × 0.1 ms prefill
    assert r.tpot_s == pytest.approx(0.025) and r.queue_s == pytest.approx(0.0)
