"""`genserve-loadgen run` against the real server (REST+SSE and gRPC), with mid-stream disconnects."""

from __future__ import annotations

import json

import pytest

from loadgen.cli import main

NUM_REQUESTS = 12


def _finished(m: dict, reason: str) -> float:
    return m.get(f"genserve_requests_finished_total{{finish_reason={reason}}}", 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_loadgen_run_against_the_live_server(server, transport, tmp_path):
    before = server.wait_idle()
    target = ["--url", server.base_url] if transport == "rest" else ["--grpc", server.grpc_target]
    out = tmp_path / transport
    assert main(["run", *target, "--rate", "4", "--num-requests", str(NUM_REQUESTS), "--arrival", "constant",
                 "--scale", "0.064", "--disconnect-fraction", "0.25", "--seed", "11", "--timeout", "120",
                 "--drain-timeout", "180", "--out", str(out), "--no-progress"]) == 0
    after = server.wait_idle()
    rep = json.loads((out / "results.json").read_text())
    run = rep["runs"][0]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    print(f"\n  {transport}: TTFT p50/p95 {run['ttft_ms']['p50']:.0f}/{run['ttft_ms']['p95']:.0f} ms, "
          f"TPOT p50 {run['tpot_ms']['p50']:.1f} ms, {run['output_tokens_per_s']:.0f} tok/s")
    assert len(records) == NUM_REQUESTS and run["num_errors"] == 0 and run["num_rejected_429"] == 0
    disconnected = [r for r in records if r["disconnected"]]
    assert disconnected, "the seed marks some requests to disconnect"
    for r in records:
        assert r["status"] == 200 and r["error"] == "" and r["ttft_s"] > 0
        if not r["disconnected"]:
            # ignore_eos + max_tokens: the answer has exactly the asked length.
            assert r["finish_reason"] == "length" and r["output_tokens"] == r["max_tokens"]
            assert r["queue_s"] is not None
    # A disconnect cancels the request (unless its last tokens were already sampled) within one step.
    cancelled = _finished(after, "cancelled") - _finished(before, "cancelled")
    assert 0 < cancelled <= len(disconnected)
    extra = after["genserve_cancel_extra_steps_count"] - before["genserve_cancel_extra_steps_count"]
    within_one = (after["genserve_cancel_extra_steps_bucket{le=1.0}"]
                  - before["genserve_cancel_extra_steps_bucket{le=1.0}"])
    assert extra == within_one
    assert after["genserve_kv_blocks_free"] == after["genserve_kv_blocks_capacity"]
