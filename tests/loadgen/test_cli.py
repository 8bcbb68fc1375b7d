"""`genserve-loadgen sim|run`: same report from the simulator and from a (scripted) live service."""

from __future__ import annotations

import csv
import json
from concurrent import futures

import grpc
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from loadgen.cli import main


def _check_outputs(out, rates):
    rep = json.loads((out / "results.json").read_text())
    assert [r["rate"] for r in rep["runs"]] == rates
    assert "goodput_rps" in rep and rep["percentile_method"].startswith("numpy.percentile")
    md = (out / "summary.md").read_text()
    assert "| rate req/s |" in md and "Goodput" in md
    lines = (out / "records.jsonl").read_text().splitlines()
    assert sum(r["num_requests"] for r in rep["runs"]) == len(lines)
    return rep


def test_sim_writes_the_report(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["sim", "--rate", "1,3", "--num-requests", "30", "--scale", "0.25", "--seed", "3",
                 "--disconnect-fraction", "0.2", "--out", str(out), "--no-progress", "--write-steps"]) == 0
    rep = _check_outputs(out, [1.0, 3.0])
    for run in rep["runs"]:
        assert run["num_requests"] == 30 and run["engine"]["kv_blocks_free_end"] == 7152
        assert run["num_disconnected"] > 0 and run["engine"]["num_steps"] > 0
    assert (out / "steps-1.0.csv").read_text().startswith("start_s,step_s,num_rows")
    assert (out / "workload-3.0.jsonl").exists()
    assert "Engine (simulated)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["run", "--url", "http://example.com:8000", "--rate", "1", "--num-requests", "1"],
    ["run", "--grpc", "10.1.2.3:50051", "--rate", "1", "--num-requests", "1"],
    ["run", "--url", "http://127.0.0.1:1", "--rate", "1"],                      # unbounded
    ["run", "--rate", "1", "--num-requests", "1"],                              # no target
    ["sim", "--rate", "1", "--num-requests", "1", "--scale", "2"],
])
def test_bad_invocations_exit_with_a_message(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--no-progress"])
    assert exc.value.code not in (0, None)


class _Echo(pb_grpc.GenerateServiceServicer):
    """Sync double: started, max_tokens tokens, finished."""

    def Generate(self, request, context):
        rid = request.request_id
        yield pb.GenerateResponse(request_id=rid, started=pb.Started(request_id=rid, prompt_tokens=1))
        for i in range(request.max_tokens):
            yield pb.GenerateResponse(request_id=rid, token=pb.Token(text="x", token_id=i, position=i))
        yield pb.GenerateResponse(request_id=rid, finished=pb.Finished(
            reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=request.max_tokens),
            timing=pb.Timing(queue_ms=1.0)))


def test_run_against_a_grpc_service_writes_the_same_report(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_GenerateServiceServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        out = tmp_path / "live"
        assert main(["run", "--grpc", f"127.0.0.1:{port}", "--rate", "50", "--num-requests", "10",
                     "--arrival", "constant", "--scale", "0.064", "--out", str(out), "--no-progress"]) == 0
    finally:
        server.stop(None)
    rep = _check_outputs(out, [50.0])
    run = rep["runs"][0]
    assert run["num_completed"] == 10 and run["num_errors"] == 0 and run["ttft_ms"]["n"] == 10


def test_sim_takes_a_batching_mode_and_a_measured_cost_model(tmp_path):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"sim_executor": {"decode_1_ms": 5.0, "decode_32_ms": 9.0,
                                                 "prefill_ms_per_token": 0.02, "step_base_ms": 1.0}}))
    out = tmp_path / "sim"
    assert main(["sim", "--rate", "2", "--num-requests", "20", "--scale", "0.1", "--batching", "dynamic",
                 "--dynamic-window-ms", "50", "--cost-model", str(cost), "--queue-budget-s", "100",
                 "--out", str(out), "--no-progress"]) == 0
    rep = _check_outputs(out, [2.0])
    assert "batching='dynamic'" in rep["config"]["engine"] and "dynamic_window_s=0.05" in rep["config"]["engine"]
    assert rep["runs"][0]["num_completed"] == 20
    # The lone first request waits the 50 ms window before its batch fires.
    first = json.loads((out / "records.jsonl").read_text().splitlines()[0])
    assert first["queue_s"] == pytest.approx(0.05)


def test_sim_takes_the_step_targets(tmp_path):
    runs = {}
    for tpot, gap in (("60", "80"), ("1", "1")):
        out = tmp_path / f"sim-{tpot}"
        assert main(["sim", "--rate", "2", "--num-requests", "60", "--scale", "0.5", "--tpot-target-ms", tpot,
                     "--gap-target-ms", gap, "--out", str(out), "--no-progress", "--write-steps"]) == 0
        rep = _check_outputs(out, [2.0])
        assert f"tpot_target_ms={tpot}.0, gap_target_ms={gap}.0" in rep["config"]["engine"]
        steps = list(csv.DictReader((out / "steps-2.0.csv").open()))
        # Steps carrying more prompt tokens than the design's caps (256; 1,024 with ≤ 4 decode rows).
        beyond = [float(s["step_s"]) * 1000.0 for s in steps
                  if int(s["num_prefill_tokens"]) > (1024 if int(s["num_decode_rows"]) <= 4 else 256)]
        runs[tpot] = rep["runs"][0], beyond
    (slack, beyond), (caps, none) = runs["60"], runs["1"]
    # 1 ms targets: the caps alone. 60 / 80 ms: prefill beyond the caps, each such step within the
    # 80 ms gap target, which brings first tokens sooner on the same trace.
    assert none == [] and beyond and max(beyond) <= 80.0 + 1e-6
    assert slack["ttft_ms"]["p50"] < caps["ttft_ms"]["p50"]
    # The slack spent on prefill leaves every stream's mean time per token within 60 ms.
    assert slack["tpot_ms"]["p99"] <= 60.0

