"""Smoke test of `python -m benchmarks.decode_attention` at tiny sizes, and its byte count.

No timing is asserted: only that the figures are present, consistent and positive.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from benchmarks import decode_attention as bench
from engine import kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kv_bytes_counts_keys_and_values_of_every_layer():
    # 30 layers · 32 rows · 1,500 tokens · 3 KV heads · 64 dims · (K, V) · 2 bytes
    assert bench.kv_bytes(32, 1500) == 1_105_920_000
    assert bench.kv_bytes(1, 1) == 30 * 3 * 64 * 2 * 2
    assert bench.kv_bytes(1, 1, eight_bit=True) == 30 * 3 * 66 * 2


def test_step_tables_hand_out_distinct_blocks_in_a_shuffled_order():
    pools, q, tables, lens = bench.make_step(rows=3, context=40, huge=False)
    assert len(pools) == bench.LAYERS and pools[0].shape == (2, 3 * 3 + bench.SPARE_BLOCKS, 16, 3, 64)
    assert q.shape == (3, 9, 64) and tables.shape == (3, 3) and lens.tolist() == [40, 40, 40]
    assert len(set(tables.flatten().tolist())) == 9
    assert tables.flatten().tolist() != sorted(tables.flatten().tolist())


def test_resident_step_gives_every_row_the_same_blocks_in_order():
    _, _, tables, _ = bench.make_step(rows=3, context=40, huge=False, resident=True)
    assert tables.tolist() == [[0, 1, 2]] * 3


@pytest.mark.slow
def test_benchmark_reports_each_layout(tmp_path):
    if not kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?)")
    out = tmp_path / "attn.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode_attention", "--rows", "2", "--context", "40",
         "--repeats", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    layouts = {"4k", "resident"} | ({"thp"} if bench.thp_mode() not in ("never", "") else set())
    eight_bit = {f"{layout}_int8" for layout in layouts} if kernels.int8_kv_decode_available() else set()
    assert set(report["results"]) == layouts | eight_bit
    for name, r in report["results"].items():
        assert r["kv_bytes"] == bench.kv_bytes(2, 40, eight_bit=name.endswith("_int8"))
        assert math.isclose(r["gbps"], r["kv_bytes"] / r["step_s"] / 1e9)
        assert math.isclose(r["over_floor"], r["step_s"] / (r["kv_bytes"] / (report["read_gbps"] * 1e9)))
        assert r["step_s"] > 0
    assert "× bytes/read bw" in proc.stdout


def test_march_flags_replace_the_host_target_only():
    from benchmarks._baseline import march_flags

    flags = march_flags("x86-64-v3")
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    assert set(kernels.CFLAGS) - set(flags) == {"-march=native"}     # every other flag kept
    assert len(flags) == len(kernels.CFLAGS)
    assert kernels.CFLAGS.count("-march=native") == 1     # a new list: the checkout's flags stay
