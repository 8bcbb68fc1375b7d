"""`python -m benchmarks.unit_rate`: its instruction-rate loops build and report every torch
thread's rate, and its products' operands are the embedded model's shapes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import unit_rate
from engine import kernels

needs_avx512 = pytest.mark.skipif(not {"avx512_vnni", "avx512_bf16"} <= kernels.cpu_flags(),
                                  reason="the loops are AVX512-VNNI and AVX512-BF16 instructions")


@needs_avx512
def test_each_kind_reports_a_rate_per_thread():
    ops = unit_rate.build()
    for kind in unit_rate.MACS:
        rates = ops.instruction_rate(kind, 20_000)
        assert rates.dtype == torch.float64 and rates.shape == (torch.get_num_threads(),)
        # at least 1e7 instructions a second on any core that runs AVX512, at most one a cycle
        # per unit at 10 GHz times four units
        assert bool(((rates > 1e7) & (rates < 4e10)).all()), (kind, rates)


@needs_avx512
def test_unknown_kind_and_bad_iterations_raise():
    ops = unit_rate.build()
    with pytest.raises(RuntimeError, match="kind must be"):
        ops.instruction_rate("vaddps", 10)
    with pytest.raises(RuntimeError, match="iters must be >= 1"):
        ops.instruction_rate("vpdpbusd", 0)


def test_shapes_are_the_embedded_models():
    # SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1,536,
    # vocabulary 49,152
    assert unit_rate.BLOCK_SHAPES == {"wqkv": (576 + 2 * 192, 576), "wo": (576, 576),
                                      "w13": (2 * 1536, 576), "w2": (576, 1536)}
    assert unit_rate.OUTPUT_SHAPE == (49152, 576)
    # the tile's instruction counts give the bound the docstring states
    assert round(unit_rate.TILE_VPDPBUSD / (unit_rate.TILE_VPDPBUSD + unit_rate.TILE_FMA_UNIT_OPS), 2) == 0.73


def test_bad_arguments_are_refused(capsys):
    if not {"avx512_vnni", "avx512_bf16"} <= kernels.cpu_flags() or not kernels.q4q8_linear_available():
        assert unit_rate.main(["--rows", "32"]) == 1
        return
    with pytest.raises(SystemExit):
        unit_rate.main(["--rows", "0"])
    assert "must be >= 1" in capsys.readouterr().err
