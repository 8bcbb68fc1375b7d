"""Serving the GGUF's 4-bit blocks (`--weights q4`, engine/kernels/csrc/q4_linear.cpp and amx_linear.cpp):
on the embedded SmolLM2's real Q4_1 matrices the kernels decode exactly the bf16 weights the bf16
engine loads, their products have the bits of the bf16 products they reproduce at every row count
(`q4_linear`: `packed_linear`'s; `q4_amx_linear`: oneDNN's AMX calls, on both sides of each of its
row-count paths), they are within rounding of a dequantized
reference summed in fp32, a row's bits do not depend on the batch, and the whole engine generates
the bf16 engine's greedy tokens."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.config import EngineConfig
from engine.model.linear import ANY_ROWS, linear, vnni_pack
from engine.runner.decode_loop import DecodeLoop
from engine.model.transformer import fused_block_matrices
from engine.model.quant import amx_pack, attach_q4, bf16_twin, q4_pack
from engine.model.weights import Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, load_gguf_q4_1
from engine.runner.builder import auto_weights, build_engine, engine_from_model, model_from_weights
from engine.runner.invariance import check_batch_invariance
from tests.engine.conftest import generate
from tests.engine.model.test_model import mixed_prompts

KINDS = ("wqkv", "wo", "w13", "w2")


@pytest.fixture(scope="module")
def q4_model(gguf_weights, gguf_reader):
    if not genserve_kernels.q4_linear_available():
        pytest.skip("q4_linear is built only for AVX512-BF16 CPUs with g++; --weights q4 cannot "
                    "run here")
    args, state = gguf_weights
    model = model_from_weights(args, state, torch.bfloat16)
    attach_q4(model, gguf_reader)
    return model


@pytest.fixture(scope="module")
def file_blocks(gguf_reader, q4_model):
    """The fused block matrices' Q4_1 blocks as the file holds them, by (layer, kind)."""
    args = q4_model.args
    fused = fused_block_matrices(load_gguf_q4_1(gguf_reader), args)
    owner = {"wqkv": "attention", "wo": "attention", "w13": "feed_forward", "w2": "feed_forward"}
    return {(i, kind): fused[f"layers.{i}.{owner[kind]}.{kind}"]
            for i in range(args.n_layers) for kind in KINDS}


def amx_runs(packed) -> bool:
    """Whether `q4_amx_linear` runs a `q4_weight`'s products (its blocks in `amx_pack`'s layout)."""
    return not packed.k_chunk


@pytest.fixture(scope="module")
def q4_engine(q4_model):
    return engine_from_model(EngineConfig(num_blocks=1024, prefix_caching=False, weights="q4"),
                             q4_model)


def reproduces_default(packed) -> bool:
    """Whether a `q4_weight`'s products are the default bf16 engine's (not only the own-layout
    engine's): oneDNN's chunk kept, or oneDNN's AMX calls."""
    return packed.max_rows != ANY_ROWS or not packed.k_chunk


def matrix(model, layer: int, kind: str):
    """(bf16 weight, PackedWeight) of one block matrix."""
    module = model.layers[layer].attention if kind in ("wqkv", "wo") else \
        model.layers[layer].feed_forward
    return getattr(module, kind), getattr(module, kind + "_packed")


@contextlib.contextmanager
def bf16_twin_weights(runner):
    """Within the block, every block matrix of the runner's model runs the bf16 `packed_linear`
    product its 4-bit blocks reproduce (`bf16_twin`), and the runner's C++ decode loop takes those."""
    model = runner.model
    saved = {}
    for i in range(len(model.layers)):
        for kind in KINDS:
            weight, packed = matrix(model, i, kind)
            module = model.layers[i].attention if kind in ("wqkv", "wo") else \
                model.layers[i].feed_forward
            saved[(module, kind)] = packed
            setattr(module, kind + "_packed", bf16_twin(packed, weight))
    decode = runner.decode_loop
    runner.decode_loop = DecodeLoop.from_model(model)
    try:
        yield model
    finally:
        for (module, kind), packed in saved.items():
            setattr(module, kind + "_packed", packed)
        runner.decode_loop = decode


