"""Kernel sources built for `-march=x86-64-v3` (AVX2, FMA, F16C, no AVX512), so the AVX2 code
paths, which a host with AVX512 never runs in its own build, are tested there too (the fixtures
`avx2_attention` and `avx2_products` in tests/engine/conftest.py).

The builds come from the benchmarks' A/B helpers (`benchmarks._baseline.build_baseline`, by way of
`benchmarks.decode_attention.baseline_op` and `benchmarks.products_ab.build_variant`), which
register a source's ops under another library name: one name per source, since torch refuses a
second registration of a library in one process.
"""

from __future__ import annotations

import pytest

from engine import kernels

ATTENTION_LIBRARY = "genserve_avx2_attention"     # decode_attention.cpp: `.paged_decode`
PRODUCTS_LIBRARY = "genserve_avx2_products"       # q4q8_linear.cpp: `.q4q8_linear`, `.q8q8_linear`
MARCH = "x86-64-v3"


def skip_unless_host_build_is_avx512() -> None:
    """Skip (pytest) unless an x86-64-v3 build can run here (the CPU has AVX2, FMA and F16C) and
    this host's own kernel build is the AVX512 one (it has `packed_linear`, built only where the
    compiler targets AVX512-BF16, and the CPU has AVX512-VNNI, which its 8-bit products use).
    Where the host's own build is the AVX2 one, the plain tests run that code already."""
    flags = kernels.cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("an x86-64-v3 build needs a CPU with AVX2, FMA and F16C")
    if not (kernels.packed_linear_available() and "avx512_vnni" in flags):
        pytest.skip("this host's own kernel build is not the AVX512 one; the plain tests run "
                    "the AVX2 code")
