"""`python -m benchmarks.products_ab`'s pieces that need no compiler: the renames it applies to a
copy of q4q8_linear.cpp still match the source, and its random operands are well-formed blocks."""

from __future__ import annotations

import pathlib

import torch

from benchmarks import products_ab
from engine.model.weights import Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES

SOURCE = pathlib.Path(products_ab.__file__).resolve().parents[1] / "engine/kernels/csrc/q4q8_linear.cpp"


def test_every_rename_matches_the_current_source():
    src = SOURCE.read_text()
    for old, new in products_ab.RENAMES:
        assert old in src, old
        src = src.replace(old, new)
    # nothing registers in genserve's own library any more, so the copy cannot clash with it
    assert "(genserve, " not in src and "&genserve::" not in src


def test_random_blocks_carry_the_fixed_scales():
    gen = torch.Generator().manual_seed(0)
    q4 = products_ab.random_blocks(64, 96, Q4_1_BLOCK_BYTES, gen).view(64, 3, Q4_1_BLOCK_BYTES)
    d = q4[..., 0:2].contiguous().view(torch.float16).float()
    m = q4[..., 2:4].contiguous().view(torch.float16).float()
    assert torch.allclose(d, torch.full_like(d, 0.0070648193359375), rtol=0)
    assert torch.allclose(m, torch.full_like(m, -0.0078125), rtol=0)
    q8 = products_ab.random_blocks(32, 64, Q8_0_BLOCK_BYTES, gen).view(32, 2, Q8_0_BLOCK_BYTES)
    assert torch.allclose(q8[..., 0:2].contiguous().view(torch.float16).float(),
                          torch.full((32, 2, 1), 0.0070648193359375), rtol=0)
    assert q4[..., 4:].unique().numel() > 200            # the nibbles are random