def test_q4_blocks_decode_to_the_bf16_weights_the_engine_loads(q4_model, file_blocks):
    # x = I: every output is one weight times 1 plus exact zeros, so y = Wᵀ exactly as decoded:
    # round_to_bf16(d·q + m) of each block must equal gguf's fp32 dequantization cast by torch,
    # with the Q/K rows permuted and Q/K/V, gate/up fused as the bf16 model's.
    for layer in (0, 13, 29):
        for kind in KINDS:
            weight, packed = matrix(q4_model, layer, kind)
            k = weight.shape[1]
            eye = torch.eye(k, dtype=torch.bfloat16)
            blocks = file_blocks[(layer, kind)]
            decoded = torch.ops.genserve.q4_linear(eye, q4_pack(blocks), k).T
            assert torch.equal(decoded, weight), (
                f"layer {layer} {kind}: {(decoded != weight).sum()} weights differ")
            assert torch.equal(linear(eye, weight, packed).T, weight)    # the kernel it runs
            if genserve_kernels.q4_amx_available():     # by table lookup, each path of the kernel
                for rows in (16, 32, k):
                    decoded = torch.ops.genserve.q4_amx_linear(eye[:rows].contiguous(),
                                                               amx_pack(blocks)).T
                    assert torch.equal(decoded, weight[:, :rows]), f"{layer} {kind} {rows}"


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 32, 33, 64])
def test_q4_product_has_the_bf16_products_bits(q4_model, bf16_engine, file_blocks, rows):
    gen = torch.Generator().manual_seed(rows)
    bf16_model = bf16_engine.executor.model
    for kind in KINDS:
        weight, packed = matrix(q4_model, 7, kind)
        x = (torch.randn(rows, weight.shape[1], generator=gen) * 2).to(torch.bfloat16)
        got = linear(x, weight, packed)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, weight.shape[0])
        want = linear(x, weight, bf16_twin(packed, weight))
        assert torch.equal(got, want), f"{kind} at {rows} rows: {(got != want).sum()} differ"
        if reproduces_default(packed):
            default = matrix(bf16_model, 7, kind)[1]
            assert torch.equal(got, linear(x, weight, default)), f"{kind} at {rows} rows"
        # q4_linear reproduces packed_linear over genserve's own layout whatever runs here
        k = weight.shape[1]
        own = torch.ops.genserve.packed_linear(x, vnni_pack(weight), k)
        own_q4 = torch.ops.genserve.q4_linear(x, q4_pack(file_blocks[(7, kind)]), k)
        assert torch.equal(own_q4, own), kind


def test_q4_product_is_within_rounding_of_a_dequantized_fp32_reference(q4_model, gguf_weights):
    # The reference: the fp32 dequantization of the same blocks (gguf.quants), rounded to bf16
    # as the engine loads it, multiplied in float64. The kernel sums in fp32 (error at most
    # K·2⁻²⁴·Σ|x·w|, Higham's γ_K) and rounds once to bf16 (at most 2⁻⁹·|y|): the bound below.
    _, state = gguf_weights
    gen = torch.Generator().manual_seed(3)
    for kind, name in (("wo", "attention.wo"), ("w2", "feed_forward.w2")):
        weight, packed = matrix(q4_model, 11, kind)
        dequantized = state[f"layers.11.{name}.weight"]                 # fp32, from gguf
        assert torch.equal(dequantized.to(torch.bfloat16), weight)
        k = weight.shape[1]
        x = (torch.randn(32, k, generator=gen) * 2).to(torch.bfloat16)
        got = linear(x, weight, packed).double()
        ref = x.double() @ weight.double().T
        bound = 2.0 ** -8 * ref.abs() + k * 2.0 ** -23 * (x.double().abs() @ weight.double().abs().T)
        err = (got - ref).abs()
        assert (err <= bound).all(), f"{kind}: worst error / bound {(err / bound).max():.3f}"
        assert (err > 0).any()      # the products are rounded, not the reference itself


