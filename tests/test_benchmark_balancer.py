"""benchmarks.balancer's trace and summary (the live runs are the benchmark itself)."""

from __future__ import annotations

from benchmarks.balancer import HEAVY_EVERY, LIGHT_PROMPT, skewed_trace, summarize
from loadgen.stats import RequestRecord


def test_the_skewed_trace_is_one_heavy_request_in_five_and_repeats_with_its_seed():
    items = skewed_trace(2.0, 30.0, 1024, seed=3)
    heavy = [it for it in items if it.api_key == "heavy"]
    assert 40 <= len(items) <= 80 and len(heavy) == len(items) // HEAVY_EVERY
    assert {it.prompt_tokens for it in heavy} == {1024}
    assert {it.prompt_tokens for it in items if it.api_key == "light"} == {LIGHT_PROMPT}
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(items, items[1:]))
    assert [it.arrival_s for it in skewed_trace(2.0, 30.0, 1024, seed=3)] == [it.arrival_s for it in items]


def test_summary_counts_the_light_key_and_the_slo():
    def rec(key, ttft, tpot, status=200):
        return RequestRecord("r", key, 0.0, 32, 32, status=status, finish_reason="length",
                             output_tokens=32, ttft_s=ttft, tpot_s=tpot)
    records = [rec("light", 0.1, 0.05), rec("light", 0.3, 0.05), rec("heavy", 2.0, 0.05),
               rec("light", None, None, status=429)]
    s = summarize(records, slo_ttft_ms=1000.0, slo_tpot_ms=100.0)
    assert s["requests"] == 4 and s["completed"] == 3
    assert s["slo_attainment"] == 0.5                       # the heavy one is late, the 429 misses
    assert abs(s["light_ttft_p95_ms"] - 290.0) < 1e-6       # 100 and 300 ms: linear interpolation
