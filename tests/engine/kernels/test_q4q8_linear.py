"""`torch.ops.genserve.q4q8_linear` (engine/kernels/csrc/q4q8_linear.cpp): Q4_1 weights × bf16
activations rounded to int8 per row and block of 32 (ggml's Q8_1), on AVX512-VNNI or AVX2
(whichever this host's build has; both run the same operations in the same order). Against a
reference in torch ops (the blocks dequantized exactly, x rounded the same way, the product in
fp64) on random blocks at SmolLM2's shapes and on the embedded model's real first-layer blocks;
a row's bits do not depend on the batch nor on the threads;
zero rows and blocks give zeros; bad shapes raise."""

from __future__ import annotations

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.model.quant import q4_1_dequantize, q4q8_linear_reference, q4q8_pack, q8_1_round
from engine.model.weights import Q4_1_BLOCK_BYTES, load_gguf_q4_1

SHAPES = [(1536, 576), (576, 1536), (3072, 576)]     # SmolLM2-135M's N × K
ROWS = (1, 3, 32, 100)


@pytest.fixture(scope="module", autouse=True)
def vnni():
    if not genserve_kernels.q4q8_linear_available():
        pytest.skip("q4q8_linear runs only where the kernels build for AVX512-VNNI and "
                    "AVX512-BF16, or for AVX2 and FMA")


def random_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_1 blocks [n, k / 32 · 20] with d, m in a GGUF's ranges (m ≈ -8 d)."""
    g = torch.Generator().manual_seed(seed)
    kb = k // 32
    d = (torch.rand(n, kb, generator=g) * 0.01 + 0.001).half()
    m = (-8 * d.float() * (0.8 + 0.4 * torch.rand(n, kb, generator=g))).half()
    nib = torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.uint8)
    return torch.cat([d.view(torch.uint8).view(n, kb, 2), m.view(torch.uint8).view(n, kb, 2), nib],
                     dim=-1).reshape(n, kb * Q4_1_BLOCK_BYTES).contiguous()


