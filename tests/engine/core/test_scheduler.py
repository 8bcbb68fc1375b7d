"""Scheduler policy on the SimExecutor: chunked prefill, leave/join, blocks, cancel, preemption."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.core.outputs import FinishReason
from engine.core.plan import Lifecycle
from engine.core.sched.admission import AdmissionRejected, row_free_ms
from engine.core.sched.step_budget import AGED_AFTER_BUDGETS
from tests.engine.sim import CAPS_ONLY, make_request, sim_engine


def test_long_prompt_is_chunked_while_other_rows_decode():
    # a 256-token budget at any row count, nothing beyond it
    engine, _ = sim_engine(prefill_token_budget_few_rows=256, **CAPS_ONLY)
    ev_short, ev_long = [], []
    engine.submit(make_request(10, 50, events=ev_short))
    engine.step()                                   # short prompt prefilled, first token
    engine.submit(make_request(1000, 5, events=ev_long))
    plans = []
    engine.step_listeners.append(lambda plan, events, s: plans.append(plan))
    for _ in range(4):
        engine.step()
    # Every one of the 4 steps carries the decoding row plus <= 256 prompt tokens.
    assert [p.num_decode_rows for p in plans] == [1, 1, 1, 1]
    assert [p.num_prefill_tokens for p in plans] == [256, 256, 256, 232]
    assert len(ev_long) == 1 and ev_long[0].token_id is not None   # first token after chunk 4
    assert len(ev_short) == 5


def test_prefill_budget_rises_when_few_rows_decode():
    engine, _ = sim_engine()                        # few_rows 4 → 1,024-token budget
    engine.submit(make_request(10, 50))
    engine.step()
    engine.submit(make_request(1000, 5))
    plans = []
    engine.step_listeners.append(lambda plan, events, s: plans.append(plan))
    engine.step()
    assert plans[0].num_decode_rows == 1 and plans[0].num_prefill_tokens == 1000
    # Pieces stay on the 64-token grid: 15 whole pieces and a 40-token tail.
    assert [g.length for g in plans[0].segments if not g.decode] == [64] * 15 + [40]


def test_short_prompt_of_a_light_key_prefills_before_a_heavy_keys_long_prompt():
    engine, _ = sim_engine(prefill_token_budget_few_rows=256, **CAPS_ONLY)
    engine.submit(make_request(4000, 5, api_key="a"))
    engine.step()
    engine.submit(make_request(100, 5, api_key="b"))
    plans = []
    engine.step_listeners.append(lambda plan, events, s: plans.append(plan))
    engine.step()
    b_tokens = sum(g.length for g in plans[0].segments if g.request.api_key == "b")
    a_tokens = sum(g.length for g in plans[0].segments if g.request.api_key == "a")
    assert b_tokens == 100 and a_tokens == 128    # b's whole prompt, a fills the rest of 256


def test_one_keys_prompts_prefill_shortest_remaining_first():
    """Within one key, the step's prefill goes to the prompt with the fewest tokens left: a
    started prompt finishes before a newer one of the same length starts, and a short newcomer
    goes before a long prompt's rest."""
    # a 256-token budget at any row count, nothing beyond it
    engine, _ = sim_engine(prefill_token_budget_few_rows=256, **CAPS_ONLY)
    first = make_request(512, 5)
    engine.submit(first)
    engine.step()                                    # 256 of its 512 tokens
    second, short = make_request(512, 5), make_request(64, 5)
    engine.submit(second)
    engine.submit(short)
    plans = []
    engine.step_listeners.append(lambda plan, events, s: plans.append(plan))
    engine.step()
    tokens = {id(r): sum(g.length for g in plans[0].segments if g.request is r and not g.decode)
              for r in (first, second, short)}
    # short (64 left), then first (256 left) up to the budget; second (512 left) waits
    assert (tokens[id(short)], tokens[id(first)], tokens[id(second)]) == (64, 192, 0)
    engine.step()
    assert first.num_computed == first.num_prompt          # first's prompt done before second's


