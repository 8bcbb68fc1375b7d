"""Kernel sources built for `-march=x86-64-v3` (AVX2, FMA, F16C, no AVX512), so the AVX2 code
paths, which a host with AVX512 never runs in its own build, are tested there too.

The builds come from the benchmarks' A/B helpers (`benchmarks._baseline.build_baseline`, by way of
`benchmarks.decode_attention.baseline_op` and `benchmarks.products_ab.build_variant`), which
register a source's ops under another library name.
"""

from __future__ import annotations

import pathlib

import pytest


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                 if line.startswith("flags")), set())


def skip_unless_avx2_is_not_the_host_build() -> None:
    """Skip (pytest) where an x86-64-v3 build cannot run (no AVX2, FMA or F16C), or where this
    host's own build already is the AVX2 one (no AVX512-BF16): the plain tests cover it there."""
    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("an x86-64-v3 build needs a CPU with AVX2, FMA and F16C")
    if not {"avx512_bf16", "avx512_vnni", "avx512bw"} <= flags:
        pytest.skip("this host's own build is the AVX2 one; the plain tests run it")
