"""genserve's `packed_linear` (products read from a packed weight): oneDNN's bits at every row
count, on SmolLM2's real matrices, where the model packed with oneDNN; the k chunk probe; a row
alone equals the row in a batch across `PACKED_LINEAR_MAX_ROWS`; errors. Where oneDNN's rows
depend on the batch on this CPU the model takes genserve's own layout instead
(tests/engine/kernels/test_vnni_pack.py), and the oneDNN-only tests skip saying so."""

from __future__ import annotations

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.model.layer_ops import KernelLayerOps
from tests.engine.attention_oracle import step_metadata
from engine.model.linear import ANY_ROWS, PACKED_LINEAR_MAX_ROWS, linear, onednn_k_chunk, pack_weight
from engine.runner.kv_cache import KVCache
from tests.engine.model.test_model import mixed_prompts


@pytest.fixture(scope="module")
def model(bf16_engine):
    if not genserve_kernels.packed_linear_available():
        pytest.skip("packed_linear is built only for AVX512-BF16 CPUs with g++; oneDNN runs here")
    return bf16_engine.executor.model


@pytest.fixture(scope="module")
def onednn_model(model):
    if model.output_packed.max_rows == ANY_ROWS or model.output_packed.tile_rows:
        pytest.skip("oneDNN's packed products depend on the row count on this CPU, so the model "
                    "runs oneDNN in fixed-size calls or genserve's own layout "
                    "(tests/engine/kernels/test_vnni_pack.py), and packed_linear reproduces no oneDNN bits")
    return model


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def matrices(model) -> dict[str, tuple[torch.Tensor, object]]:
    """(weight, PackedWeight) of each kind: layer 7's block matrices and the output projection."""
    layer = model.layers[7]
    return {"wqkv": (layer.attention.wqkv, layer.attention.wqkv_packed),
            "wo": (layer.attention.wo, layer.attention.wo_packed),
            "w13": (layer.feed_forward.w13, layer.feed_forward.w13_packed),
            "w2": (layer.feed_forward.w2, layer.feed_forward.w2_packed),
            "output": (model.output, model.output_packed)}


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 48, 64])
def test_packed_linear_gives_onednns_bits_on_the_models_matrices(onednn_model, rows):
    model = onednn_model
    gen = torch.Generator().manual_seed(rows)
    for name, (weight, packed) in matrices(model).items():
        assert packed.k_chunk > 0, f"{name}: no k chunk reproduced oneDNN"
        x = (torch.randn(max(rows, 2), weight.shape[1], generator=gen) * 2).to(torch.bfloat16)
        want = onednn(x, packed.tensor)[:rows]                 # oneDNN at >= 2 rows (see linear)
        got = torch.ops.genserve.packed_linear(x[:rows], packed.tensor, packed.k_chunk)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, weight.shape[0])
        assert torch.equal(got, want), f"{name} at {rows} rows: {(got != want).sum()} outputs differ"
        # and within rounding of the exact product
        exact = x[:rows].double() @ weight.double().T
        assert (got.double() - exact).abs().max() <= 1e-2 * exact.abs().max() + 1e-3, name


