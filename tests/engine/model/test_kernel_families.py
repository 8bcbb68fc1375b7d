"""genserve's fused CPU kernel path (`KernelLayerOps` and the "cpu-kernels" decode attention,
`paged_decode_window`) on blocks beyond the plain Llama one: Gemma 3 at head_dim 256 (q/k norms,
sandwich norms, GELU, another score scale, sliding windows, 4 query heads per KV head), Qwen3 and
Qwen3-MoE at head_dim 128, Qwen2 (biases) and Llama 3 (RoPE scaling) at head_dim 64. Tiny random transformers checkpoints (tests/engine/hf_families.py)
with those head sizes:

* the runner chooses the kernel path for them (it chose torch ops and SDPA before);
* fp32 logits over prefill pieces and decode steps within 1e-4 of transformers', on that path;
* through the engine, greedy tokens and logprobs equal to transformers' teacher-forced ones
  (1e-4), and in bf16 a request's tokens and logprobs the same alone and in a batch;
* in bf16 the C++ decode loop runs their pure-decode steps (not the MoE model's) with the
  Python block loop's bits.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.model.layer_ops import KernelLayerOps
from engine.runner.model_runner import kernel_layers
from tests.engine.hf_families import build_checkpoint, reference_logits
from tests.engine.model.test_model_families import (engine, max_logit_difference_over_pieces_and_decode_steps,
                                                     run, tokens)

CASES = {
    "gemma3_hd256": ("gemma3", dict(head_dim=256, num_key_value_heads=1)),
    "qwen3_hd128": ("qwen3", dict(head_dim=128)),
    "qwen3_moe_hd128": ("qwen3_moe", dict(head_dim=128)),
    # head_dim 64 with options beyond the plain Llama block, which took the torch ops before:
    # q/k/v biases (Qwen2), Llama 3's RoPE scaling
    "qwen2_hd64": ("qwen2", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=64)),
    "llama3_hd64": ("llama3", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=64)),
}


@pytest.fixture(autouse=True)
def _kernels_built():
    if not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?)")


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> tuple[str, pathlib.Path]:
    family, overrides = CASES[request.param]
    return request.param, build_checkpoint(family, tmp_path_factory.mktemp(request.param), **overrides)


def test_the_runner_chooses_the_kernel_path(checkpoint):
    _, directory = checkpoint
    for dtype in ("float32", "bfloat16"):
        executor = engine(directory, dtype).executor
        assert kernel_layers(executor.model.args, executor.model.dtype)
        assert executor.kernels and executor.attention.name == "cpu-kernels"
        assert executor.layer_ops is KernelLayerOps
        # packed bf16 weights only; a mixture of experts' bf16 experts through packed_linear_grouped
        loop = dtype == "bfloat16" and (executor.model.args.moe is None
                                        or genserve_kernels.packed_linear_grouped_available())
        assert (executor.decode_loop is not None) == loop


def test_kernel_path_logits_match_transformers(checkpoint):
    name, directory = checkpoint
    diff = max_logit_difference_over_pieces_and_decode_steps(directory, kernels=True)
    print(f"{name} (kernel path): max |logit difference| over 40 positions = {diff:.2e}")
    assert diff < 1e-4, diff


def test_engine_greedy_matches_transformers_on_the_kernel_path(checkpoint):
    _, directory = checkpoint
    prompt = tokens(70, seed=2)
    e = engine(directory)
    assert e.executor.kernels
    first = run(e, [prompt] + [tokens(n, seed=10 + n) for n in (5, 33, 90)])[0]
    ref = torch.log_softmax(reference_logits(directory, prompt + first.tokens), dim=-1)
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(first.tokens))
    assert first.tokens == [int(ref[p].argmax()) for p in positions]
    want = [ref[p, t].item() for p, t in zip(positions, first.tokens)]
    assert max(abs(a - b) for a, b in zip(first.logprobs, want)) < 1e-4


def test_bf16_kernel_path_is_batch_invariant(checkpoint):
    _, directory = checkpoint
    e = engine(directory, "bfloat16")
    assert e.executor.kernels
    prompt = tokens(50, seed=3)
    alone = run(e, [prompt], max_tokens=12)[0]
    batch = run(e, [tokens(9, seed=5), prompt, tokens(80, seed=6)], max_tokens=12)[1]
    assert (alone.tokens, alone.logprobs) == (batch.tokens, batch.logprobs)


class CountingLoop:
    """A `DecodeLoop` that counts the steps it ran."""

    def __init__(self, loop) -> None:
        self.loop, self.calls = loop, 0

    def accepts(self, lora) -> bool:
        return self.loop.accepts(lora)

    def run(self, *args, **kwargs):
        self.calls += 1
        return self.loop.run(*args, **kwargs)


def test_cpp_decode_loop_gives_the_python_loop_bits(checkpoint):
    """The same requests (prompts past the sliding window, several KV groups for Gemma 3) with the
    C++ decode loop and with the Python block loop: equal tokens and logprobs, bit for bit, and
    for the mixture of experts the same expert load counted."""
    name, directory = checkpoint
    e = engine(directory, "bfloat16", prefix_caching=False)    # both runs route every prompt token
    if e.executor.decode_loop is None:
        assert e.executor.model.args.moe is not None and not genserve_kernels.packed_linear_grouped_available()
        pytest.skip("bf16 experts in the C++ decode loop need packed_linear_grouped (AVX512-BF16)")
    prompts = [tokens(50, seed=3), tokens(9, seed=5), tokens(80, seed=6)]
    loads = []
    for decode_loop in (CountingLoop(e.executor.decode_loop), None):
        e.executor.decode_loop = decode_loop
        before = [torch.tensor(rows) for _, rows in e.executor.expert_load()]
        answers = run(e, prompts, max_tokens=12)
        loads.append([torch.tensor(rows) - b for (_, rows), b in zip(e.executor.expert_load(), before)])
        if decode_loop is not None:
            assert decode_loop.calls >= 10, decode_loop.calls
            in_cpp = answers
    for a, b in zip(in_cpp, answers):
        assert (a.tokens, a.logprobs, a.top) == (b.tokens, b.logprobs, b.top), name
    assert all(torch.equal(x, y) for x, y in zip(*loads))
    if e.executor.model.args.moe is not None:
        assert sum(int(x.sum()) for x in loads[0]) > 0
