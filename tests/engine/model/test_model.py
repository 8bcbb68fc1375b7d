"""The real model through the real engine: parity with transformers, batch invariance, seeds,
and block accounting."""

from __future__ import annotations

import pytest
import torch

from engine.model.layer_ops import KernelLayerOps, TorchLayerOps
from tests.engine.attention_oracle import step_metadata
from engine.runner.kv_cache import KVCache
from tests.engine.conftest import check_preemption_keeps_tokens, generate, new_request

PARAGRAPH = ("Continuous batching rebuilds the batch at every decode step, so a short answer "
             "leaves as soon as it ends and a new request joins at the next step. ")


def mixed_prompts(tokenizer) -> list[list[int]]:
    """8 prompts of mixed lengths; the last is over 600 tokens, so its prefill is chunked."""
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
             "List three colours:\n1.", "日本の首都は", "Translate to German: good morning",
             PARAGRAPH * 3 + "Summarise:", PARAGRAPH * 22 + "In one sentence:"]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len(prompts[-1]) > 600
    return prompts


@pytest.mark.slow
def test_logits_and_greedy_tokens_match_transformers(fp32_engine, hf_reference_model, gguf_tokenizer,
                                                     kernels):
    hf, _ = hf_reference_model
    prompt = gguf_tokenizer.encode(PARAGRAPH + "The capital of France is")[:32]
    assert len(prompt) == 32
    executor = fp32_engine.executor
    ids = torch.tensor(prompt)
    with torch.inference_mode():
        meta = step_metadata([(0, 32, [0, 1], False)], 16, executor.model.dtype, kernels)
        ops = KernelLayerOps if kernels else TorchLayerOps
        ours = executor.model.logits(executor.model(ids, torch.arange(32), executor.kv.layers, meta, ops))
        ref = hf(ids[None]).logits[0].float()
        diff = (ours - ref).abs().max().item()
        print(f"parity ({'kernels' if kernels else 'torch ops'}): max |logit difference| over "
              f"32 positions = {diff:.3e}")
        assert diff < 1e-3
        ref_tokens = hf.generate(ids[None], max_new_tokens=32, do_sample=False,
                                 attention_mask=torch.ones(1, 32, dtype=torch.long))[0, 32:].tolist()
    saved, executor.kernels = executor.kernels, kernels           # the engine on this path too
    try:
        [ours_tokens] = generate(fp32_engine, [prompt], 32, temperature=0.0, ignore_eos=True)
    finally:
        executor.kernels = saved
    assert ours_tokens == ref_tokens


@pytest.mark.slow
def test_greedy_tokens_identical_alone_and_in_a_batch(bf16_engine, gguf_tokenizer):
    prompts = mixed_prompts(gguf_tokenizer)
    alone = [generate(bf16_engine, [p], 24, temperature=0.0, ignore_eos=True)[0] for p in prompts]
    together = generate(bf16_engine, prompts, 24, temperature=0.0, ignore_eos=True)
    assert together == alone
    assert all(len(t) == 24 for t in alone) and len({tuple(t) for t in alone}) >= 6


@pytest.mark.slow
def test_seeded_sampling_repeats_alone_and_in_batch_and_seeds_differ(bf16_engine, gguf_tokenizer):
    prompts = mixed_prompts(gguf_tokenizer)
    settings = dict(temperature=0.9, top_k=50, top_p=0.95, ignore_eos=True)
    first = generate(bf16_engine, [prompts[2]], 20, seed=1234, **settings)[0]
    again = generate(bf16_engine, [prompts[2]], 20, seed=1234, **settings)[0]
    other = generate(bf16_engine, [prompts[2]], 20, seed=1235, **settings)[0]
    batch = [new_request(p, 20, seed=1234 if i == 2 else 77 + i, **settings)
             for i, p in enumerate(prompts[:6])]
    for r in batch:
        bf16_engine.submit(r)
    bf16_engine.run_until_idle()
    assert first == again
    assert batch[2].generated == first
    assert other != first


def test_blocks_return_to_the_pool_after_mixed_run_with_cancels(bf16_engine, gguf_tokenizer):
    pool = bf16_engine.pool
    prompts = mixed_prompts(gguf_tokenizer)
    events: list = []
    reqs = [new_request(p, 8 + 4 * i, events, temperature=0.7, seed=i) for i, p in enumerate(prompts)]
    for r in reqs:
        bf16_engine.submit(r)
    for _ in range(3):
        bf16_engine.step()
    assert pool.num_free < pool.num_blocks
    bf16_engine.cancel(reqs[0].request_id)          # decoding
    bf16_engine.cancel(reqs[7].request_id)          # still in chunked prefill
    bf16_engine.run_until_idle()
    assert pool.num_free == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
    pool.check_all_free()
    finals = {e.request_id: e.finish_reason.value for e in events if e.finish_reason}
    assert finals[reqs[0].request_id] == "cancelled" and finals[reqs[7].request_id] == "cancelled"
    assert len(finals) == len(reqs)


@pytest.mark.slow
def test_preempted_requests_produce_the_tokens_of_an_unpreempted_run(gguf_weights, gguf_tokenizer, bf16_engine):
    check_preemption_keeps_tokens(bf16_engine, gguf_weights, mixed_prompts(gguf_tokenizer)[:6])


def test_decode_step_in_cpp_gives_the_python_loop_bits(bf16_engine, gguf_tokenizer):
    """`torch.ops.genserve.decode_layers` (a pure-decode step's blocks in one C++ call) against
    the Python loop over the same kernels: identical hidden states, at 1 row and at 5."""
    model = bf16_engine.executor.model
    loop = bf16_engine.executor.decode_loop
    if loop is None:
        pytest.skip("no C++ decode loop here: genserve's CPU kernels are not built, the weights are "
                    "not packed, or they run as oneDNN in fixed-size calls, which the loop does not do")
    check_decode_loop_bits(model, loop, mixed_prompts(gguf_tokenizer)[:5])


def check_decode_loop_bits(model, loop, prompts: list[list[int]]) -> None:
    """Prefill each prompt but its last token with the Python loop (`KernelLayerOps`), then a
    decode step of its last token for row 0 alone and for every row: the C++ loop's (`loop`, a
    `DecodeLoop` of `model`) final hidden states and the K/V it stores equal the Python loop's
    bit for bit. One KV group (a model without sliding layers)."""
    kv = KVCache(model.args, 64, 16, torch.bfloat16)
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(len(prompts))]
    with torch.inference_mode():
        for p, table in zip(prompts, tables):              # prefill each prompt but its last token
            meta = step_metadata([(0, len(p) - 1, table, False)], 16, torch.bfloat16, True)
            model(torch.tensor(p[:-1]), torch.arange(len(p) - 1), kv.layers, meta, KernelLayerOps)
        for rows in ([0], list(range(len(prompts)))):
            spans = [(len(prompts[i]) - 1, 1, tables[i], True) for i in rows]
            meta = step_metadata(spans, 16, torch.bfloat16, True)
            ids = torch.tensor([prompts[i][-1] for i in rows])
            pos = torch.tensor([len(prompts[i]) - 1 for i in rows])
            cpp_kv = [layer.clone() for layer in kv.layers]
            in_cpp = loop.run(model, ids, pos, cpp_kv, meta)
            in_python = model(ids, pos, kv.layers, meta, KernelLayerOps)
            assert torch.equal(in_cpp, in_python), f"{len(rows)} rows"
            assert all(torch.equal(a, b) for a, b in zip(cpp_kv, kv.layers)), f"{len(rows)} rows: K/V"
