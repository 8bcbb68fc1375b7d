"""`python -m benchmarks.unit_rate`: its instruction-rate loops build and report every torch
thread's rate, and its products' operands are the embedded model's shapes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import unit_rate
from engine import kernels

needs_avx512 = pytest.mark.skipif(
    not {"avx512_vnni", "avx512_bf16"} <= kernels.cpu_flags() or not kernels.q4q8_linear_available(),
    reason="the loops are AVX512-VNNI and AVX512-BF16 instructions (and the compiler must emit them: "
           "genserve's own VNNI kernels built here)")


@pytest.mark.slow
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
    # the block matrices and the output projection of SmolLM2-135M (engine.model.transformer's
    # ModelArgs, whose values are the GGUF's metadata)
    from engine.model.config import ModelArgs

    m = ModelArgs.smollm2_135m()
    kv = m.n_kv_heads * m.head_dim
    assert unit_rate.BLOCK_SHAPES == {"wqkv": (m.dim + 2 * kv, m.dim), "wo": (m.dim, m.dim),
                                      "w13": (2 * m.intermediate_size, m.dim),
                                      "w2": (m.dim, m.intermediate_size)}
    assert unit_rate.OUTPUT_SHAPE == (m.vocab_size, m.dim)


def test_bad_arguments_are_refused(capsys):
    for argv, message in ((["--rows", "0"], "must be >= 1"), (["--rows", "a,32"], "whole numbers"),
                          (["--rounds", "0"], "must be >= 1")):
        with pytest.raises(SystemExit):
            unit_rate.main(argv)
        assert message in capsys.readouterr().err