def test_q4_rows_do_not_depend_on_the_batch(q4_model):
    gen = torch.Generator().manual_seed(5)
    for kind in KINDS:
        weight, packed = matrix(q4_model, 20, kind)
        x = torch.randn(80, weight.shape[1], generator=gen).to(torch.bfloat16)
        full = linear(x, weight, packed)
        for m in (1, 2, 5, 6, 7, 13, 16, 17, 32, 64, 80):
            assert torch.equal(linear(x[:m], weight, packed), full[:m]), (
                f"{kind}: the first {m} rows differ from the 80-row call")
        other = torch.randn(80, weight.shape[1], generator=gen).to(torch.bfloat16)
        other[37] = x[3]                                    # a row among other neighbours
        assert torch.equal(linear(other, weight, packed)[37], full[3])


def test_q8_output_projection_has_the_bf16_logits_bits(q4_model, bf16_engine, gguf_reader):
    # The embedded file stores the output projection (tied to the embedding) in Q8_0. Where the
    # block matrices run q4_amx_linear, the logits read those blocks: the same decoded weights
    # (x = I) and the bits of the bf16 engine's logits at every row count, each row alone.
    packed = q4_model.output_packed
    if not amx_runs(matrix(q4_model, 0, "wqkv")[1]):
        assert packed.q8 is None                   # q8_amx_linear runs only beside q4_amx_linear
        pytest.skip("no AMX product to reproduce on this CPU: the logits stay bf16")
    assert packed.q8 is not None and packed.q8.shape == (q4_model.args.vocab_size, 576 // 32 * 34)
    eye = torch.eye(q4_model.args.dim, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.genserve.q8_amx_linear(eye, packed.q8).T, q4_model.output)
    bf16_model = bf16_engine.executor.model
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(40, q4_model.args.dim, generator=gen) * 2).to(torch.bfloat16)
    full = q4_model.logits(x)
    assert torch.equal(full, bf16_model.logits(x))
    for rows in (1, 5, 16, 17, 32, 33):
        assert torch.equal(q4_model.logits(x[:rows]), full[:rows]), rows


def test_q4_engine_generates_the_bf16_engines_greedy_tokens(q4_engine, bf16_engine, gguf_tokenizer):
    prompts = mixed_prompts(gguf_tokenizer)
    runner = q4_engine.executor
    model = runner.model
    assert runner.decode_loop is not None and runner.decode_loop.q4   # the C++ decode loop
    q4_tokens = generate(q4_engine, prompts, 16, temperature=0.0)
    decode = runner.decode_loop
    runner.decode_loop = None                                    # the Python block loop
    try:
        assert generate(q4_engine, prompts, 16, temperature=0.0) == q4_tokens
    finally:
        runner.decode_loop = decode
    with bf16_twin_weights(runner):
        twin_tokens = generate(q4_engine, prompts, 16, temperature=0.0)
    assert twin_tokens == q4_tokens
    assert len({tuple(t) for t in q4_tokens}) > len(prompts) // 2    # not one answer for all
    if not reproduces_default(matrix(model, 0, "wqkv")[1]):
        pytest.skip("this CPU's default bf16 products are oneDNN's, which no packed_linear "
                    "chunk reproduces: q4 equals the own-layout bf16 engine (checked above), "
                    "not the default one bit for bit")
    assert generate(bf16_engine, prompts, 16, temperature=0.0) == q4_tokens


def test_q4_engine_is_batch_invariant(q4_engine):
    result = check_batch_invariance(q4_engine, batch=12, max_tokens=8, checked=3)
    assert result.identical, f"rows {result.mismatched} differ at {result.first_difference}"
    assert result.distinct > 1


