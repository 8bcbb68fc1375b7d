"""The KV pool's size from device memory (engine/runner/kv_cache.py) and the pool on the engine's device."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.config import EngineConfig
from engine.model.config import ModelArgs
from engine.runner.builder import kv_pool_blocks
from engine.runner.kv_cache import KVCache, bytes_per_block, kv_pool_size

LLAMA_7B = dict(n_layers=32, n_kv_heads=32, head_dim=128, dtype_bytes=2, block_size=16)


def test_design_pool_is_7152_blocks():
    """80 GB − 14 GB of FP16 weights − 6 GB reserve = 60 GB (decimal) = 7,152 blocks of 16 tokens."""
    size = kv_pool_size(80 * 10**9, 14 * 10**9, 6 * 10**9, **LLAMA_7B)
    assert size.bytes_per_token == 524_288
    assert size.block_bytes == 8_388_608
    assert size.pool_bytes == 60 * 10**9
    assert size.num_blocks == 7152
    assert size.num_tokens == 114_432
    assert "7152 blocks" in size.describe() and "60.00 GB" in size.describe()


def test_bytes_per_token_agrees_with_bytes_per_block():
    args = ModelArgs.llama2_7b()
    size = kv_pool_size(80 * 10**9, 0, 0, n_layers=args.n_layers, n_kv_heads=args.n_kv_heads,
                        head_dim=args.head_dim, dtype_bytes=2, block_size=16)
    assert size.block_bytes == bytes_per_block(args, 16, torch.float16)


def test_pool_is_floored_and_scales_with_the_parameters():
    # one byte short of 7,153 blocks stays 7,152; GQA with 8 KV heads holds 4x the blocks
    short = kv_pool_size(20 * 10**9 + 7153 * 8_388_608 - 1, 14 * 10**9, 6 * 10**9, **LLAMA_7B)
    assert short.num_blocks == 7152
    gqa = kv_pool_size(80 * 10**9, 14 * 10**9, 6 * 10**9, **{**LLAMA_7B, "n_kv_heads": 8})
    assert gqa.num_blocks == 60 * 10**9 // (8_388_608 // 4) == 28_610


def test_too_little_memory_raises_with_the_arithmetic():
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        kv_pool_size(20 * 10**9, 14 * 10**9, 6 * 10**9, **LLAMA_7B)
    with pytest.raises(ValueError, match="head_dim"):
        kv_pool_size(80 * 10**9, 0, 0, **{**LLAMA_7B, "head_dim": 0})


def test_cpu_pool_keeps_the_byte_budget_and_the_override(caplog):
    args = ModelArgs.smollm2_135m()
    with caplog.at_level(logging.INFO, logger="engine.runner.builder"):
        n = kv_pool_blocks(EngineConfig(), args, torch.bfloat16, torch.device("cpu"))
    assert n == 2 * 1024**3 // 368_640 == 5825
    assert "5825 blocks" in caplog.text
    assert kv_pool_blocks(EngineConfig(num_blocks=64), args, torch.bfloat16, torch.device("cpu")) == 64


def test_kv_cache_lives_on_the_given_device():
    args = ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=128, vocab_size=300)
    kv = KVCache(args, 4, 16, torch.float32, "cpu")
    assert len(kv.layers) == 2 and kv.layers[0].shape == (2, 4, 16, 1, 32)
    assert kv.layers[0].device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")
def test_cuda_pool_takes_the_free_memory_after_the_reserve():
    from engine.runner.kv_cache import device_pool_size

    args = ModelArgs.smollm2_135m()
    device = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info(device)
    size = device_pool_size(args, 16, torch.bfloat16, device, reserve_bytes=free // 2)
    assert size.num_blocks == (size.memory_bytes - free // 2) // 368_640


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_the_cpu_budget_and_the_device_size_the_pool_by_one_rule(dtype):
    """`--kv-pool-gib` on the CPU and the free memory on CUDA both go through `model_pool_size`:
    its block is `bytes_per_block` (the 8-bit format's scales included)."""
    from engine.runner.kv_cache import model_pool_size

    args = ModelArgs.smollm2_135m()
    size = model_pool_size(args, 16, dtype, 2 * 1024**3)
    assert size.block_bytes == bytes_per_block(args, 16, dtype)
    assert size.num_blocks == 2 * 1024**3 // bytes_per_block(args, 16, dtype)
    assert kv_pool_blocks(EngineConfig(), args, dtype, torch.device("cpu")) == size.num_blocks
    with pytest.raises(ValueError, match="fewer than 2 blocks fit"):
        model_pool_size(args, 16, dtype, bytes_per_block(args, 16, dtype) * 2 - 1)