def random_x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor,
                              reference=q4q8_linear_reference, dequantize=q4_1_dequantize) -> None:
    """y (bf16) is `reference(x, blocks)` rounded once to bf16, up to the fp32 accumulation's
    error: |y - ref| ≤ 2^-8 |ref| (bf16's half ulp, with room) + 1e-5 · Σ|terms| of the output
    (the weights from `dequantize(blocks)`); and nearly every output is the reference exactly."""
    ref = reference(x, blocks)
    # Σ |x_k w_nk|, the scale of the fp32 accumulation's rounding errors
    xq, scale = q8_1_round(x)
    xd = (xq.double().view(x.shape[0], -1, 32) * scale.double()[..., None]).view(x.shape[0], -1)
    mag = xd.abs() @ dequantize(blocks).abs().T
    err = (y.double() - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + mag * 1e-5
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"
    # and most outputs are exactly the reference rounded to bf16
    assert (y == ref.to(torch.bfloat16)).double().mean().item() > 0.99


def test_pack_layout():
    # q4q8_pack's bytes against the layout, element by element for one group and block
    blocks = random_blocks(32, 64, seed=9)
    packed = q4q8_pack(blocks).view(2, 2, 320)          # [group, kb, 320]
    b = blocks.view(32, 2, 20)
    for g, kb in ((0, 0), (1, 1)):
        blk = packed[g, kb]
        d = b[16 * g:16 * g + 16, kb, 0:2].contiguous().view(torch.float16).flatten()
        m = b[16 * g:16 * g + 16, kb, 2:4].contiguous().view(torch.float16).flatten()
        assert torch.equal(blk[:32].view(torch.float16), d)
        assert torch.equal(blk[32:64].view(torch.float16), m)
        for j in range(4):
            for c in range(16):
                for i in range(4):
                    byte = int(blk[64 + 64 * j + 4 * c + i])
                    src = b[16 * g + c, kb, 4:]
                    q = torch.cat([src & 0xF, src >> 4])
                    assert byte & 0xF == int(q[4 * j + i]) and byte >> 4 == int(q[16 + 4 * j + i])


@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference(n, k):
    blocks = random_blocks(n, k)
    packed = q4q8_pack(blocks)
    assert packed.shape == (n, k // 32 * 20) and packed.dtype == torch.uint8
    for m in ROWS:
        x = random_x(m, k, seed=m)
        y = torch.ops.genserve.q4q8_linear(x, packed, n)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert_close_to_reference(y, x, blocks)


@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_do_not_depend_on_the_batch(n, k):
    blocks = random_blocks(n, k, seed=2)
    packed = q4q8_pack(blocks)
    x = random_x(64, k, seed=3)
    alone = torch.cat([torch.ops.genserve.q4q8_linear(x[i:i + 1].contiguous(), packed, n)
                       for i in range(64)])
    for size in (2, 7, 64):
        batched = torch.cat([torch.ops.genserve.q4q8_linear(x[i:i + size].contiguous(), packed, n)
                             for i in range(0, 64, size)])
        assert torch.equal(batched, alone), f"batches of {size}"


@pytest.mark.parametrize("n,k", SHAPES)
def test_outputs_do_not_depend_on_the_threads(n, k, restore_threads):
    """Each output column is one thread's work from start to end, however the panels are split:
    1, 2, 3 and 8 threads, each called five times, give one thread's bits."""
    blocks = random_blocks(n, k, seed=4)
    packed = q4q8_pack(blocks)
    x = random_x(37, k, seed=5)
    torch.set_num_threads(1)
    one = torch.ops.genserve.q4q8_linear(x, packed, n)
    for count in (2, 3, 8):
        torch.set_num_threads(count)
        for call in range(5):
            assert torch.equal(torch.ops.genserve.q4q8_linear(x, packed, n), one), \
                f"{count} threads, call {call}"


def test_zero_rows_and_blocks_give_zeros():
    n, k = 576, 1536
    packed = q4q8_pack(random_blocks(n, k, seed=4))
    x = random_x(5, k, seed=5)
    x[1] = 0
    y = torch.ops.genserve.q4q8_linear(x, packed, n)
    assert torch.equal(y[1], torch.zeros(n, dtype=torch.bfloat16))
    assert torch.ops.genserve.q4q8_linear(torch.zeros(3, k, dtype=torch.bfloat16), packed, n) \
        .eq(0).all()
    zero_w = q4q8_pack(torch.zeros(n, k // 32 * 20, dtype=torch.uint8))
    assert torch.ops.genserve.q4q8_linear(x, zero_w, n).eq(0).all()
    # a zero block of x contributes nothing: zeroing block 3 of a row equals the reference
    x2 = x.clone()
    x2[:, 96:128] = 0
    assert_close_to_reference(torch.ops.genserve.q4q8_linear(x2, packed, n), x2,
                              random_blocks(n, k, seed=4))
    assert torch.ops.genserve.q4q8_linear(torch.zeros(0, k, dtype=torch.bfloat16), packed, n) \
        .shape == (0, n)


def test_bad_shapes_raise():
    blocks = random_blocks(64, 64)
    packed = q4q8_pack(blocks)
    x = random_x(2, 64)
    op = torch.ops.genserve.q4q8_linear
    with pytest.raises(RuntimeError, match="K = 96"):
        op(random_x(2, 96), packed, 64)                       # K does not match the weight
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(random_x(2, 40), packed, 64)                       # K not a multiple of 32
    with pytest.raises(RuntimeError, match="rows"):
        op(x, packed, 32)                                     # n does not match
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(x, packed[:48].contiguous(), 48)                   # N not a multiple of 32
    with pytest.raises(RuntimeError, match="bf16"):
        op(x.float(), packed, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        op(random_x(2, 128)[:, ::2], packed, 64)              # not contiguous
    with pytest.raises(RuntimeError, match="uint8"):
        op(x, packed.view(torch.int8), 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        q4q8_pack(blocks[:48])
    with pytest.raises(ValueError, match="uint8"):
        q4q8_pack(blocks[:, :30])
    with pytest.raises(ValueError, match="uint8"):
        q4q8_pack(blocks.view(torch.int8))


def test_real_first_layer_blocks(gguf_reader):
    blocks = load_gguf_q4_1(gguf_reader)
    names = [name for name in blocks if name.startswith("layers.0.")]
    assert len(names) == 7
    for name in names:
        w = blocks[name]
        n, k = w.shape[0], w.shape[1] // Q4_1_BLOCK_BYTES * 32
        packed = q4q8_pack(w)
        for m in (1, 32):
            x = random_x(m, k, seed=m + 7)
            assert_close_to_reference(torch.ops.genserve.q4q8_linear(x, packed, n), x, w)


@pytest.mark.slow
@pytest.mark.parametrize("n,k", SHAPES)
def test_avx2_build_gives_the_avx512_builds_bits(avx2_products, n, k):
    """Both builds run the same operations in the same order (the file's header), so the AVX2
    kernel (vpmaddubsw / vpmaddwd) must give the AVX512 one's (vpdpbusd) bits exactly, at every
    row count (tests/engine/kernels/test_q8q8_linear.py checks the Q8_0 product the same way)."""
    packed = q4q8_pack(random_blocks(n, k, seed=11))
    for m in ROWS:
        x = random_x(m, k, seed=m + 20)
        assert torch.equal(avx2_products.q4q8_linear(x, packed, n),
                           torch.ops.genserve.q4q8_linear(x, packed, n)), f"{m} rows"


# ---- the engine with --weights q4q8 ---------------------------------------------------------------

@pytest.fixture(scope="module")
def q4q8_engine(gguf_weights):
    from engine.config import EngineConfig
    from engine.model.gguf_blocks import attach_q4q8
    from engine.runner.builder import engine_from_model, model_from_weights
    args, state = gguf_weights
    model = model_from_weights(args, state, torch.bfloat16)
    attach_q4q8(model)
    return engine_from_model(EngineConfig(num_blocks=1024, prefix_caching=False), model)


def test_q4q8_engine_runs_every_block_product_on_the_op(q4q8_engine):
    from engine.model.transformer import block_matrices
    model = q4q8_engine.executor.model
    assert all(getattr(m, n + "_packed").q4q8 is not None for m, n in block_matrices(model))
    loop = q4q8_engine.executor.decode_loop                  # decode runs the C++ block loop
    assert loop is not None and len(loop.q4q8) == 4 * len(model.layers)
    assert not loop.q4 and not loop.i8


def test_q4q8_decode_loop_gives_the_python_loops_tokens(q4q8_engine, gguf_tokenizer):
    from tests.engine.conftest import check_decode_loop_matches_python_loop
    from tests.engine.model.test_model import mixed_prompts
    assert q4q8_engine.executor.decode_loop.q4q8                        # the C++ loop runs q4q8
    check_decode_loop_matches_python_loop(q4q8_engine, mixed_prompts(gguf_tokenizer))


def test_q4q8_engine_is_batch_invariant_and_answers(q4q8_engine, gguf_tokenizer):
    from engine.runner.invariance import check_batch_invariance
    from tests.engine.conftest import generate
    result = check_batch_invariance(q4q8_engine, batch=12, max_tokens=8, checked=3)
    assert result.identical, f"rows {result.mismatched} differ at {result.first_difference}"
    assert result.distinct > 1
    [answer] = generate(q4q8_engine, [gguf_tokenizer.encode_text("The capital of France is")], 4,
                        temperature=0.0)
    assert "Paris" in gguf_tokenizer.decode(answer)