def test_q4_kernels_and_packing_reject_bad_input(q4_model, file_blocks):
    weight, _ = matrix(q4_model, 0, "wo")
    blocks = q4_pack(file_blocks[(0, "wo")])
    x = torch.zeros(2, weight.shape[1], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="k_chunk must be a multiple of 32"):
        torch.ops.genserve.q4_linear(x, blocks, 48)
    with pytest.raises(RuntimeError, match="x has K"):
        torch.ops.genserve.q4_linear(x[:, :64].contiguous(), blocks, 64)
    for pack in (q4_pack, amx_pack):
        with pytest.raises(ValueError, match="multiple of 64"):
            pack(torch.zeros(32, 40, dtype=torch.uint8))
        with pytest.raises(ValueError, match="uint8"):
            pack(torch.zeros(64, 40, dtype=torch.int16))
    with pytest.raises(ValueError, match="neither Q4_1"):
        amx_pack(torch.zeros(64, 48, dtype=torch.uint8), 24)
    if genserve_kernels.q4_amx_available():
        grouped = amx_pack(file_blocks[(0, "wo")])
        with pytest.raises(RuntimeError, match="x has K"):
            torch.ops.genserve.q4_amx_linear(x[:, :64].contiguous(), grouped)
        with pytest.raises(RuntimeError, match="contiguous bf16"):
            torch.ops.genserve.q4_amx_linear(x.float(), grouped)
        with pytest.raises(RuntimeError, match=r"K / 32 \* 34"):
            torch.ops.genserve.q8_amx_linear(x, grouped[:, :-1].contiguous())


def test_q4_pack_moves_nibbles_and_scales_without_changing_them(gguf_reader):
    blocks = load_gguf_q4_1(gguf_reader)["layers.0.attention.wo.weight"]
    packed = q4_pack(blocks)
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8
    assert not torch.equal(packed, blocks)

    def nibble_counts(t: torch.Tensor) -> torch.Tensor:
        return torch.bincount(torch.cat([(t & 0xF).flatten(), (t >> 4).flatten()]), minlength=16)

    assert torch.equal(nibble_counts(blocks.view(-1, 20)[:, 4:]),
                       nibble_counts(packed.view(-1, 1280)[:, 256:]))
    # the fp16 scales and mins, as 16-bit words: the same multiset
    words = lambda t: (t[:, 0::2].long() | (t[:, 1::2].long() << 8)).flatten().sort().values
    assert torch.equal(words(blocks.view(-1, 20)[:, :4]), words(packed.view(-1, 1280)[:, :256]))


