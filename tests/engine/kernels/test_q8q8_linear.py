"""`torch.ops.genserve.q8q8_linear` (engine/kernels/csrc/q4q8_linear.cpp): Q8_0 weights × bf16
activations rounded to int8 per row and block of 32, llama.cpp's Q8_0 × Q8_0 product, which
`--weights q4q8` runs for the output projection. Against a
reference in torch ops (the blocks dequantized exactly, x rounded as `q4q8_linear` rounds it, the
product in fp64) on random blocks, on blocks holding -128 (the one value whose magnitude is not
an int8) and on the embedded model's real output blocks; a row's bits do not depend on the batch;
bad shapes raise."""

from __future__ import annotations

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.model.quant import q8_0_dequantize, q8q8_linear_reference, q8q8_pack
from engine.model.weights import Q8_0_BLOCK_BYTES, load_gguf_output_q8_0
from tests.engine.kernels import test_q4q8_linear as q4q8_checks
from tests.engine.kernels.test_q4q8_linear import random_x


@pytest.fixture(scope="module", autouse=True)
def built():
    if not genserve_kernels.q4q8_linear_available():
        pytest.skip("q8q8_linear runs only where the kernels build for AVX512-VNNI and "
                    "AVX512-BF16, or for AVX2 and FMA")


def random_blocks(n: int, k: int, seed: int = 0, low: int = -127) -> torch.Tensor:
    """Random Q8_0 blocks [n, k / 32 · 34]: d in a GGUF's range, q uniform in low..127."""
    g = torch.Generator().manual_seed(seed)
    kb = k // 32
    d = (torch.rand(n, kb, generator=g) * 0.004 + 0.0005).half()
    q = torch.randint(low, 128, (n, kb, 32), generator=g, dtype=torch.int8)
    return torch.cat([d.view(torch.uint8).view(n, kb, 2), q.view(torch.uint8)],
                     dim=-1).reshape(n, kb * Q8_0_BLOCK_BYTES).contiguous()


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor) -> None:
    """`test_q4q8_linear`'s check against this op's reference (the Q8_0 weights exact)."""
    q4q8_checks.assert_close_to_reference(y, x, blocks, q8q8_linear_reference, q8_0_dequantize)


def test_pack_layout():
    blocks = random_blocks(32, 64, seed=9)
    packed = q8q8_pack(blocks).view(2, 2, 544)          # [group, kb, 544]: the file's 34 bytes per column
    b = blocks.view(32, 2, 34)
    for g, kb in ((0, 0), (1, 1), (0, 1)):
        blk = packed[g, kb]
        d = b[16 * g:16 * g + 16, kb, 0:2].contiguous().view(torch.float16).flatten()
        assert torch.equal(blk[:32].view(torch.float16), d)        # the file's fp16 d, as they are
        for j in range(8):
            for c in range(16):
                assert torch.equal(blk[32 + 64 * j + 4 * c:32 + 64 * j + 4 * c + 4],
                                   b[16 * g + c, kb, 2 + 4 * j:2 + 4 * j + 4])


