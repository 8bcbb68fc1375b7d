"""benchmarks/kernel_path.py: the alternation counts pure-decode steps of each path and leaves
the engine idle on the kernel path."""

from __future__ import annotations

import pytest

from engine import kernels as genserve_kernels


def test_alternate_times_both_paths_on_one_batch(tmp_path):
    if not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?)")
    from benchmarks.kernel_path import alternate
    from tests.engine.hf_families import build_checkpoint
    from tests.engine.model.test_model_families import engine

    e = engine(build_checkpoint("qwen3", tmp_path / "qwen3", head_dim=128), "bfloat16")
    times = alternate(e, rows=3, steps=6, prompt_len=8)
    assert [len(times[False]), len(times[True])] == [3, 3]
    assert all(t > 0 for ts in times.values() for t in ts)
    assert e.executor.kernels and e.executor.attention.name == "cpu-kernels"
    e.pool.check_all_free()
