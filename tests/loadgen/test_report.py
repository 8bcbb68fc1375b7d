"""`python -m loadgen.report`: the comparison report, on a tiny plan (seconds, not minutes)."""

from __future__ import annotations

import json

from loadgen import report


def test_plan_covers_modes_sweep_and_scenarios():
    pts = report.plan()
    groups = [p.group for p in pts]
    assert groups.count("modes") == 4 * 5 and groups.count("sweep") == 3 * 3 * 5
    assert groups.count("fairness") == 2 and groups.count("disconnect") == 1
    assert groups.count("policy") == 3 * 5 and set(groups) == {"modes", "sweep", "fairness", "disconnect", "policy"}
    configs = {p.config["label"]: p.config for p in pts if p.group == "policy"}
    assert set(configs) == {"caps", "default", "vllm"}
    # "caps": targets of 1 ms, within which no step is predicted; "default": the engine's own targets.
    assert (configs["caps"]["tpot_target_ms"], configs["caps"]["gap_target_ms"]) == (1.0, 1.0)
    assert configs["default"] == {"label": "default"}
    assert all(p.minutes == 10.0 for p in pts)
    modes = {p.config["batching"] for p in pts if p.group == "modes"}
    assert modes == {"static", "dynamic", "continuous_unchunked", "continuous"}


def test_every_rate_replays_the_same_request_lengths():
    slow, fast = report.trace_workload(0.5, 1.0), report.trace_workload(2.0, 1.0)
    assert len(fast) > len(slow) > 10
    assert [(i.prompt_tokens, i.output_tokens) for i in slow] == \
        [(i.prompt_tokens, i.output_tokens) for i in fast[:len(slow)]]


def test_tiny_report_writes_tables_plots_and_json(tmp_path):
    out = tmp_path / "bench"
    assert report.main(["--out", str(out), "--minutes", "0.5", "--rates", "1,1.5", "--rows", "16,32",
                        "--chunks", "256", "--fairness-seconds", "20", "--jobs", "1", "--no-progress"]) == 0
    for name in ("README.md", "results.json", "modes_ttft.png", "sweep_tpot.png", "sweep_ttft.png",
                 "policy_steps.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "sweep_tpot.png").read_bytes()[:4] == b"\x89PNG"
    res = json.loads((out / "results.json").read_text())
    summary = res["summary"]
    assert set(summary["modes"]) == set(report.MODES)
    assert {(s["max_rows"], s["prefill_token_budget"]) for s in summary["sweep"]} == {(16, 256), (32, 256)}
    assert summary["sweep_best"] in summary["sweep"]
    assert summary["fairness"]["429_final"]["B"]["sent"] == 20
    assert summary["disconnect"]["num_disconnected"] > 0
    assert summary["disconnect"]["kv_blocks_free_end"] == 7152
    # 2 rates × (4 modes + 2 sweep settings + 3 step configurations) + 2 fairness + 1 disconnect
    assert len(res["runs"]) == res["meta"]["num_runs"] == 21
    pol = summary["policies"]
    assert set(pol) == {"caps", "default", "vllm"}
    # The TPOT slack spent on prefill brings first tokens sooner than the caps alone, at every rate
    # of the same trace; the vLLM-like 2,048-token steps (25 + 204.8 ms with one row decoding) put
    # every run's p99 longest gap over 100 ms.
    ttft = {(r["point"]["overrides"]["label"], r["rate"]): r["ttft_ms"]["p50"]
            for r in res["runs"] if r["point"]["group"] == "policy"}
    assert all(ttft["default", rate] < ttft["caps", rate] for rate in (1.0, 1.5))
    assert min(pol["vllm"]["gap_p99_ms"].values()) > 100.0
    md = (out / "README.md").read_text()
    for heading in ("## 1. Scheduler modes", "## 3. Row cap", "## 4. How each step is sized", "## 5. Fairness",
                    "## 6. Cancellation", "![step time and rows per step of each configuration over a busy minute]",
                    "TTFT ≤ **3 s**", "![throughput against p95 TPOT](sweep_tpot.png)",
                    "`--tpot-target-ms 1 --gap-target-ms 1`"):
        assert heading in md
    assert "--policy" not in md