@pytest.mark.parametrize("n,k", [(576, 576), (1536, 576), (576, 1536)])
def test_matches_reference(n, k):
    blocks = random_blocks(n, k)
    packed = q8q8_pack(blocks)
    assert packed.shape == (n, k // 32 * 34) and packed.dtype == torch.uint8
    for m in (1, 3, 4, 32, 37):
        x = random_x(m, k, seed=m)
        y = torch.ops.genserve.q8q8_linear(x, packed, n)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert_close_to_reference(y, x, blocks)


def test_weights_of_minus_128():
    # -128 has no int8 magnitude: |q| enters vpmaddubsw as the unsigned byte 128
    n, k = 64, 256
    blocks = random_blocks(n, k, seed=3, low=-128)
    blocks.view(n, k // 32, 34)[:, :, 2:] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
    x = random_x(5, k, seed=4)
    x[0, :32] = 7.0               # a block of x rounding every element to 127: the largest pair
    assert_close_to_reference(torch.ops.genserve.q8q8_linear(x, q8q8_pack(blocks), n), x, blocks)


def test_rows_do_not_depend_on_the_batch():
    n, k = 1536, 576
    packed = q8q8_pack(random_blocks(n, k, seed=2))
    x = random_x(64, k, seed=3)
    alone = torch.cat([torch.ops.genserve.q8q8_linear(x[i:i + 1].contiguous(), packed, n)
                       for i in range(64)])
    for size in (2, 7, 64):
        batched = torch.cat([torch.ops.genserve.q8q8_linear(x[i:i + size].contiguous(), packed, n)
                             for i in range(0, 64, size)])
        assert torch.equal(batched, alone), f"batches of {size}"


def test_bad_shapes_raise():
    blocks = random_blocks(64, 64)
    packed = q8q8_pack(blocks)
    x = random_x(2, 64)
    op = torch.ops.genserve.q8q8_linear
    with pytest.raises(RuntimeError, match="K = 96"):
        op(random_x(2, 96), packed, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(random_x(2, 40), packed, 64)
    with pytest.raises(RuntimeError, match="rows"):
        op(x, packed, 32)
    with pytest.raises(RuntimeError, match="bf16"):
        op(x.float(), packed, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        op(x, packed.view(torch.int8), 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8q8_pack(blocks[:48])
    with pytest.raises(ValueError, match="uint8"):
        q8q8_pack(blocks[:, :30])
    assert op(torch.zeros(0, 64, dtype=torch.bfloat16), packed, 64).shape == (0, 64)


@pytest.mark.slow
@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536)])
def test_avx2_build_gives_the_avx512_builds_bits(avx2_products, n, k):
    """The AVX2 kernel (|q| unsigned, xq with q's sign; vpmaddubsw / vpmaddwd) and the AVX512 one
    (q + 128 on vpdpbusd, less 128 · Σ xq) form the same int32 sums and then run the same fp32
    operations: the same bits, weights of -128 included."""
    blocks = random_blocks(n, k, seed=13, low=-128)
    packed = q8q8_pack(blocks)
    for m in q4q8_checks.ROWS:
        x = random_x(m, k, seed=m + 30)
        assert torch.equal(avx2_products.q8q8_linear(x, packed, n),
                           torch.ops.genserve.q8q8_linear(x, packed, n)), f"{m} rows"


def test_real_output_blocks(gguf_reader):
    blocks = load_gguf_output_q8_0(gguf_reader)
    assert blocks is not None                   # the embedded file's output is Q8_0
    part = blocks[:2048].contiguous()           # 2,048 of the 49,152 vocabulary rows
    k = part.shape[1] // Q8_0_BLOCK_BYTES * 32
    for m in (1, 32):
        x = random_x(m, k, seed=m + 7)
        assert_close_to_reference(torch.ops.genserve.q8q8_linear(x, q8q8_pack(part), 2048), x, part)


@pytest.mark.slow
def test_q4q8_takes_the_q8_0_output(gguf_weights):
    # attach_q4q8 gives the output projection its Q8_0 blocks on every host whose kernels have the
    # op (AVX512-VNNI or AVX2), and the logits follow them
    from engine.model.linear import linear
    from engine.model.gguf_blocks import attach_q4q8
    from engine.runner.builder import model_from_weights
    args, state = gguf_weights
    model = model_from_weights(args, state, torch.bfloat16)
    attach_q4q8(model)
    assert model.output_packed.q8q8 is not None
    hidden = random_x(3, args.dim, seed=11)
    logits = linear(hidden, model.output, model.output_packed)
    blocks = load_gguf_output_q8_0(None)
    assert torch.equal(logits, torch.ops.genserve.q8q8_linear(hidden, q8q8_pack(blocks),
                                                              args.vocab_size))
    assert_close_to_reference(logits, hidden, blocks)


def test_a_q8_0_gguf_serves_every_block_matrix_from_its_blocks(tmp_path):
    """A llama-architecture file of Q8_0 matrices (a common download): `attach_q4q8` gives every
    block matrix `q8q8_linear` over the file's blocks in the model's fused row order (the blocks
    dequantize to the model's own weights, Q and K rows un-permuted and interleaved as they are),
    and each product is the Q8_0 x Q8_0 reference of those blocks; the C++ decode loop runs the
    same products, with the Python block loop's bits (head_dim 64, which its attention serves)."""
    import gguf

    from engine.model import gguf_blocks
    from engine.model.transformer import Transformer
    from engine.gguf_file import open_gguf
    from engine.model.weights import load_gguf
    from engine.runner.decode_loop import DecodeLoop
    from tests.engine.gguf_families import write_gguf
    from tests.engine.model.test_model import check_decode_loop_bits

    path = write_gguf("llama3", tmp_path / "ckpt", tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0,
                      hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    args, state = load_gguf(path)
    model = Transformer.from_state_dict(args, state, torch.bfloat16)
    model.pack()
    reader = open_gguf(path)
    counts = gguf_blocks.attach_gguf_blocks(model, reader)        # what attach_q4q8 runs
    assert counts["q8q8"] == 4 * args.n_layers and counts["bf16"] == 0
    check_every_matrix_runs_its_q8_0_blocks(model, reader)
    loop = DecodeLoop.from_model(model)
    assert loop is not None and len(loop.q8q8) == 4 * args.n_layers
    prompts = [[(7 * i + 3 * j) % args.vocab_size for j in range(n)] for i, n in enumerate((9, 30, 17))]
    check_decode_loop_bits(model, loop, prompts)


def check_every_matrix_runs_its_q8_0_blocks(model, reader) -> None:
    """Every block matrix of `model` (after `attach_gguf_blocks`) holds the file's Q8_0 blocks (Q5_0
    and Q4_0 ones converted by `as_q8_0`) in its fused row order (they dequantize to the model's
    own bf16 weight), runs `Q8Q8Method`, and its product is the Q8_0 x Q8_0 reference of those
    blocks."""
    from engine.model import gguf_blocks
    from engine.model.linear import Q8Q8Method, choose_method, linear
    from engine.model.transformer import block_matrices

    fused = gguf_blocks._fused_parts(gguf_blocks.gguf_layer_blocks(reader), model)
    assert [(m, n) for m, n, _ in fused] == block_matrices(model)
    for module, name, parts in fused:
        blocks = torch.cat([gguf_blocks.as_q8_0(b, kind) for kind, b in parts])
        weight = getattr(module, name)
        packed = getattr(module, name + "_packed")
        assert isinstance(choose_method(packed), Q8Q8Method), name
        assert torch.equal(q8_0_dequantize(blocks).to(torch.bfloat16), weight), name
        x = random_x(5, weight.shape[1], seed=4)
        assert_close_to_reference(linear(x, weight, packed), x, blocks)


def _bf16_and_native_logits(path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object, dict]:
    """The bf16 logits [len(tokens), vocab] of one prefill of `tokens` by the GGUF at `path`, with
    its matrices dequantized to bf16 (packed as the engine packs them) and after
    `attach_gguf_blocks` (the model, and its counts, returned with them)."""
    from engine.gguf_file import open_gguf
    from engine.model import gguf_blocks
    from engine.model.layer_ops import TorchLayerOps
    from engine.model.transformer import Transformer
    from engine.model.weights import load_gguf
    from engine.runner.kv_cache import KVCache
    from tests.engine.attention_oracle import step_metadata

    args, state = load_gguf(path)
    model = Transformer.from_state_dict(args, state, torch.bfloat16)
    model.pack()

    def logits() -> torch.Tensor:
        kv = KVCache(args, 8, 16, torch.bfloat16, "cpu")
        meta = step_metadata([(0, len(tokens), [0, 1], False)], 16, torch.bfloat16, num_blocks=8)
        with torch.inference_mode():
            hidden = model(tokens, torch.arange(len(tokens)), kv.layers, meta, TorchLayerOps)
            return model.logits(hidden).float()

    bf16 = logits()
    reader = open_gguf(path)
    counts = gguf_blocks.attach_gguf_blocks(model, reader)
    return bf16, logits(), (model, reader), counts


# the native products round each input to 8 bits per block of 32: on the tiny files' logits (up to
# about 2.4) that moves them by up to about 0.05, alike for Q8_0, Q5_0 and Q4_0 blocks
NATIVE_LOGITS_TOLERANCE = 0.1


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0"])
def test_a_q5_0_or_q4_0_gguf_runs_every_matrix_on_q8q8_linear(qtype, tmp_path):
    """A llama-architecture file of Q5_0 or Q4_0 matrices (and Q8_0 beside them, the reference):
    every block matrix and the output projection run `q8q8_linear` over the file's blocks
    converted exactly to Q8_0 (`as_q8_0`), each product is the Q8_0 x Q8_0 reference of those
    blocks, and the logits stay within `NATIVE_LOGITS_TOLERANCE` of the bf16-dequantized model's
    (the same bound for all three types: the conversion adds nothing to Q8_0's rounding of the
    inputs)."""
    import gguf

    from engine.model.linear import Q8Q8Method, choose_method
    from tests.engine.gguf_families import write_gguf

    path = write_gguf("llama3", tmp_path / "ckpt", tmp_path / f"{qtype}.gguf",
                      gguf.GGMLQuantizationType[qtype])
    tokens = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(5))
    bf16, native, (model, reader), counts = _bf16_and_native_logits(path, tokens)
    assert counts == {"q4q8": 0, "q8q8": 4 * len(model.layers), "qk": 0, "bf16": 0}
    assert isinstance(choose_method(model.output_packed), Q8Q8Method)
    check_every_matrix_runs_its_q8_0_blocks(model, reader)
    diff = (native - bf16).abs().max().item()
    print(f"{qtype}: max |logit difference| native - bf16 = {diff:.3g} (logits up to "
          f"{bf16.abs().max().item():.3g})")
    assert 0 < diff < NATIVE_LOGITS_TOLERANCE, diff


def test_mixed_q5_0_q8_0_parts_fuse_onto_q8q8_linear(tmp_path):
    """Gemma 3 270M's Q4_K_M file holds q, k, gate and up in Q5_0 and v in Q8_0: a fused matrix of
    Q5_0, Q4_0 and Q8_0 parts runs `q8q8_linear` too, and a Q5_1 part keeps it in bf16."""
    from engine.model.gguf_blocks import Q4_0, Q5_0, native_product
    from engine.model.kquant import Q4_1, Q8_0

    q5 = torch.zeros(32, 22, dtype=torch.uint8)
    q8 = torch.zeros(32, 34, dtype=torch.uint8)
    q4 = torch.zeros(32, 18, dtype=torch.uint8)
    assert native_product([(Q5_0, q5), (Q5_0, q5), (Q8_0, q8)], 32) == "q8q8"
    assert native_product([(Q4_0, q4), (Q8_0, q8)], 32) == "q8q8"
    assert native_product([(Q5_0, q5), (Q4_1, q8)], 32) is None
    assert native_product([(7, q5), (Q8_0, q8)], 32) is None          # Q5_1
