"""int8 arithmetic for the block matrices (`--weights int8`, engine/model/int8.py): exact integer
sums, rows independent of the batch, within one rounding of the dequantized product, outlier
channels chosen by the fixed calibration run, and an engine that serves it."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from engine.config import EngineConfig
from engine.core.request import Request, SamplingParams
from engine import kernels
from engine.model.int8 import (QMAX, Int8Weight, int8_exact, int8_linear, int8_linear_torch,
                               quantize_rows, quantize_weight)
from engine.model.int8_weights import OUTLIERS, attach_int8
from engine.model.transformer import block_matrices
from engine.model.linear import linear
from engine.runner.builder import (attach_weights, engine_from_model, int8_calibration,
                                   model_from_weights)
from engine.runner.decode_loop import DecodeLoop
from engine.runner.int8_calibration import CALIBRATION_TOKENS, calibration_tokens, topics_text
from engine.runner.invariance import check_batch_invariance
from genserve.common.model_source import parse_model_source
from tests.engine.conftest import generate
from tests.engine.model.test_model import mixed_prompts


def random_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)


def dequantized_reference(x: torch.Tensor, w: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 product of the quantized input (as `int8_linear` quantizes it) and the
    dequantized weight, what `int8_linear` computes before its fp32 scaling and bf16 rounding;
    and the same over absolute values (the size of the terms its fp32 sum rounds)."""
    outliers = w.outliers
    main = x.index_fill(1, outliers, 0) if outliers.numel() else x
    xq, xs = quantize_rows(main)
    parts = [(xq.double() * xs.double(), w.q.double().t())]
    if outliers.numel():
        oq, os_ = quantize_rows(x[:, outliers])
        parts.append((oq.double() * os_.double(), w.outlier_q.double()))
    y = sum(a @ b for a, b in parts) * w.scale.double()
    size = sum((a @ b).abs() for a, b in parts) * w.scale.double()
    return y, size


def test_int_mm_sums_are_exact_here():
    assert int8_exact(960, 576) and int8_exact(576, 1536)


