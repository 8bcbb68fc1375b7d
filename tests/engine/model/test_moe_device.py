"""The mixture-of-experts layer on a real CUDA device (skipped without one): the grouped GEMM
path (`torch._grouped_mm` over the stacked experts, bf16 on compute capability 9.x / 10.x) against
the loop over experts on the same device. Only torch is needed, so the device check
(benchmarks/device.py) runs this file on the lent GPU; the fake-CUDA test covers the path's
shapes, transfers and memory on every machine (tests/engine/runner/test_fake_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import ModelArgs, MoEArgs
from engine.model.layer_ops import TorchLayerOps
from engine.model.mlp import grouped_mm_device
from engine.model.transformer import Transformer
from engine.model.weights import random_weights

ARGS = ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=512, vocab_size=512,
                 max_context=1024, moe=MoEArgs(32, 4, 128, True, (True,)))


@pytest.fixture(scope="module")
def device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (the device check runs this file on a lent GPU)")
    device = torch.device("cuda", 0)
    if not grouped_mm_device(ARGS.moe, ARGS.dim, torch.bfloat16, device):
        pytest.skip(f"torch._grouped_mm's fast kernel does not serve compute capability "
                    f"{torch.cuda.get_device_capability(device)} here; the loop runs")
    return device


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_the_grouped_gemm_gives_the_loops_outputs_on_the_device(device, rows):
    """One grouped product per matrix, no host read, against one product per chosen expert: the
    same routing and expert counts, outputs within bf16 rounding of each other (different
    kernels), including a step whose last group ends exactly at T·k rows."""
    state = random_weights(ARGS, torch.bfloat16, device=device, std=0.05)
    model = Transformer.from_state_dict(ARGS, state, torch.bfloat16, device)
    moe = model.moe_layers[0]
    assert moe.w13_stacked is not None and moe.w13_stacked.device == device
    x = torch.randn(rows, ARGS.dim, generator=torch.Generator(device).manual_seed(5), device=device
                    ).to(torch.bfloat16)
    grouped = moe(x, TorchLayerOps)
    counts = moe.expert_rows.clone()
    stacked = (moe.w13_stacked, moe.w2_stacked)
    moe.w13_stacked = moe.w2_stacked = None                  # the loop over experts
    try:
        loop = moe(x, TorchLayerOps)
    finally:
        moe.w13_stacked, moe.w2_stacked = stacked
    assert torch.equal(moe.expert_rows, 2 * counts) and int(counts.sum()) == rows * ARGS.moe.top_k
    scale = loop.float().abs().max().item()
    assert (grouped.float() - loop.float()).abs().max().item() <= 2e-2 * scale
