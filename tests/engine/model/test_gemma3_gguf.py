"""A real published model beside the embedded one: Google's Gemma 3 270M (base) as a Q4_K_M GGUF
(Q8_0, Q5_0, Q4_K, Q6_K and F32 tensors; `tests/gguf_assets.gemma3_270m_gguf`), served by
genserve's engine and compared with transformers reading the same file (`gguf_file=`).

Checked: through the real engine (scheduler, paged KV pool, sampler), 8 prompts × 64 greedy
tokens in one batch with their top-5 logprobs, against transformers' fp32 forward teacher-forced
on the same text: greedy tokens agree under vLLM's `check_logprobs_close` rule (identical until a
near tie, where each side's token is in the other's top 5), and the logprob genserve reports for
each token agrees with transformers' up to the first divergence.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.model.weights import load_gguf
from engine.runner.builder import engine_from_weights
from tests.engine.model.test_model_families import check_logprobs_close, run
from tests.gguf_assets import gemma3_270m_reader, gemma3_270m_transformers

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which",
    "La ville de Montréal est connue pour",
    "1, 2, 3, 5, 8, 13,",
    "The three laws of thermodynamics state that",
    "東京は日本の",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def weights():
    """``load_gguf`` of the Gemma 3 270M file in fp32, read once for this module's two tests
    (which must not modify the tensors in place)."""
    return load_gguf(gemma3_270m_reader())


def test_gemma3_270m_gguf_greedy_and_logprobs_match_transformers_on_the_same_file(weights):
    hf, tokenizer = gemma3_270m_transformers()
    args, state = weights
    assert (args.architecture, args.n_layers, args.dim, args.head_dim) == ("Gemma3ForCausalLM", 18, 640, 256)
    assert [layer.sliding_window for layer in args.layers[:6]] == [512] * 5 + [None]
    engine = engine_from_weights(EngineConfig(device="cpu", dtype="float32", num_blocks=320,
                                              queue_budget_s=1e6), args, state)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert all(p[0] == 2 for p in prompts)                       # <bos>, as the file asks
    answers = run(engine, prompts, NEW_TOKENS, top_logprobs=5)
    diverged = 0
    worst = 0.0
    for prompt, answer in zip(prompts, answers):
        assert len(answer.tokens) == NEW_TOKENS
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + answer.tokens]), use_cache=False).logits[0]
        ref = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:-1]     # scores token i
        ref_tokens = ref.argmax(-1).tolist()
        ref_top = [dict(zip(*(x.tolist() for x in row.topk(5)))) for row in ref]
        ref_top = [{i: v for i, v in zip(row.topk(5).indices.tolist(), row.topk(5).values.tolist())}
                   for row in ref]
        check_logprobs_close(answer.tokens, answer.top, ref_tokens, ref_top)
        same = next((i for i, (a, b) in enumerate(zip(answer.tokens, ref_tokens)) if a != b), NEW_TOKENS)
        diverged += same < NEW_TOKENS
        for i in range(same):
            worst = max(worst, abs(answer.logprobs[i] - ref[i, answer.tokens[i]].item()))
    print(f"Gemma 3 270M: {diverged} of {len(PROMPTS)} prompts diverged at a near tie; "
          f"max |logprob difference| before divergence {worst:.2e}")
    assert worst < 1e-3, worst
    assert diverged <= 2


def test_gemma3_270m_gguf_runs_every_matrix_from_its_own_blocks(weights):
    """`--weights q4q8` on the published file: its Q5_0 q/k/gate/up (fused with the Q8_0 v) and
    the Q8_0 tied output matrix run `q8q8_linear` (Q5_0 blocks converted exactly to Q8_0: they
    dequantize to the bf16 weights the loader built), its Q4_K / Q6_K attention-output and down
    projections `qk_linear`; no matrix stays bf16."""
    from engine import kernels
    from engine.model import gguf_blocks
    from engine.model.linear import Q8Q8Method, QKMethod, choose_method
    from engine.model.quant import q8_0_dequantize
    from engine.runner.builder import model_from_weights

    if not kernels.q4q8_linear_available():
        pytest.skip("q8q8_linear needs AVX512-VNNI or AVX2")
    reader = gemma3_270m_reader()
    args, state = weights
    model = model_from_weights(args, state, torch.bfloat16)
    counts = gguf_blocks.attach_gguf_blocks(model, reader)
    assert counts == {"q4q8": 0, "q8q8": 36, "qk": 36, "bf16": 0}
    assert isinstance(choose_method(model.output_packed), Q8Q8Method)
    fused = gguf_blocks._fused_parts(gguf_blocks.gguf_layer_blocks(reader), model)
    for module, name, parts in fused:
        method = choose_method(getattr(module, name + "_packed"))
        assert isinstance(method, Q8Q8Method if name in ("wqkv", "w13") else QKMethod), name
    mixed = [(m, n, p) for m, n, p in fused if {k for k, _ in p} == {gguf_blocks.Q5_0, gguf_blocks.Q8_0}]
    assert len(mixed) == 9                          # q/k/v of Q5_0, Q5_0 and Q8_0 parts
    for module, name, parts in (mixed[0], fused[2]):   # and layer 0's gate/up, all Q5_0
        blocks = torch.cat([gguf_blocks.as_q8_0(b, kind) for kind, b in parts])
        assert torch.equal(q8_0_dequantize(blocks).to(torch.bfloat16), getattr(module, name)), name
