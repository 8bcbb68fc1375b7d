"""Workloads: arrival processes, the design's length mix, traces, disconnect marks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadgen.workload import (
    LengthMix, WorkItem, arrival_times, clipped_lognormal_mean, load_trace, retime, save_trace,
    synthetic_prompt_ids, synthetic_workload, with_disconnects)


def test_poisson_arrivals_count_and_rate_for_a_seeded_run():
    t = arrival_times(2.0, process="poisson", duration_s=3600, seed=7)
    # 7,200 expected; a Poisson count has sd sqrt(7200) ≈ 85, so ±3 % is > 2.5 sd.
    assert abs(len(t) - 7200) < 0.03 * 7200
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.5) < 0.02
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05       # exponential: cv = 1
    assert np.all(gaps >= 0) and t[0] > 0 and t[-1] < 3600
    assert np.array_equal(t, arrival_times(2.0, duration_s=3600, seed=7))   # seeded
    assert not np.array_equal(t[:10], arrival_times(2.0, duration_s=3600, seed=8)[:10])


def test_constant_arrivals_are_evenly_spaced_from_zero():
    t = arrival_times(4.0, process="constant", duration_s=10)
    assert len(t) == 40
    assert t[0] == 0.0 and np.allclose(np.diff(t), 0.25)


def test_num_requests_bounds_the_run_and_the_first_bound_wins():
    assert len(arrival_times(1.0, num_requests=25, seed=1)) == 25
    assert len(arrival_times(1.0, process="constant", num_requests=25)) == 25
    assert len(arrival_times(1.0, process="constant", num_requests=1000, duration_s=10)) == 10
    assert len(arrival_times(100.0, num_requests=5, duration_s=1000)) == 5


@pytest.mark.parametrize("kwargs", [dict(rate=0), dict(rate=-1), dict(rate=1, process="closed")])
def test_bad_arrival_settings_raise(kwargs):
    with pytest.raises(ValueError):
        arrival_times(**{"duration_s": 10, **kwargs})


def test_an_unbounded_run_is_refused():
    with pytest.raises(ValueError, match="bounded"):
        arrival_times(1.0)


def test_design_mix_means_and_ranges():
    mix = LengthMix.design()
    prompt, output = mix.sample(400_000, np.random.default_rng(3))
    # The design: prompts 50..8,000 tokens, mean ≈ 1,250; answers 1..1,000, mean ≈ 300.
    assert prompt.min() >= 50 and prompt.max() <= 8000 and output.min() >= 1 and output.max() <= 1000
    assert abs(prompt.mean() - 1250) < 0.02 * 1250
    assert abs(output.mean() - 300) < 0.02 * 300
    assert np.all(prompt + output <= 8192)
    # The documented clipped means (before the 8,192-token cut) and the long tail.
    assert mix.prompt_mean == pytest.approx(1248, abs=1)
    assert mix.output_mean == pytest.approx(301, abs=1)
    assert np.median(prompt) == pytest.approx(780, rel=0.03)
    assert np.median(output) == pytest.approx(217, rel=0.03)
    assert 0.005 < np.mean(prompt == 8000) < 0.015 and 0.035 < np.mean(output == 1000) < 0.055


def test_scaled_mix_for_cpu_runs():
    mix = LengthMix.design(0.064)
    assert (mix.prompt_min, mix.prompt_max, mix.output_min, mix.output_max) == (16, 512, 1, 64)
    prompt, output = mix.sample(200_000, np.random.default_rng(4))
    assert prompt.min() >= 16 and prompt.max() <= 512 and output.max() <= 64
    assert prompt.mean() == pytest.approx(mix.prompt_mean, rel=0.02)
    assert output.mean() == pytest.approx(mix.output_mean, rel=0.03)   # rounding of small lengths
    assert mix.prompt_mean == pytest.approx(80.6, abs=0.5) and mix.output_mean == pytest.approx(19.3, abs=0.3)
    with pytest.raises(ValueError):
        LengthMix.design(0)


def test_clipped_lognormal_mean_matches_monte_carlo():
    z = np.random.default_rng(5).standard_normal(1_000_000)
    x = np.clip(np.exp(3.0 + 1.3 * z), 5.0, 200.0)
    assert clipped_lognormal_mean(3.0, 1.3, 5.0, 200.0) == pytest.approx(x.mean(), rel=0.005)


def test_synthetic_workload_is_reproducible_and_keys_round_robin():
    arrivals = arrival_times(1.0, num_requests=6, seed=2)
    a = synthetic_workload(arrivals, api_keys=["k1", "k2"], seed=9)
    b = synthetic_workload(arrivals, api_keys=["k1", "k2"], seed=9)
    assert a == b
    assert [it.api_key for it in a] == ["k1", "k2"] * 3
    assert [it.arrival_s for it in a] == list(arrivals)
    ids = a[0].prompt_ids(seed=1)
    assert len(ids) == a[0].prompt_tokens and ids == synthetic_prompt_ids(0, a[0].prompt_tokens, 1)
    assert all(1000 <= t < 30000 for t in ids)


def test_trace_round_trip_and_retime(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([
        "# a comment",
        json.dumps({"arrival_s": 2.0, "api_key": "b", "prompt": "x" * 41, "max_tokens": 7}),
        json.dumps({"arrival_s": 0.5, "prompt_token_ids": [5, 6, 7], "output_tokens": 3}),
        "",
        json.dumps({"prompt_tokens": 100, "output_tokens": 10}),
    ]))
    items = load_trace(path, default_api_key="dflt")
    assert [(it.arrival_s, it.api_key, it.prompt_tokens, it.output_tokens) for it in items] == [
        (0.0, "dflt", 100, 10), (0.5, "dflt", 3, 3), (2.0, "b", 11, 7)]
    assert items[1].prompt == (5, 6, 7) and items[2].prompt == "x" * 41 and items[0].prompt is None
    assert [it.index for it in items] == [0, 1, 2]
    save_trace(items, tmp_path / "again.jsonl")
    assert load_trace(tmp_path / "again.jsonl", default_api_key="dflt") == items
    timed = retime(items, [0.0, 1.0, 2.0, 3.0, 4.0])
    assert [it.prompt_tokens for it in timed] == [100, 3, 11, 100, 3]
    assert [it.index for it in timed] == [0, 1, 2, 3, 4]


def test_trace_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt_tokens": 5, "output_tokens": 1}) + "\n" + json.dumps({"prompt_tokens": 5}))
    with pytest.raises(ValueError, match="bad.jsonl:2: output_tokens"):
        load_trace(path)


def test_disconnect_marks_a_seeded_fraction_mid_stream():
    items = [WorkItem(i, float(i), "k", 10, 40) for i in range(2000)]
    marked = with_disconnects(items, 0.2, seed=1)
    share = np.mean([it.disconnect_after is not None for it in marked])
    assert abs(share - 0.2) < 0.03
    assert {it.disconnect_after for it in marked if it.disconnect_after} == {20}
    assert with_disconnects(items, 0.2, seed=1) == marked
    one_token = with_disconnects([WorkItem(0, 0.0, "k", 10, 1)], 1.0)
    assert one_token[0].disconnect_after is None          # nothing to cut
