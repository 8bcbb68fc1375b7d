"""Smoke tests of `python -m benchmarks.engine` and `python -m benchmarks.kv_int8`: each runs end
to end and reports every figure.

Each runs at small sizes in a subprocess (15–30 s on 2 cores, mostly model loading). No timing is
asserted: only that each figure is present, finite and positive.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from engine import kernels

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]

ROWS = (1, 8, 32, 48)
CTXS = ("short", "long")
EXPECTED_KEYS = (
    [f"machine.{k}" for k in ("gemm_bf16_gflops", "gemm_fp32_gflops", "bf16_over_fp32", "copy_gbps")]
    + [f"model.{k}" for k in ("block_params", "output_params", "weight_bytes", "attn_flops_per_key")]
    + [f"prefill.chunk{c}.{k}" for c in (256, 1024)
       for k in ("tok_s", "step_ms", "flops_per_token", "gflops", "of_gemm")]
    + ["prefill.chunk_ratio"]
    + [f"decode.{c}.rows{r}.{k}" for c in CTXS for r in ROWS for k in ("step_ms", "tok_s")]
    + [f"decode.{c}.flops_per_token" for c in CTXS]
    + ["ratio.rows1_floor_ms"]
    + [f"ratio.{c}.{k}" for c in CTXS
       for k in ("rows1_over_floor", "rows32_ceiling_tok_s", "rows32_of_ceiling",
                 "rows32_over_rows1", "rows48_over_rows32")]
    + [f"ratio.long_over_short.rows{r}" for r in ROWS]
    + [f"step.{c}.rows32.{k}" for c in CTXS
       for k in ("wall_ms", "forward_ms", "python_loop_forward_ms", "linear_ms", "attention_ms",
                 "decode_attention_ms",
                 "rope_ms", "forward_other_ms", "logits_ms", "sample_ms", "inputs_ms",
                 "scheduler_ms", "outside_forward_share")]
    + [f"e2e.ours.{c}.tok_s" for c in ("b1_short", "b32_short", "b32_long")]
    + [f"attention.rows32.{k}" for k in ("short_step_ms", "long_step_ms", "long_over_short")]
    + [f"attention.decode_{layout}.{k}" for layout in ("4k", "4k_int8")
       for k in ("ms", "kv_bytes", "gbps", "over_floor", "of_long_step")
       if layout == "4k" or kernels.int8_kv_decode_available()]
    + [f"structured.rows32.{k}" for k in ("free_step_ms", "constrained16_step_ms", "constrained_over_free")]
    + [f"structured.{k}" for k in ("compile_first_ms", "compile_second_ms", "mask_us_per_row",
                                   "mask_wait_ms_per_step", "mask_apply_ms_per_step")]
)


def test_benchmark_quick_reports_every_figure(gguf_path, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--quick", "--skip-transformers", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    figures = report["figures"]
    missing = [k for k in EXPECTED_KEYS if k not in figures]
    assert not missing, f"missing figures: {missing}"
    bad = {k: v for k, v in figures.items()
           if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0}
    assert not bad, f"figures not finite and positive: {bad}"
    assert report["meta"]["quick"] is True
    assert "share outside forward" in proc.stdout       # the printed table


def test_kv_int8_benchmark_times_both_cache_formats(gguf_path, tmp_path):
    out = tmp_path / "kv.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kv_int8", "--rows", "1,3", "--prompt-len", "40",
         "--steps", "3", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["kv_bytes_per_token"] == {"auto": 30 * 2 * 3 * 64 * 2, "int8": 30 * 2 * 3 * 66}
    for rows in ("1", "3"):
        times = report["decode_ms"][rows]
        assert set(times) == {"auto", "int8"} and all(math.isfinite(t) and t > 0 for t in times.values())
        mb = report["kv_mb_per_step"][rows]
        assert mb["int8"] == mb["auto"] * 66 / 128
    assert "tokens a 2 GiB pool holds" in proc.stdout
