"""Percentiles, SLO attainment, goodput and throughput against hand-computed values."""

from __future__ import annotations

import json

import pytest

from loadgen.stats import (
    RequestRecord, TokenTimer, dumps, goodput, markdown, percentiles, report, slo_attainment, summarize)


def rec(ttft=0.1, tpot=0.05, status=200, finish="length", out=10, arrival=0.0, e2e=1.0, key="k", **kw):
    return RequestRecord("r", key, arrival, 100, out, status=status, finish_reason=finish, output_tokens=out,
                         ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, **kw)


def test_percentiles_are_numpy_linear():
    # 1..10, linear (type 7): rank h = (n-1)q → p50 = 5.5, p95 = 9.55, p99 = 9.91.
    p = percentiles(range(1, 11))
    assert p["p50"] == pytest.approx(5.5) and p["p95"] == pytest.approx(9.55) and p["p99"] == pytest.approx(9.91)
    assert p["mean"] == pytest.approx(5.5) and p["n"] == 10
    # Nones are skipped; one value is every percentile; none gives None.
    assert percentiles([None, 4.0, None])["p99"] == 4.0
    assert percentiles([])["p50"] is None and percentiles([])["n"] == 0
    # [0, 10, 20, 100]: p50 = 15 (between ranks 1 and 2), p95 = 20 + 0.85 × 80 = 88.
    p = percentiles([100, 0, 20, 10])
    assert p["p50"] == pytest.approx(15.0) and p["p95"] == pytest.approx(88.0)


def test_token_timer():
    t = TokenTimer(arrival=10.0)
    for at in (10.5, 10.6, 11.1, 11.2):
        t.token(at)
    r = rec()
    t.fill(r)
    assert r.output_tokens == 4
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(0.7 / 3)
    assert r.max_gap_s == pytest.approx(0.5)
    one = TokenTimer(0.0)
    one.token(2.0)
    r1 = rec(tpot=None)
    one.fill(r1)
    assert r1.tpot_s is None and r1.max_gap_s == 0.0 and r1.ttft_s == 2.0


def test_slo_attainment_counts_429s_and_errors_as_misses():
    records = [
        rec(ttft=0.5, tpot=0.05),                  # meets both
        rec(ttft=1.5, tpot=0.05),                  # TTFT miss
        rec(ttft=0.5, tpot=0.08),                  # TPOT miss
        rec(ttft=0.9, tpot=None, out=1),           # one token: no TPOT, meets
        rec(status=429, ttft=None, tpot=None, finish=None, out=0),
        rec(ttft=0.2, tpot=0.01, error="broken stream"),
        rec(ttft=0.3, tpot=0.02, finish=None, disconnected=True),   # judged on what it got: meets
        rec(ttft=0.3, tpot=0.02, finish="cancelled"),               # server cancelled: miss
    ]
    assert slo_attainment(records, ttft_ms=1000, tpot_ms=70) == pytest.approx(3 / 8)
    assert slo_attainment([], 1000, 70) is None


def test_goodput_is_the_highest_rate_with_every_lower_rate_passing():
    assert goodput([(0.5, 1.0), (1.0, 0.99), (1.5, 0.95), (2.0, 0.90), (2.5, 0.5)]) == 1.5
    # A lucky run above a failing rate does not count.
    assert goodput([(0.5, 1.0), (1.0, 0.94), (1.5, 0.97)]) == 0.5
    assert goodput([(1.0, 0.9), (2.0, 1.0)]) is None
    assert goodput([(2.0, 1.0), (1.0, 1.0)]) == 2.0                   # order does not matter
    assert goodput([(1.0, 1.0), (1.0, 0.5), (0.5, 1.0)]) == 0.5       # repeats must all pass
    assert goodput([(1.0, None)]) is None
    assert goodput([(1.0, 0.95)], quantile=0.96) is None


def test_summary_throughput_and_report_goodput():
    records = [rec(arrival=0.0, e2e=2.0, out=10), rec(arrival=1.0, e2e=3.0, out=30),
               rec(arrival=2.0, e2e=None, status=429, finish=None, out=0, ttft=None, tpot=None),
               rec(arrival=3.0, e2e=1.0, out=5, finish=None, disconnected=True)]
    s = summarize(records, rate=1.0, ttft_ms=1000, tpot_ms=70)
    # Span: first arrival 0 → last end 4.0 s. Two completed, 45 tokens received.
    assert s["span_s"] == pytest.approx(4.0)
    assert s["num_completed"] == 2 and s["num_rejected_429"] == 1 and s["num_disconnected"] == 1
    assert s["num_errors"] == 0
    assert s["throughput_rps"] == pytest.approx(0.5)
    assert s["output_tokens_per_s"] == pytest.approx(45 / 4.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["slo"]["attainment"] == pytest.approx(3 / 4)
    slow = summarize([rec(ttft=5.0)], rate=2.0, ttft_ms=1000, tpot_ms=70)
    rep = report([s, slow])
    assert rep["goodput_rps"] is None                 # 1.0 req/s already misses 95 %
    rep = report([summarize([rec()], rate=1.0), summarize([rec()], rate=2.0), slow | {"rate": 3.0}])
    assert rep["goodput_rps"] == 2.0
    json.loads(dumps(rep))
    md = markdown(rep)
    assert "Goodput" in md and "2.00 req/s" in md and md.count("\n| ") >= 4
