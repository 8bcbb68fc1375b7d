"""benchmarks.routing's trace, metric arithmetic and model (the live runs are the benchmark itself)."""

from __future__ import annotations

from benchmarks.routing import bounded_load_pick, by_replica, simulate, summarize, system_prompt, user_message


def test_the_trace_repeats_with_its_seed_and_gives_each_conversation_its_own_prompt():
    assert system_prompt(3, 7) == system_prompt(3, 7) != system_prompt(4, 7)
    assert 420 <= len(system_prompt(3, 7).split()) - 5 <= 640          # ≈ 500–800 tokens
    assert user_message(1, 2, 7).startswith("Question 3: ")


def test_counters_are_read_per_replica_and_differenced():
    before = {"genserve_prefix_cache_hit_tokens_total{replica=0}": 10.0,
              "genserve_prefix_cache_hit_tokens_total{replica=1}": 0.0,
              "genserve_prefix_cache_queried_tokens_total{replica=0}": 100.0,
              "genserve_prefix_cache_queried_tokens_total{replica=1}": 0.0,
              "genserve_requests_finished_total{finish_reason=length,replica=0}": 1.0}
    after = {"genserve_prefix_cache_hit_tokens_total{replica=0}": 70.0,
             "genserve_prefix_cache_hit_tokens_total{replica=1}": 30.0,
             "genserve_prefix_cache_queried_tokens_total{replica=0}": 200.0,
             "genserve_prefix_cache_queried_tokens_total{replica=1}": 100.0,
             "genserve_requests_finished_total{finish_reason=length,replica=0}": 4.0,
             "genserve_requests_finished_total{finish_reason=length,replica=1}": 1.0,
             "genserve_requests_finished_total{finish_reason=stop,replica=1}": 2.0}
    assert by_replica(after, "genserve_requests_finished_total") == {"0": 4.0, "1": 3.0}
    records = [{"turn": t, "ttft_s": 0.1 * (t + 1)} for t in range(4)]
    s = summarize(records, before, after)
    assert s["hit_ratio"] == 90 / 200
    assert s["replicas"]["0"]["share"] == 0.5 and s["replicas"]["1"]["requests"] == 3.0
    assert abs(s["later_ttft_p50_ms"] - 300.0) < 1e-9 and abs(s["first_ttft_p50_ms"] - 100.0) < 1e-9
    # one replica, unlabelled
    assert by_replica({"genserve_steps_total": 5.0}, "genserve_steps_total") == {"0": 5.0}


def test_bounded_load_follows_envoys_rule():
    """Overloaded when active > ceil(ceil((total + 1) × factor / 100) / N): with everything on
    the key's replica of two, the sixth request is shed at factor 125, not the fifth."""
    assert bounded_load_pick([0, 1], [4, 0], 125) == 0
    assert bounded_load_pick([0, 1], [5, 0], 125) == 1
    assert bounded_load_pick([0, 1], [5, 0], 200) == 0


def test_the_model_orders_the_policies():
    system = [600] * 16
    one = simulate(1, 16, 4, system, 70, "least")
    assert one == simulate(1, 16, 4, system, 70, "affinity") > 0.6
    two_least = simulate(2, 16, 4, system, 70, "least", seed=1)
    two_affinity = simulate(2, 16, 4, system, 70, "affinity", seed=1)
    assert two_least < two_affinity <= one
    assert simulate(8, 64, 4, [600] * 64, 70, "least", seed=1) < 0.3 * one
