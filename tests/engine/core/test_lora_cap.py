"""The step's LoRA adapter cap on the SimExecutor (no model): at most `max_loras` distinct
adapters in any step's plan, requests of other adapters wait and are neither failed nor passed
over for ever, and the other keys' requests (the base model's, a running adapter's) are not
held back by it."""

from __future__ import annotations

import pytest

from engine.core.outputs import FinishReason
from engine.core.request import LoraRequest
from engine.core.sched.lora_cap import LoraCap, step_adapters
from tests.engine.sim import make_request, sim_engine

ADAPTERS = [LoraRequest(name, lora_id) for lora_id, name in enumerate(("a", "b", "c", "d"), start=1)]


def adapters_per_step(engine) -> list[set[int]]:
    """A list that collects, step by step, the load ids of the adapters in the step's plan."""
    seen: list[set[int]] = []
    engine.step_listeners.append(lambda plan, events, s: seen.append(
        step_adapters(seg.request for seg in plan.segments)))
    return seen


def test_a_step_never_uses_more_adapters_than_max_loras():
    engine, clock = sim_engine(max_loras=2)
    seen = adapters_per_step(engine)
    events: list[list] = []
    # 12 requests round-robin over four adapters and the base, prompts over several pieces
    reqs = []
    for i in range(12):
        events.append([])
        lora = ADAPTERS[i % 5] if i % 5 < 4 else None
        reqs.append(make_request(40 + 30 * i, 6 + i % 4, api_key=f"k{i % 3}", events=events[-1], lora=lora))
        engine.submit(reqs[-1])
    engine.run_until_idle()
    assert max(len(s) for s in seen) == 2
    assert set().union(*seen) == {1, 2, 3, 4}                 # every adapter did run
    for req, ev in zip(reqs, events):
        assert req.finish_reason == FinishReason.LENGTH, req.finish_detail
        assert len([e for e in ev if e.token_id is not None]) == req.max_tokens
    engine.pool.check_all_free()


def test_base_requests_join_while_an_adapter_waits():
    engine, clock = sim_engine(max_loras=1)
    seen = adapters_per_step(engine)
    first = make_request(20, 30, lora=ADAPTERS[0])
    engine.submit(first)
    engine.step()
    waiting = make_request(20, 5, lora=ADAPTERS[1])
    base = make_request(20, 5, api_key="other")             # the fair queue's candidate first
    engine.submit(waiting)
    engine.submit(base)
    engine.step()
    assert base in engine.scheduler.running                  # the base model takes no adapter slot
    assert waiting not in engine.scheduler.running and not waiting.finished
    while not first.finished:
        engine.step()
    engine.run_until_idle()
    assert waiting.finish_reason == FinishReason.LENGTH
    assert max(len(s) for s in seen) == 1
    engine.pool.check_all_free()


def test_a_request_waiting_for_an_adapter_slot_holds_back_only_its_own_keys_queue():
    """Key k2's request on adapter b waits behind k1's long request on a (cap of one) and is
    the fair queue's candidate; k3's base request and k4's on the running a join past it at the
    next step, while k2's later base request waits behind its own head."""
    engine, clock = sim_engine(max_loras=1)
    long = make_request(20, 300, api_key="k1", lora=ADAPTERS[0])
    engine.submit(long)
    engine.step()
    waiting = make_request(20, 5, api_key="k2", lora=ADAPTERS[1])
    behind = make_request(20, 5, api_key="k2")
    base, same = make_request(20, 5, api_key="k3"), make_request(20, 5, api_key="k4", lora=ADAPTERS[0])
    for req in (waiting, behind, base, same):
        engine.submit(req)
    engine.step()
    running = engine.scheduler.running
    assert base in running and same in running
    assert waiting not in running and behind not in running          # its key's queue is FIFO
    engine.run_until_idle()
    assert all(r.finish_reason == FinishReason.LENGTH for r in (long, waiting, behind, base, same))
    engine.pool.check_all_free()


def test_a_waiting_adapter_is_not_passed_over_for_ever_by_a_stream_on_a_running_one():
    """Key x keeps a stream of short requests on adapter a in flight (one arrives every step);
    key y's request on adapter b waits behind the cap of one. While y's base rows run, y is the
    more served key and x's newcomers join onto the running a; once they end, y's request is
    the fair queue's candidate, nothing joins, a drains and b runs while the stream goes on."""
    engine, clock = sim_engine(max_loras=1)
    seen = adapters_per_step(engine)
    base = [make_request(20, 60, api_key="y") for _ in range(6)]
    for req in base:
        engine.submit(req)
    stream = [make_request(20, 3, api_key="x", lora=ADAPTERS[0])]
    engine.submit(stream[0])
    engine.step()
    late = make_request(20, 3, api_key="y", lora=ADAPTERS[1])
    engine.submit(late)
    for _ in range(300):
        clock.now += 1.0
        stream.append(make_request(20, 3, api_key="x", lora=ADAPTERS[0]))
        engine.submit(stream[-1])
        engine.step()
    assert late.finish_reason == FinishReason.LENGTH
    last_base_s = max(r.stats.finished_s for r in base)
    assert last_base_s < late.stats.admitted_s < last_base_s + 60, (last_base_s, late.stats.admitted_s)
    assert {2} in seen and {1} in seen[seen.index({2}):]     # then a again
    assert max(len(s) for s in seen) == 1
    engine.run_until_idle()
    assert all(r.finish_reason == FinishReason.LENGTH for r in stream)
    engine.pool.check_all_free()


def test_lora_cap_fits():
    cap = LoraCap(2)
    running = [make_request(8, 2, lora=ADAPTERS[0]), make_request(8, 2, lora=ADAPTERS[1]), make_request(8, 2)]
    new, same, base = (make_request(8, 2, lora=ADAPTERS[2]), make_request(8, 2, lora=ADAPTERS[0]),
                       make_request(8, 2))
    assert not cap.fits(running, new)                         # a third adapter waits
    assert cap.fits(running, same) and cap.fits(running, base)
    assert cap.fits(running[1:], new)                         # one adapter runs: room for another
    assert cap.fits([], new)
    with pytest.raises(ValueError, match="max_loras"):
        LoraCap(0)
