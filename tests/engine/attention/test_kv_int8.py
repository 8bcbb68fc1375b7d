"""The 8-bit KV cache (`engine.attention.kv_quant`): its format, every attention path's bits against the same
path over a cache of the dequantized numbers, batch invariance, preemption, and its parity with
the bf16 cache through the real model."""

from __future__ import annotations

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.attention.kv_quant import dequantize_kv, quantize_kv, row_bytes
from engine.attention.base import GatherBuffer, store_kv
from tests.engine.attention_oracle import step_metadata
from engine.model.layer_ops import KernelLayerOps, TorchLayerOps
from engine.model.config import ModelArgs
from engine.model.rope import rope_tables
from engine.runner.kv_cache import KVCache, bytes_per_block
from tests.engine.conftest import check_preemption_keeps_tokens, generate
from tests.engine.model.test_model import mixed_prompts

BS, KVH, HD, GROUP = 16, 3, 64, 3          # SmolLM2's shape: 9 query heads over 3 KV heads
H = KVH * GROUP
NO_INT8_DECODE_KERNEL = ("the decode kernel reads 8-bit pools in its AVX512-BF16 build only (not "
                         "built here); the engine then runs SDPA over them")
ROW = HD + 2                               # 64 int8 + two exponent bytes


def random_int8_cache(blocks: int, seed: int) -> torch.Tensor:
    """An 8-bit pool pair [2, blocks, BS, KVH, 66] of quantized N(0, 1) numbers, some groups
    scaled up or down and some all zero, so scales vary over orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, blocks, BS, KVH, HD, generator=g)
    x *= torch.exp2(torch.randint(-6, 6, (2, blocks, BS, KVH, 1), generator=g).float())
    x[:, :, 3, 1, :32] = 0.0
    return quantize_kv(x.bfloat16())


def test_format_stores_q_then_exponent_bytes_and_holds_bf16_exact_numbers():
    x = torch.tensor([[0.5] * 31 + [-2.54], [0.0] * 32]).reshape(1, 64).bfloat16()
    row = quantize_kv(x)
    assert row.shape == (1, ROW) and row.dtype == torch.int8
    # amax = bf16(2.54) = 2.546875 = 1.27 · 2^1: e = 1, stored 128; q = round(x · 2^5)
    assert row[0, 64:].view(torch.uint8).tolist() == [128, 127]       # all-zero group: e = 0
    assert row[0, 31].item() == -82 and row[0, 0].item() == 16        # -81.5: half to even
    assert row[0, 32:64].abs().sum().item() == 0
    back = dequantize_kv(row, torch.float32)
    assert back[0, 0].item() == 0.5 and back[0, 32:].abs().sum().item() == 0
    y = torch.randn(50, KVH, HD, generator=torch.Generator().manual_seed(2)).bfloat16() * 3
    back = dequantize_kv(quantize_kv(y), torch.float32)
    assert torch.equal(back.bfloat16().float(), back)                  # exact in bf16
    groups = y.float().reshape(50, KVH, 2, 32)
    step = torch.exp2(torch.frexp(groups.abs().amax(-1, keepdim=True))[1] - 1 - 6)
    err = (back.reshape(50, KVH, 2, 32) - groups).abs()
    assert (err <= step / 2).all()                                     # round to nearest step
    assert row_bytes(64) == 66 and row_bytes(128) == 132
    with pytest.raises(ValueError, match="multiple of 32"):
        row_bytes(48)


def test_pool_sizes_count_66_bytes_a_row():
    args = ModelArgs.smollm2_135m()
    assert bytes_per_block(args, 16, torch.int8) == 30 * 2 * 16 * 3 * 66 == 190_080
    assert bytes_per_block(args, 16, torch.bfloat16) == 368_640
    kv = KVCache(args, 4, 16, torch.int8)
    assert kv.layers[0].shape == (2, 4, 16, 3, 66) and kv.layers[0].dtype == torch.int8


def test_rope_store_kv_kernel_stores_the_bytes_of_the_torch_path():
    if not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?)")
    g = torch.Generator().manual_seed(3)
    args = ModelArgs.smollm2_135m()
    rope = torch.view_as_real(rope_tables(args.head_dim, args.max_context, args.rope_theta))
    t = 40
    qkv = (torch.randn(t, (H + 2 * KVH) * HD, generator=g) * 3).bfloat16()
    positions = torch.randint(0, 4000, (t,), generator=g)
    slots = torch.randperm(8 * BS, generator=g)[:t]
    caches = [torch.zeros(2, 8, BS, KVH, ROW, dtype=torch.int8) for _ in range(2)]
    q_torch = TorchLayerOps.rope_store_kv(qkv, rope, positions, caches[0], slots, H, KVH)
    q_kernel = KernelLayerOps.rope_store_kv(qkv, rope, positions, caches[1], slots, H, KVH)
    assert torch.equal(q_torch, q_kernel)
    assert torch.equal(caches[0], caches[1])
    assert caches[1].view(2, -1, KVH, ROW)[:, slots].abs().sum() > 0


def contexts_and_tables(contexts: list[int]) -> list[list[int]]:
    tables, nxt = [], 1
    for c in contexts:
        tables.append(list(range(nxt, nxt + -(-c // BS))))
        nxt += len(tables[-1])
    return tables


@pytest.mark.parametrize("path", ["torch", "kernels", "kernels-vdpbf16ps"])
def test_decode_reads_int8_rows_as_the_bf16_cache_of_their_numbers(path, monkeypatch):
    """Decode rows over an 8-bit cache give, bit for bit, what the same path gives over a bf16
    cache holding the dequantized numbers: torch SDPA, and the kernel with its AMX scores (where
    the CPU has AMX) and with its vdpbf16ps ones, on both sides of the kernel's work split: a
    short row alone (one KV head per work item), a row of two context chunks, and batches."""
    kernels = path != "torch"
    if kernels and not genserve_kernels.int8_kv_decode_available():
        pytest.skip(NO_INT8_DECODE_KERNEL)
    monkeypatch.setenv("GENSERVE_DECODE_AMX", "0" if path == "kernels-vdpbf16ps" else "1")
    cache8 = random_int8_cache(200, seed=4)
    cache16 = dequantize_kv(cache8, torch.bfloat16)
    contexts = [1, 5, 16, 17, 64, 100, 300, 513, 700, 1100]
    tables = contexts_and_tables(contexts)
    q = torch.randn(len(contexts), H, HD, generator=torch.Generator().manual_seed(5)).bfloat16()
    for rows in ([4], [6], [0, 3, 9], list(range(10))):
        spans = [(contexts[i] - 1, 1, tables[i], True) for i in rows]
        outs = []
        for cache in (cache8, cache16):
            gather = None if kernels else GatherBuffer()
            meta = step_metadata(spans, BS, torch.bfloat16, kernels, gather)
            outs.append(meta.backend.attend(q[rows], cache, meta))
        assert torch.equal(outs[0], outs[1]), f"rows {rows}"
        assert outs[0].isfinite().all()


@pytest.mark.parametrize("start,length", [(0, 64), (86, 64), (190, 1)])
def test_prefill_pieces_read_int8_rows_as_the_bf16_cache_of_their_numbers(kernels, start, length):
    cache8 = random_int8_cache(40, seed=6)
    cache16 = dequantize_kv(cache8, torch.bfloat16)
    table = list(range(20, 20 + -(-(start + length) // BS)))
    q = torch.randn(length, H, HD, generator=torch.Generator().manual_seed(7)).bfloat16()
    meta = step_metadata([(start, length, table, False)], BS, torch.bfloat16, kernels)
    assert torch.equal(meta.backend.attend(q, cache8, meta), meta.backend.attend(q, cache16, meta))


def test_decode_row_bits_do_not_depend_on_the_batch(kernels):
    if kernels and not genserve_kernels.int8_kv_decode_available():
        pytest.skip(NO_INT8_DECODE_KERNEL)
    cache8 = random_int8_cache(320, seed=8)
    contexts = [5, 17, 64, 65, 100, 300, 513, 700, 1100, 1500]
    tables = contexts_and_tables(contexts)
    q = torch.randn(len(contexts), H, HD, generator=torch.Generator().manual_seed(9)).bfloat16()
    gather = None if kernels else GatherBuffer()

    def decode(rows: list[int]) -> torch.Tensor:
        spans = [(contexts[i] - 1, 1, tables[i], True) for i in rows]
        meta = step_metadata(spans, BS, torch.bfloat16, kernels, gather)
        return meta.backend.attend(q[rows], cache8, meta)

    together = decode(list(range(10)))
    for i in range(10):
        assert torch.equal(decode([i])[0], together[i])


def test_store_kv_quantizes_into_an_int8_cache():
    cache = torch.zeros(2, 4, BS, KVH, ROW, dtype=torch.int8)
    k = torch.randn(3, KVH, HD).bfloat16()
    v = torch.randn(3, KVH, HD).bfloat16()
    store_kv(k, v, cache, torch.tensor([0, 17, 63]))
    rows = cache.view(2, -1, KVH, ROW)
    assert torch.equal(rows[0, [0, 17, 63]], quantize_kv(k))
    assert torch.equal(rows[1, [0, 17, 63]], quantize_kv(v))


@pytest.fixture(scope="module")
def int8_engine(gguf_weights):
    from engine.config import EngineConfig
    from engine.runner.builder import engine_from_weights

    args, state = gguf_weights
    return engine_from_weights(EngineConfig(num_blocks=1024, kv_cache_dtype="int8"), args, state)


@pytest.mark.slow
def test_int8_engine_tokens_are_identical_alone_and_in_a_batch(int8_engine, gguf_tokenizer):
    assert int8_engine.executor.kv.layers[0].dtype == torch.int8
    prompts = mixed_prompts(gguf_tokenizer)
    alone = [generate(int8_engine, [p], 16, temperature=0.0, ignore_eos=True)[0] for p in prompts]
    together = generate(int8_engine, prompts, 16, temperature=0.0, ignore_eos=True)
    assert together == alone


@pytest.mark.slow
def test_int8_cache_keeps_the_bf16_cache_next_token_and_logits_close(int8_engine, bf16_engine,
                                                                     gguf_tokenizer):
    """Parity with the bf16 cache, teacher-forced: both engines read the same token sequence
    (a prompt and the bf16 engine's greedy answer), and at every position the 8-bit cache's
    logits stay close and its most likely token is the same at ≥ 95 % of positions."""
    prompts = mixed_prompts(gguf_tokenizer)[:4] + mixed_prompts(gguf_tokenizer)[-1:]
    answers = generate(bf16_engine, prompts, 48, temperature=0.0, ignore_eos=True)
    agree = total = 0
    worst = 0.0
    for prompt, answer in zip(prompts, answers):
        ids = torch.tensor(prompt + answer)
        logits = []
        for engine in (bf16_engine, int8_engine):
            ex = engine.executor
            table = list(range(-(-len(ids) // 16)))
            meta = step_metadata([(0, len(ids), table, False)], 16, ex.model.dtype,
                                           ex.kernels)
            # a private cache of the blocks this pass needs: the engine's own pool holds blocks
            # its prefix cache still serves to later requests (the session's other tests)
            cache = [torch.zeros_like(layer[:, :len(table)]) for layer in ex.kv.layers]
            with torch.inference_mode():
                hidden = ex.model(ids, torch.arange(len(ids)), cache, meta, ex.layer_ops)
                logits.append(ex.model.logits(hidden[len(prompt) - 1:]))
        agree += (logits[0].argmax(-1) == logits[1].argmax(-1)).sum().item()
        total += len(answer) + 1
        probs = [lg.softmax(-1) for lg in logits]
        worst = max(worst, (probs[0] - probs[1]).abs().sum(-1).max().item() / 2)
    print(f"8-bit vs bf16 cache: top-1 agreement {agree}/{total}, largest total variation {worst:.3f}")
    assert agree >= 0.95 * total
    assert worst < 0.25


@pytest.mark.slow
def test_int8_preempted_requests_produce_the_tokens_of_an_unpreempted_run(gguf_weights, gguf_tokenizer,
                                                                          int8_engine):
    check_preemption_keeps_tokens(int8_engine, gguf_weights, mixed_prompts(gguf_tokenizer)[:6],
                                  kv_cache_dtype="int8")


def test_int8_cache_refuses_backends_that_read_numbers(gguf_weights):
    from engine.runner.builder import model_from_weights
    from engine.runner.model_runner import ModelRunner

    args, state = gguf_weights
    model = model_from_weights(args, state, torch.bfloat16)
    kv = KVCache(args, 8, 16, torch.int8)
    with pytest.raises(ValueError, match="cpu or sdpa"):
        ModelRunner(model, kv, attention="flex")
    with pytest.raises(ValueError, match="CUDA graphs"):
        ModelRunner(model, kv, cuda_graphs=True)


def test_kv_cache_dtype_setting_is_checked():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