@pytest.mark.parametrize("block_bytes", [Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES])
def test_amx_pack_groups_each_columns_block_without_changing_it(block_bytes):
    # Random blocks, 128 columns x 64 k: in group g of 16 columns at (64-column block nb, k block
    # kb), column c's scale bytes lie side by side with the group's others, and its quants in a
    # run of their own: Q8_0's in the file's order, Q4_1's nibbles re-paired for the table
    # lookup (byte 2j: q[j], q[8 + j]; byte 2j + 1: q[16 + j], q[24 + j]).
    n, kb = 128, 2
    blocks = torch.randint(0, 256, (n, kb * block_bytes), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    grouped = amx_pack(blocks, block_bytes).view(n // 64, kb, 4, 16 * block_bytes)
    scale_bytes = 4 if block_bytes == Q4_1_BLOCK_BYTES else 2
    for col in (0, 17, 63, 64, 127):
        for k in range(kb):
            block = blocks[col, k * block_bytes:(k + 1) * block_bytes]
            group = grouped[col // 64, k, col % 64 // 16]
            c = col % 16
            for s in range(0, scale_bytes, 2):            # d, then m: 16 fp16 each
                assert torch.equal(group[s * 16 + 2 * c:s * 16 + 2 * c + 2], block[s:s + 2])
            quants = block_bytes - scale_bytes
            start = scale_bytes * 16 + c * quants
            got = group[start:start + quants]
            if block_bytes == Q8_0_BLOCK_BYTES:
                assert torch.equal(got, block[scale_bytes:])
                continue
            q = torch.cat([block[4:] & 0xF, block[4:] >> 4])           # q[0..31], the file's
            for j in range(8):
                assert got[2 * j] == q[j] | (q[8 + j] << 4)
                assert got[2 * j + 1] == q[16 + j] | (q[24 + j] << 4)


def test_config_and_builder_reject_q4_where_it_cannot_run():
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="q8")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        build_engine(EngineConfig(num_blocks=64, weights="q4", device="cpu"), model="random:tiny",
                     calibrate=False)


@pytest.mark.slow
def test_auto_serves_the_4_bit_blocks_where_they_can_run_and_bf16_elsewhere(q4_model):
    def matrices(loaded, kind: str) -> int:
        """Block matrices whose `PackedWeight` has `kind` ("q4" or "q4q8") blocks."""
        return sum(getattr(getattr(module, name + "_packed"), kind) is not None
                   for layer in loaded.engine.executor.model.layers
                   for module, name in ((layer.attention, "wqkv"), (layer.attention, "wo"),
                                        (layer.feed_forward, "w13"), (layer.feed_forward, "w2")))

    assert EngineConfig().weights == "auto"
    layers = q4_model.args.n_layers
    auto = build_engine(EngineConfig(num_blocks=64, device="cpu"), calibrate=False)
    # this host's choice (the rule itself: test_auto_weights_follows_the_cpu)
    kind, _ = auto_weights(auto.engine.executor.model, auto.source)
    assert matrices(auto, kind) == 4 * layers            # the embedded Q4_1 GGUF: every block matrix
    bf16 = build_engine(EngineConfig(num_blocks=64, device="cpu", weights="bf16"), calibrate=False)
    assert matrices(bf16, "q4") == matrices(bf16, "q4q8") == 0
    random = build_engine(EngineConfig(num_blocks=64, device="cpu"), model="random:tiny", calibrate=False)
    assert matrices(random, "q4") == matrices(random, "q4q8") == 0   # no GGUF blocks: bf16, no error


@pytest.mark.parametrize("amx, vnni, bf16, kind, expected", [
    (True, True, True, "embedded", "q4"),       # AMX: q4_amx_linear, exact and the faster there
    (False, True, True, "gguf", "q4q8"),        # AVX512-VNNI without AMX: llama.cpp's arithmetic
    (False, True, False, "embedded", "q4q8"),   # AVX2 alone: the same op on vpmaddubsw
    (False, False, True, "embedded", "q4"),     # AVX512-BF16 alone: q4_linear
    (False, False, False, "embedded", "bf16"),  # no 4-bit kernel
    (False, True, True, "random", "bf16"),      # not a GGUF: no blocks to read
])
def test_auto_weights_follows_the_cpu(monkeypatch, amx, vnni, bf16, kind, expected):
    import types

    from engine.runner import builder
    monkeypatch.setattr(builder.kernels, "q4_amx_available", lambda: amx)
    monkeypatch.setattr(builder.kernels, "q4q8_linear_available", lambda: vnni)
    monkeypatch.setattr(builder.kernels, "q4_linear_available", lambda: bf16)
    network = types.SimpleNamespace(dtype=torch.bfloat16,
                                    output=types.SimpleNamespace(device=torch.device("cpu")))
    weights, reason = builder.auto_weights(network, types.SimpleNamespace(kind=kind))
    assert weights == expected and reason
    network.dtype = torch.float32                    # 4-bit products need a bf16 model
    assert builder.auto_weights(network, types.SimpleNamespace(kind=kind))[0] == "bf16"