def test_a_prompt_passed_over_for_twice_the_queue_budget_goes_ahead_of_newer_ones():
    """Shortest remaining prefill first, until a prompt has been in the batch `AGED_AFTER_BUDGETS`
    queue budgets (here 2 × 1 s): from then on it goes ahead of every later prompt, however short."""
    engine, clock = sim_engine(prefill_token_budget_few_rows=256, queue_budget_s=1.0, **CAPS_ONLY)
    assert engine.scheduler.budget.aged_after_s() == AGED_AFTER_BUDGETS * 1.0 == 2.0
    long = make_request(1000, 5)
    engine.submit(long)
    engine.step()                                    # 256 of its 1,000 tokens
    plans = []
    engine.step_listeners.append(lambda plan, events, s: plans.append(plan))

    def prefilled(*reqs) -> tuple[int, ...]:
        return tuple(sum(g.length for g in plans[-1].segments if g.request is r and not g.decode)
                     for r in reqs)

    clock.now = 1.9                                  # in the batch 1.9 s: a newcomer still goes first
    early = make_request(200, 5)
    engine.submit(early)
    engine.step()
    assert prefilled(early, long) == (200, 0)       # long's next 64-token piece would pass 256
    clock.now = 2.0                                  # in the batch 2 s: ahead of the next newcomer
    late = make_request(200, 5)
    engine.submit(late)
    engine.step()
    assert prefilled(long, late) == (256, 0)
    engine.run_until_idle()
    engine.pool.check_all_free()


def test_prompts_that_will_go_first_by_age_count_against_the_queue_budget():
    # Five 6,000-token prompts are prefilling: 2.9 s of prefill left at the sim's 0.1 ms a token.
    # A 100-token prompt goes ahead of them (fewest tokens left first), so nothing counts against
    # it, until they have been in the batch twice the 2 s budget: then they go first and it is
    # refused.
    engine, clock = sim_engine(num_blocks=4096, queue_budget_s=2.0)
    for _ in range(5):
        engine.submit(make_request(6000, 10))
    engine.step()
    clock.now = 3.9
    engine.submit(make_request(100, 10))
    clock.now = 4.0
    left = sum(r.num_prompt - r.num_computed for r in engine.scheduler.running
               if r.num_prompt == 6000)
    with pytest.raises(AdmissionRejected) as refused:
        engine.submit(make_request(100, 10))
    assert f"{left * 0.1 / 1000:.2f} s of running prompts not yet prefilled" in str(refused.value)
    # Only the key's own aged prompts count: another key's request sees none of them.
    other = make_request(100, 10, api_key="b")
    other.stats.arrival_s = clock.now
    scheduler = engine.scheduler
    assert scheduler.admission.prefill_backlog_ms(other, scheduler.running, scheduler.cost.prefill_ms,
                                                  scheduler.budget.is_aged) == (0.0, 0.0)
    engine.run_until_idle()
    engine.pool.check_all_free()


def test_over_cap_key_is_preempted_when_another_key_waits_for_room():
    engine, _ = sim_engine(max_rows=12, queue_budget_s=100.0)
    for _ in range(12):
        engine.submit(make_request(20, 200, api_key="a"))
    engine.step()
    assert engine.scheduler.queue.usage["a"].running_rows == 12
    engine.submit(make_request(20, 5, api_key="b"))
    engine.step()
    assert engine.scheduler.queue.usage["b"].running_rows == 1
    assert engine.scheduler.queue.usage["a"].running_rows == 11
    assert engine.scheduler.num_preemptions == 1


def test_one_keys_backlog_does_not_429_another_key():
    engine, _ = sim_engine(queue_budget_s=2.0, max_rows=1)
    # a holds the only row: its own requests also count the wait for that row, 9 × 25 ms after
    # the first step, and each one queued ahead adds a round of it (the same 225 ms as its work)
    engine.submit(make_request(1000, 10, api_key="a"))
    engine.step()                                              # runs
    for _ in range(8):
        engine.submit(make_request(1000, 100, api_key="a"))    # 8 × 225 ms queued
    with pytest.raises(AdmissionRejected):
        engine.submit(make_request(1000, 100, api_key="a"))
    engine.submit(make_request(1000, 100, api_key="b"))        # b's share: 2 s / 2 keys
    with pytest.raises(AdmissionRejected):
        for _ in range(5):
            engine.submit(make_request(1000, 100, api_key="b"))


def test_every_block_returns_after_mixed_run_with_cancels():
    engine, _ = sim_engine(num_blocks=400)
    events = []
    reqs = [make_request(17 * (i + 1), 3 + 7 * i, events=events) for i in range(12)]
    for r in reqs:
        engine.submit(r)
    for _ in range(5):
        engine.step()
    engine.cancel(reqs[3].request_id)
    engine.cancel(reqs[11].request_id)
    engine.run_until_idle()
    engine.pool.check_all_free()
    assert engine.pool.num_free == 400
    finals = {e.request_id: e.finish_reason for e in events if e.finish_reason}
    assert len(finals) == 12
    assert finals[reqs[3].request_id] == FinishReason.CANCELLED
    assert finals[reqs[0].request_id] == FinishReason.LENGTH