def test_a_wrong_k_chunk_is_told_apart_by_the_probe(onednn_model):
    """The probe is what makes packed_linear safe: another chunk gives other bits on random rows,
    so `onednn_k_chunk` cannot settle on a wrong one, and its answer is stable."""
    _, packed = matrices(onednn_model)["w13"]
    x = torch.randn(256, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = onednn(x, packed.tensor)
    for wrong in {packed.k_chunk // 2, 576, 544} - {packed.k_chunk}:
        got = torch.ops.genserve.packed_linear(x, packed.tensor, wrong)
        assert not torch.equal(got, want), f"k chunk {wrong} also matched {packed.k_chunk}"
    assert onednn_k_chunk(packed.tensor) == packed.k_chunk
    again = pack_weight(onednn_model.layers[3].feed_forward.w13)
    assert again.k_chunk == packed.k_chunk


def test_one_row_alone_equals_that_row_in_a_batch_above_the_row_limit(model):
    """`linear` runs packed_linear up to PACKED_LINEAR_MAX_ROWS rows and oneDNN above: a row's
    bits must not change across that line."""
    rows = PACKED_LINEAR_MAX_ROWS + 40
    for name, (weight, packed) in matrices(model).items():
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        batch = linear(x, weight, packed)                      # oneDNN
        for r in (0, 17, rows - 1):
            assert torch.equal(linear(x[r:r + 1], weight, packed), batch[r:r + 1]), (name, r)
        assert torch.equal(linear(x[:PACKED_LINEAR_MAX_ROWS], weight, packed),
                           batch[:PACKED_LINEAR_MAX_ROWS]), name


def test_a_decode_row_has_the_same_hidden_state_beside_a_long_prefill_piece(model, gguf_tokenizer):
    """The real activations through the whole model: a decode row alone (packed_linear, in the
    C++ decode loop) and the same row in a step with a prefill piece long enough that the step's
    products run on oneDNN (the Python loop) give identical final hidden states."""
    prompts = mixed_prompts(gguf_tokenizer)
    p, long_prompt = prompts[6], prompts[7]
    piece = PACKED_LINEAR_MAX_ROWS + 64
    assert len(long_prompt) >= piece
    kv = KVCache(model.args, 64, 16, torch.bfloat16)
    table, other = list(range(0, 16)), list(range(16, 64))
    with torch.inference_mode():
        meta = step_metadata([(0, len(p) - 1, table, False)], 16, torch.bfloat16, True)
        model(torch.tensor(p[:-1]), torch.arange(len(p) - 1), kv.layers, meta, KernelLayerOps)
        decode = (len(p) - 1, 1, table, True)
        meta = step_metadata([decode], 16, torch.bfloat16, True)
        alone = model(torch.tensor([p[-1]]), torch.tensor([len(p) - 1]), kv.layers, meta, KernelLayerOps)
        meta = step_metadata([decode, (0, piece, other, False)], 16, torch.bfloat16, True)
        ids = torch.tensor([p[-1]] + long_prompt[:piece])
        pos = torch.cat([torch.tensor([len(p) - 1]), torch.arange(piece)])
        mixed = model(ids, pos, kv.layers, meta, KernelLayerOps)
    assert torch.equal(alone[0], mixed[0])


def test_bad_inputs_raise_and_name_the_problem(model):
    weight, packed = matrices(model)["wo"]
    x = torch.randn(3, weight.shape[1]).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="K = 100"):
        torch.ops.genserve.packed_linear(x[:, :100].contiguous(), packed.tensor, packed.k_chunk)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.genserve.packed_linear(x.float(), packed.tensor, packed.k_chunk)
    with pytest.raises(RuntimeError, match="k_chunk"):
        torch.ops.genserve.packed_linear(x, packed.tensor, 7)
    with pytest.raises(RuntimeError, match="contiguous"):                # not a packed weight
        torch.ops.genserve.packed_linear(x, torch.empty(weight.shape[1], weight.shape[0],
                                                        dtype=torch.bfloat16).t(), 64)


@pytest.mark.parametrize("layout", ["onednn", "vnni"])
def test_the_grouped_call_gives_each_row_its_own_weights_packed_linear_bits(model, layout):
    """`packed_linear_grouped` (a mixture of experts' step in one call): groups of 0, 1, 6, 7
    and 70 rows over four weights, each row exactly `packed_linear` of its row by its group's
    weight, whatever the other groups hold."""
    from engine.model.linear import vnni_pack

    g = torch.Generator().manual_seed(21)
    weights = [(torch.randn(128, 256, generator=g) * 0.05).to(torch.bfloat16) for _ in range(5)]
    if layout == "onednn":
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
        chunks = [onednn_k_chunk(p) for p in packed]
    else:
        packed, chunks = [vnni_pack(w) for w in weights], [256] * 5
    sizes = [1, 0, 6, 7, 70]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    x = torch.randn(offsets[-1], 256, generator=g).to(torch.bfloat16)
    y = torch.ops.genserve.packed_linear_grouped(x, packed, offsets, chunks)
    for grp, (start, end) in enumerate(zip(offsets, offsets[1:])):
        for r in range(start, end):
            want = torch.ops.genserve.packed_linear(x[r:r + 1].contiguous(), packed[grp], chunks[grp])
            assert torch.equal(y[r:r + 1], want), (grp, r)
    with pytest.raises(RuntimeError, match="offsets must run from 0 to M"):
        torch.ops.genserve.packed_linear_grouped(x, packed, [0, 1, 1, 7, 14, 80], chunks)