def test_weight_quantization_keeps_outlier_columns_apart():
    w = random_weight(128, 96, 0)
    outliers = torch.tensor([90, 3, 40])
    q = quantize_weight(w, outliers)
    assert q.outliers.tolist() == [3, 40, 90]
    assert q.q[:, [3, 40, 90]].abs().sum() == 0
    full = quantize_weight(w)
    assert torch.equal(q.outlier_q, full.q[:, [3, 40, 90]].t())
    assert torch.equal(q.q.index_fill(1, q.outliers, 0), full.q.index_fill(1, q.outliers, 0))
    # every row reaches ±127 at its largest weight, and dequantizes to within half a level
    assert torch.equal(full.q.abs().amax(dim=1), torch.full((128,), QMAX, dtype=torch.int8))
    err = (full.q.float() * full.scale[:, None] - w.float()).abs()
    assert bool((err <= full.scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("outliers, bound", [(None, 0.05), (torch.tensor([5, 17, 200]), 0.01)])
def test_int8_product_is_one_rounding_from_the_dequantized_product(outliers, bound):
    w = quantize_weight(random_weight(192, 256, 1), outliers)
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[:, 17] *= 40                                           # an outlier channel
    got = int8_linear_torch(x, w).double()
    want, size = dequantized_reference(x, w)
    # one bf16 rounding (2^-8 relative) after a few fp32 roundings of the terms (2^-24 each)
    assert bool(((got - want).abs() <= want.abs() * 2 ** -8 + size * 2 ** -21).all())
    if kernels.available():
        # the kernel: the same up to the last bit and a level at an input's rounding ties
        kernel = int8_linear(x, w).double()
        assert ((kernel - got).norm() / got.norm()).item() < 2 ** -9
        assert ((kernel - got).abs() > got.abs() * 2 ** -7 + 1e-6).float().mean() < 0.01
    exact = x.double() @ random_weight(192, 256, 1).double().t()
    rel = ((got - exact).norm() / exact.norm()).item()
    assert rel < bound, f"int8 product {rel:.3%} from the exact one"


def test_outlier_channels_make_the_product_closer_when_a_channel_is_large():
    weight = random_weight(192, 256, 3)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[:, 7] *= 60
    exact = x.double() @ weight.double().t()
    plain = int8_linear(x, quantize_weight(weight)).double()
    apart = int8_linear(x, quantize_weight(weight, torch.tensor([7, 8]))).double()
    assert (apart - exact).norm() < 0.5 * (plain - exact).norm()


@pytest.mark.parametrize("block", [0, 32])
def test_int8_rows_do_not_depend_on_the_batch(block):
    outliers = None if block else torch.tensor([1, 100])
    w = quantize_weight(random_weight(320, 192, 5), outliers, block=block)
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(64, 192, generator=g).to(torch.bfloat16)
    alone = torch.cat([int8_linear(rows[i:i + 1], w) for i in range(64)])
    for m in (2, 7, 64):
        assert torch.equal(int8_linear(rows[:m], w), alone[:m])
    other = torch.randn(64, 192, generator=g).to(torch.bfloat16)
    other[10] = rows[10]
    assert torch.equal(int8_linear(other, w)[10], alone[10])


def test_blocks_of_32_scale_each_block_alone():
    weight = random_weight(64, 128, 7)
    w = quantize_weight(weight, block=32)
    assert w.scale.shape == (64, 4)
    blocks = weight.float().view(64, 4, 32).abs().amax(dim=2) * (1 / QMAX)
    assert torch.equal(w.scale, blocks)
    with pytest.raises(ValueError, match="multiple"):
        quantize_weight(random_weight(64, 100, 8), block=32)


def test_exact_weights_round_only_the_input_blocks():
    weight = random_weight(48, 96, 9)
    w = quantize_weight(weight, block=32, exact=True)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    blocks = x.float().view(5, 3, 32)
    scale = blocks.abs().amax(dim=2, keepdim=True) * (1 / QMAX)
    rounded = (torch.round(blocks * scale.reciprocal()) * scale).view(5, 96)
    expected = (rounded @ weight.float().t()).to(torch.bfloat16)
    assert torch.allclose(int8_linear(x, w).float(), expected.float(), rtol=1e-2, atol=1e-3)
    assert not torch.equal(int8_linear(x, w), (x.float() @ weight.float().t()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="only for scale blocks"):
        quantize_weight(weight, exact=True)


@pytest.fixture(scope="module")
def int8_model(gguf_weights, gguf_tokenizer):
    args, state = gguf_weights
    model = model_from_weights(args, state, torch.bfloat16)
    attach_int8(model, int8_calibration(model, gguf_tokenizer))
    return model


@pytest.fixture(scope="module")
def int8_engine(int8_model):
    return engine_from_model(EngineConfig(num_blocks=1024, prefix_caching=False), int8_model)


def test_calibration_text_is_fixed_and_apart_from_the_start_of_the_topics(gguf_tokenizer):
    ids = calibration_tokens(gguf_tokenizer.encode_text)
    assert len(ids) == CALIBRATION_TOKENS
    assert ids == gguf_tokenizer.encode_text(topics_text())[-CALIBRATION_TOKENS:]
    assert len(gguf_tokenizer.encode_text(topics_text())) > 20 * CALIBRATION_TOKENS


@pytest.mark.slow
def test_calibration_chooses_the_same_outliers_every_time(int8_model, gguf_weights,
                                                          gguf_tokenizer):
    args, state = gguf_weights
    again = model_from_weights(args, state, torch.bfloat16)
    attach_weights("int8", again, parse_model_source(None), gguf_tokenizer)
    for (m1, n1), (m2, n2) in zip(block_matrices(int8_model), block_matrices(again)):
        a, b = getattr(m1, n1 + "_packed").i8, getattr(m2, n2 + "_packed").i8
        assert a.outliers.numel() == OUTLIERS and a.observed is None
        assert torch.equal(a.outliers, b.outliers) and torch.equal(a.q, b.q)


def test_int8_model_runs_every_block_product_on_int8(int8_model):
    loop = DecodeLoop.from_model(int8_model)
    assert loop is not None and len(loop.i8) == 16 * len(int8_model.layers) and not loop.q4
    attn = int8_model.layers[3].attention
    x = torch.randn(5, attn.wqkv.shape[1]).to(torch.bfloat16)
    assert torch.equal(linear(x, attn.wqkv, attn.wqkv_packed), int8_linear(x, attn.wqkv_packed.i8))
    assert int8_model.output_packed is None or int8_model.output_packed.i8 is None


def test_int8_decode_loop_gives_the_python_loops_tokens(int8_engine, gguf_tokenizer):
    from tests.engine.conftest import check_decode_loop_matches_python_loop
    assert int8_engine.executor.decode_loop.i8                          # the C++ loop runs int8
    check_decode_loop_matches_python_loop(int8_engine, mixed_prompts(gguf_tokenizer))


def test_int8_engine_is_batch_invariant(int8_engine):
    result = check_batch_invariance(int8_engine, batch=12, max_tokens=8, checked=3)
    assert result.identical, f"rows {result.mismatched} differ at {result.first_difference}"
    assert result.distinct > 1


def prompt_logprob_ppl(engine, ids: list[int]) -> float:
    req = Request("ppl", "test", ids, 1, SamplingParams(temperature=0.0, prompt_logprobs=0),
                  0.0, 0.0)
    engine.submit(req)
    engine.run_until_idle()
    return math.exp(-statistics.fmean(lp for lp, _ in req.prompt_logprob_entries))


def test_int8_engine_stays_close_to_the_bf16_engine(int8_engine, bf16_engine, gguf_tokenizer):
    ids = gguf_tokenizer.encode_text(topics_text())[:512]
    ref, got = prompt_logprob_ppl(bf16_engine, ids), prompt_logprob_ppl(int8_engine, ids)
    assert ref < 40                                            # the text is English prose
    assert abs(got / ref - 1) < 0.03, f"int8 perplexity {got:.3f} against bf16 {ref:.3f}"
    prompts = mixed_prompts(gguf_tokenizer)
    ours, theirs = (generate(e, prompts, 8, temperature=0.0) for e in (int8_engine, bf16_engine))
    first = sum(a[0] == b[0] for a, b in zip(ours, theirs))
    assert first >= len(prompts) - 1, f"first tokens agree on {first} of {len(prompts)} prompts"


def test_int8_weights_need_the_cpu():
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int4")
    assert EngineConfig(weights="int8").weights == "int8"