def test_cancelled_row_is_in_at_most_one_more_step():
    engine, _ = sim_engine()
    events = []
    req = make_request(20, 500, events=events)
    engine.submit(req)
    for _ in range(3):
        engine.step()
    seen_after_cancel = []
    engine.step_listeners.append(
        lambda plan, ev, s: seen_after_cancel.append(any(g.request is req for g in plan.segments)))
    engine.cancel(req.request_id)
    engine.step()
    engine.step()
    assert seen_after_cancel.count(True) == 0       # flagged between steps: no further step
    assert events[-1].finish_reason == FinishReason.CANCELLED
    assert engine.pool.num_free == engine.pool.num_blocks


def test_preemption_frees_newest_and_request_still_completes():
    # 24 blocks of 16 tokens; four requests of 64-token prompts growing by 120 tokens each
    # cannot all fit, so the newest is preempted, re-queued, and finishes later.
    engine, _ = sim_engine(num_blocks=24, free_margin=0.0)
    events = []
    lifecycle = []          # each step's plan lists its admissions and preemptions, in order
    engine.step_listeners.append(lambda plan, ev, s: lifecycle.extend((e.request, e.kind) for e in plan.lifecycle))
    reqs = [make_request(64, 120, events=events) for _ in range(4)]
    for r in reqs:
        engine.submit(r)
    engine.run_until_idle()
    assert engine.scheduler.num_preemptions > 0
    preempted = [r for r, kind in lifecycle if kind is Lifecycle.PREEMPTED]
    assert len(preempted) == engine.scheduler.num_preemptions
    for r in reqs:
        kinds = [kind for q, kind in lifecycle if q is r]
        assert kinds[0] is Lifecycle.ADMITTED and Lifecycle.ADMITTED not in kinds[1:]
        # preempted and readmitted alternate after the first admission
        assert kinds[1:] == [Lifecycle.PREEMPTED, Lifecycle.READMITTED] * (len(kinds[1:]) // 2)
    done = [e for e in events if e.finish_reason]
    assert sorted(e.num_completion_tokens for e in done) == [120] * 4
    # Streams never repeat or skip a position, even across preemption.
    for r in reqs:
        positions = [e.position for e in events if e.request_id == r.request_id]
        assert positions == list(range(120))
    engine.pool.check_all_free()


def test_admission_rejects_past_budget_with_retry_after():
    engine, _ = sim_engine(queue_budget_s=2.0)
    # Each request: 1000 prompt × 0.1 ms + min(100, 300) × 1.25 ms = 225 ms of device time.
    # 63 blocks each: 7 fit the 512-block pool beside its 26-block margin and wait for nothing;
    # the 8th on waits for blocks.
    admitted, rejected = 0, []
    for _ in range(20):
        try:
            engine.submit(make_request(1000, 100))
            admitted += 1
        except AdmissionRejected as exc:
            rejected.append(exc.retry_after_s)
    assert admitted == 7 + 8          # 8 × 225 ms = 1.8 s would wait; a 9th would make 2.025 s
    assert rejected and min(rejected) >= 1
    assert engine.stats().queued_device_s == pytest.approx(15 * 0.225)   # the gauge: all queued work


def test_fewest_weighted_tokens_key_is_admitted_first():
    engine, _ = sim_engine(max_rows=1)
    order = []
    for key in ["a", "a", "a"]:
        engine.submit(make_request(16, 4, api_key=key))
    engine.step()                                   # a's first request runs
    engine.submit(make_request(16, 4, api_key="b"))
    engine.step_listeners.append(lambda plan, ev, s: order.extend(
        g.request.api_key for g in plan.segments if g.start == 0))
    engine.run_until_idle()
    assert order[0] == "b"                          # b has served nothing; a has


def test_n_samples_share_prompt_blocks_until_the_last_one_finishes():
    engine, _ = sim_engine(num_blocks=64)
    events = []
    parent = make_request(40, 6, events=events)     # 40 tokens: 2 full blocks + a partial one
    parent.fork(3, [None, None, None])
    children = list(parent.children)
    engine.submit(parent)
    plans = []
    engine.step_listeners.append(lambda plan, ev, s: plans.append(plan))
    engine.step()                                   # prefill + 3 first tokens from one pass
    pool = engine.pool
    shared = pool.table(parent.request_id)
    assert [pool.ref_count(b) for b in shared] == [3, 3, 3]
    assert {e.index for e in events} == {0, 1, 2}
    engine.step()                                   # each sample writes position 40: copy-on-write
    assert len(plans[-1].block_copies) == 2         # two copies; the last holder writes in place
    assert [pool.ref_count(b) for b in shared[:2]] == [3, 3]
    engine.cancel(parent.request_id)                # cancels every sample of the request
    engine.run_until_idle()
    finals = [e for e in events if e.finish_reason]
    assert sorted(e.index for e in finals) == [0, 1, 2]
    assert all(e.request_id == parent.request_id for e in events)
    assert all(c.finished for c in children)
    pool.check_all_free()


def test_prompt_blocks_freed_only_when_the_last_sample_finishes():
    engine, _ = sim_engine(num_blocks=64)
    parent = make_request(32, 3)
    parent.fork(2, [None, None])
    child = parent.children[0]
    engine.submit(parent)
    engine.step()
    prompt_blocks = list(engine.pool.table(parent.request_id))
    child.input = replace(child.input, max_tokens=10)  # the second sample runs longer
    engine.step(); engine.step()                    # parent done (3 tokens)
    assert parent.finished and not child.finished
    assert [engine.pool.ref_count(b) for b in prompt_blocks] == [1, 1]
    engine.run_until_idle()
    assert [engine.pool.ref_count(b) for b in prompt_blocks] == [0, 0]
    engine.pool.check_all_free()


def test_an_idle_server_accepts_a_burst_it_has_rows_and_blocks_for():
    # 32 × (20 + 128 tokens) at the design's costs: 32 × 162 ms = 5.2 s of work, but every one has
    # a free row and its blocks, so none waits and none is refused; the same burst again waits
    # for rows (5.2 s > 2 s) and is refused past the budget.
    engine, _ = sim_engine(num_blocks=2048, queue_budget_s=2.0)
    for _ in range(32):
        engine.submit(make_request(20, 128))
    assert engine.stats().queue_depth == 32
    second = []
    for _ in range(32):
        try:
            engine.submit(make_request(20, 128))
        except AdmissionRejected as exc:
            second.append(exc)
    assert len(second) == 32 - 12                        # 12 × 162 ms = 1.94 s may wait
    assert "queued for rows or KV blocks" in str(second[0]) and second[0].retry_after_s == 1
    engine.run_until_idle()
    engine.pool.check_all_free()


def test_a_burst_of_long_requests_is_refused_once_its_wait_passes_the_budget():
    engine, _ = sim_engine(num_blocks=2048, queue_budget_s=2.0)
    # 6,000-token prompts (375 blocks; 600 + 300 × 1.25 = 975 ms each): 5 fit beside the
    # 103-block margin; 2 may wait (1.95 s); the rest would pass 2 s.
    outcomes = []
    for _ in range(100):
        try:
            engine.submit(make_request(6000, 1000))
            outcomes.append("queued")
        except AdmissionRejected as exc:
            outcomes.append(exc.retry_after_s)
    assert outcomes[:7] == ["queued"] * 7
    assert outcomes.count("queued") == 7
    assert all(x >= 1 for x in outcomes[7:])


def test_running_prompts_not_yet_prefilled_count_against_the_queue_budget():
    # Five 6,000-token prompts join at once (rows and blocks are free) and are prefilled in
    # pieces: at the design's 0.1 ms a token that is 3 s of prefill still to run, ahead of a new
    # prompt of their length, which is refused even though nothing waits for rows or blocks.
    engine, _ = sim_engine(num_blocks=4096, queue_budget_s=2.0)
    for _ in range(5):
        engine.submit(make_request(6000, 10))
    engine.step()
    left = sum(r.num_prompt - r.num_computed for r in engine.scheduler.running)
    assert engine.stats().queue_depth == 0 and 20_000 < left < 30_000
    with pytest.raises(AdmissionRejected) as refused:
        engine.submit(make_request(6000, 10))
    assert f"{left * 0.1 / 1000:.2f} s of running prompts not yet prefilled" in str(refused.value)
    # A short prompt goes ahead of them (fewest tokens left first): nothing counts against it.
    engine.submit(make_request(100, 10))
    # Another key's prompt is within its fair share of the budget (own backlog 0, total < 4 s).
    engine.submit(make_request(6000, 10, api_key="b"))
    while any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    engine.submit(make_request(6000, 10))          # the backlog drained: admitted
    engine.run_until_idle()
    engine.pool.check_all_free()


def test_a_request_that_waits_for_a_row_counts_that_wait_against_the_budget():
    # One key fills the 32 rows with answers of 200, 210, ..., 510 tokens (the average answer is
    # 300 until one finishes, so a row's tokens to come are min(max_tokens, 300) less those it
    # has). After 10 steps the first rows leave in (200 - 10) × 40 ms = 7.6 s and (210 - 10) ×
    # 40 ms = 8.0 s. The first extra request is admitted (nothing queued or prefilling); the
    # second would need the second row to leave, though the work queued ahead is only the two
    # requests' own 20 × 0.1 + 300 × 1.25 = 377 ms each, and is refused.
    engine, _ = sim_engine(num_blocks=4096, queue_budget_s=2.0)
    for i in range(32):
        engine.submit(make_request(20, 200 + 10 * i))
    for _ in range(10):
        engine.step()
    running = engine.scheduler.running
    assert len(running) == 32 and not any(r.is_prefilling for r in running)
    free_ms = row_free(engine.scheduler)
    assert free_ms[:3] == pytest.approx([190 * 40.0, 200 * 40.0, 210 * 40.0])
    assert free_ms[-1] == pytest.approx(290 * 40.0)        # 300 - 10 for every row from 300 on
    engine.submit(make_request(20, 300))
    with pytest.raises(AdmissionRejected) as refused:
        engine.submit(make_request(20, 300))
    assert "8.00 s until running rows leave to seat it" in str(refused.value)
    assert refused.value.retry_after_s == 6                # 8.0 s against the 2 s budget
    # another key is seated by preempting the full key (it holds more than its 8-row cap), so
    # the full rows do not refuse it
    engine.submit(make_request(20, 300, api_key="light"))


def test_the_row_wait_counts_for_a_key_at_its_cap_and_not_for_a_lighter_one():
    # Four keys hold 8 rows each (the cap; none over it, so nothing is preempted for a newcomer)
    # with long answers: every row leaves in more than 7 s.
    engine, _ = sim_engine(num_blocks=4096, queue_budget_s=2.0)
    for key in "abcd":
        for i in range(8):
            engine.submit(make_request(20, 250 + 10 * i, api_key=key))
    for _ in range(10):
        engine.step()
    assert [engine.scheduler.queue.usage[k].running_rows for k in "abcd"] == [8, 8, 8, 8]
    engine.submit(make_request(20, 300, api_key="a"))     # nothing queued: admitted
    # a key at its cap waits behind the full rows: refused
    with pytest.raises(AdmissionRejected, match="until running rows leave"):
        engine.submit(make_request(20, 300, api_key="b"))
    # a key with no rows is seated by the next join before them: only its own work counts
    engine.submit(make_request(20, 300, api_key="light"))
    assert engine.stats().queue_depth == 2


def test_row_wait_picks_the_row_that_seats_the_request():
    from engine.core.sched.admission import AdmissionControl

    assert AdmissionControl.row_wait_ms(0, [100.0, 200.0]) == 0.0
    assert AdmissionControl.row_wait_ms(3, []) == 0.0
    assert AdmissionControl.row_wait_ms(1, [100.0, 200.0]) == 100.0
    assert AdmissionControl.row_wait_ms(2, [100.0, 200.0]) == 200.0
    # past the running rows: a further round at the slowest row's pace
    assert AdmissionControl.row_wait_ms(3, [100.0, 200.0]) == 300.0
    assert AdmissionControl.row_wait_ms(5, [100.0, 200.0]) == 500.0


def test_a_row_that_leaves_soon_seats_the_next_request():
    # The same full batch with 20-token answers: its rows leave within 10 steps (0.4 s), so
    # requests queued for them are admitted, and get rows.
    engine, _ = sim_engine(num_blocks=4096, queue_budget_s=2.0)
    for _ in range(32):
        engine.submit(make_request(20, 20))
    for _ in range(10):
        engine.step()
    engine.submit(make_request(20, 20))
    engine.submit(make_request(20, 20))
    assert row_free(engine.scheduler)[0] == pytest.approx((20 - 10) * 40.0)
    engine.run_until_idle()
    assert engine.scheduler.num_finished == 34
    engine.pool.check_all_free()


def row_free(s) -> list[float]:
    """`row_free_ms` of scheduler `s`'s running rows, as its admission check computes it."""
    return row_free_ms(s.running, s.cost, s.averages.output_tokens, s.config.prefill_token_budget)
