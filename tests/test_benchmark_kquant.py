"""`python -m benchmarks.kquant`: its layer types are a Q4_K_M file's, its random blocks decode to
sane weights, and one small run (one layer, one step per row count) writes its figures."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import kquant as bench
from engine import kernels
from engine.model.kquant import Q4_K, Q6_K, qk_dequantize


def test_q6_k_layers_are_llama_cpps_use_more_bits():
    # llama.cpp's Q4_K_M over 16 layers: the first 2, the last 2 and every third from layer 4
    assert [i for i in range(16) if bench.use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    parts = bench.layer_parts(4, 16)
    assert [kind for kind, _, _ in parts["wqkv"]] == [Q4_K, Q4_K, Q6_K]
    assert parts["w2"] == [(Q6_K, 2048, 8192)]
    assert bench.layer_parts(5, 16)["w2"] == [(Q4_K, 2048, 8192)]


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_random_blocks_decode_to_small_weights(kind):
    blocks = bench.random_blocks(kind, 32, 512, torch.Generator().manual_seed(0))
    w = qk_dequantize(blocks, kind)
    assert torch.isfinite(w).all() and 0 < w.abs().max() < 0.3 and w.std() > 1e-3


def test_one_small_run_writes_its_figures(tmp_path):
    if not kernels.available():
        pytest.skip("genserve's kernels did not build here")
    out = tmp_path / "kquant.json"
    threads = torch.get_num_threads()
    try:
        code = bench.main(["--layers", "1", "--rows", "1,3", "--steps", "1", "--threads", "1",
                           "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["step_ms"]) == {"1", "3"}
    assert all(v["bf16"] > 0 and v["qk"] > 0 for v in result["step_ms"].values())
    assert result["weight_mb_per_step"]["bf16"] / result["weight_mb_per_step"]["qk"] > 3
