"""The mixture-of-experts MLP (engine/model/mlp.py) beyond the family parity tests
(tests/engine/model/test_model_families.py runs Qwen3-MoE and Mixtral against transformers):

* a token's output bits do not depend on its batch: a batch where every token routes to the same
  experts, one where no two tokens share one, and a random one, each row against its run alone,
  in bf16 over the packed products; the values against the formula written out in fp32;
* the engine's batch-invariance check passes for a bf16 MoE model;
* the expert load each layer reports (and /metrics exports) counts top_k experts per token;
* transformers 5's stacked expert tensors load as the per-expert ones do; bad configs are
  refused by name;
* the GPU path's grouped expert product (`MoEFeedForward.forward_grouped`, `torch._grouped_mm`
  over stacked experts), run on the CPU where torch has a fallback kernel for it: each expert's
  matrices are views of the stacked ones, and the outputs and expert counts are the loop's.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.model.config import ModelArgs, MoEArgs
from engine.model.mlp import MoEFeedForward
from engine.model.layer_ops import TorchLayerOps
from engine.model.transformer import Transformer
from engine.model.weights import load_safetensors, random_weights
from engine.runner.builder import engine_from_weights
from engine.runner.invariance import check_batch_invariance, invariance_prompts
from tests.engine.hf_families import build_checkpoint

DIM, EXPERTS, TOP_K = 128, 8, 2


def moe_args(n_layers: int = 2, norm_topk_prob: bool = True) -> ModelArgs:
    """A small bf16-packable MoE model: every layer sparse, 8 experts of 64, top 2."""
    return ModelArgs(dim=DIM, n_layers=n_layers, n_heads=4, n_kv_heads=2, intermediate_size=256,
                     vocab_size=512, max_context=1024,
                     moe=MoEArgs(EXPERTS, TOP_K, 64, norm_topk_prob, (True,) * n_layers))


@pytest.fixture(scope="module")
def model() -> Transformer:
    args = moe_args()
    return Transformer.from_state_dict(args, random_weights(args, torch.bfloat16, std=0.05), torch.bfloat16)


def reference(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The block written out token by token in fp32: softmax of x·Rᵀ, top k renormalized,
    Σ p_e · down(silu(gate(x)) · up(x))."""
    out = []
    for row in x.float():
        probs = torch.softmax(moe.router.float() @ row, dim=-1)
        weights, ids = probs.topk(moe.top_k)
        weights = weights / weights.sum()
        acc = torch.zeros(x.shape[1])
        for w, e in zip(weights, ids.tolist()):
            expert = moe.experts[e]
            gate, up = (expert.w13.float() @ row).chunk(2)
            acc += w * (expert.w2.float() @ (torch.nn.functional.silu(gate) * up))
        out.append(acc)
    return torch.stack(out)


def steer(moe: MoEFeedForward, groups: list[list[int]], rows: int, seed: int) -> torch.Tensor:
    """Set the router so that a row built around direction g chooses experts `groups[g]` (the
    first the most), and return `rows` bf16 inputs, row r around direction r % len(groups)."""
    g = torch.Generator().manual_seed(seed)
    router = torch.zeros(EXPERTS, DIM)
    for direction, experts in enumerate(groups):
        for rank, e in enumerate(experts):
            router[e, direction] = 3.0 - rank
    moe.router.copy_(router)
    moe.pack_router()
    x = 0.05 * torch.randn(rows, DIM, generator=g)
    x[torch.arange(rows), torch.arange(rows) % len(groups)] += 4.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("batch", ["shared", "disjoint", "random"])
def test_each_tokens_bits_are_its_own_whatever_experts_its_batch_shares(model, batch):
    moe = model.layers[0].feed_forward
    saved = moe.router.clone()
    try:
        if batch == "shared":            # every row: experts 5 then 2
            x = steer(moe, [[5, 2]], 24, seed=1)
        elif batch == "disjoint":        # row r: its own two experts, no two rows share one
            x = steer(moe, [[0, 1], [2, 3], [4, 5], [6, 7]], 4, seed=2)
        else:
            x = (torch.randn(37, DIM, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
        _, ids = moe.route(x)
        chosen = [set(r) for r in ids.tolist()]
        if batch == "shared":
            assert chosen == [{5, 2}] * 24
        elif batch == "disjoint":
            assert chosen == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
        else:
            assert len(set().union(*chosen)) == EXPERTS     # the random batch touches every expert
        together = moe(x, TorchLayerOps)
        for r in range(x.shape[0]):
            assert torch.equal(moe(x[r:r + 1], TorchLayerOps)[0], together[r]), r
        want = reference(moe, x)
        assert (together.float() - want).abs().max() <= 0.02 * want.abs().max()
    finally:
        moe.router.copy_(saved)
        moe.pack_router()


def test_a_bf16_moe_engine_is_batch_invariant():
    args = moe_args()
    state = random_weights(args, torch.bfloat16, std=0.05)
    engine = engine_from_weights(EngineConfig(device="cpu", dtype="bfloat16", num_blocks=256,
                                              queue_budget_s=1e6), args, state)
    result = check_batch_invariance(engine, batch=12, max_tokens=8, checked=3)
    assert result.identical, f"rows {result.mismatched} differ at {result.first_difference}"
    assert result.distinct > 1


def test_expert_load_counts_top_k_per_token_and_reaches_metrics():
    from service.metrics import EngineMetrics
    from tests.engine.conftest import new_request

    args = moe_args()
    engine = engine_from_weights(EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64,
                                              queue_budget_s=1e6), args, random_weights(args, torch.bfloat16))
    metrics = EngineMetrics(engine)
    prompts = [[11 + i for i in range(n)] for n in (7, 20)]
    for p in prompts:
        engine.submit(new_request(p, 5, [], temperature=0.0, ignore_eos=True))
    engine.run_until_idle()
    # every prompt token and every generated token but the last ran the layers once
    tokens = sum(len(p) + 5 - 1 for p in prompts)
    load = engine.executor.expert_load()
    assert [layer for layer, _ in load] == [0, 1]
    assert all(len(counts) == EXPERTS and sum(counts) == tokens * TOP_K for _, counts in load)
    text = generate_latest(metrics.registry).decode()
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line.startswith("genserve_moe_expert_tokens_total{")}
    assert len(samples) == 2 * EXPERTS
    assert samples['genserve_moe_expert_tokens_total{expert="3",layer="1"}'] == load[1][1][3]
    assert sum(samples.values()) == 2 * tokens * TOP_K


def test_stacked_expert_tensors_load_as_the_per_expert_ones(tmp_path):
    """transformers 5 keeps Qwen3-MoE's experts stacked in memory (`mlp.experts.gate_up_proj`
    [E, 2F, dim], `down_proj` [E, dim, F]); a checkpoint saved that way loads the same."""
    directory = build_checkpoint("qwen3_moe", tmp_path / "split")
    _, want = load_safetensors(directory, torch.float32)
    tensors = load_file(str(directory / "model.safetensors"))
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    config = json.loads((directory / "config.json").read_text())
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in tensors:
            continue                                       # the dense layer
        n = config["num_local_experts"]
        stacked[p + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}{e}.gate_proj.weight"],
                                                              tensors[f"{p}{e}.up_proj.weight"]]) for e in range(n)])
        stacked[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(n)])
    other = pathlib.Path(tmp_path / "stacked")
    other.mkdir()
    save_file(stacked, str(other / "model.safetensors"))
    (other / "config.json").write_text(json.dumps(config))
    _, got = load_safetensors(other, torch.float32)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 must be 1..8"),
    (dict(num_experts=0, num_local_experts=0), "no experts"),
])
def test_a_bad_moe_config_is_refused_by_name(tmp_path, change, message):
    directory = build_checkpoint("qwen3_moe", tmp_path)
    config = json.loads((directory / "config.json").read_text()) | change
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_safetensors(directory, torch.float32)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_q8_0_moe_gguf_serves_every_expert_from_its_blocks(family, tmp_path):
    """Each expert's matrices come out of the file's stacked `ffn_*_exps` blocks (Mixtral's
    llama file: Q and K rows un-permuted too) onto `q8q8_linear`: the blocks hold the model's
    own weights, each product is the Q8_0 x Q8_0 reference, and the engine stays batch
    invariant on them."""
    import gguf

    from engine.config import EngineConfig
    from engine.model import gguf_blocks
    from engine.gguf_file import open_gguf
    from engine.model.weights import load_gguf
    from engine.runner.builder import engine_from_model
    from tests.engine.gguf_families import write_gguf
    from tests.engine.kernels.test_q8q8_linear import check_every_matrix_runs_its_q8_0_blocks

    path = write_gguf(family, tmp_path / "ckpt", tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    args, state = load_gguf(path)
    model = Transformer.from_state_dict(args, state, torch.bfloat16)
    reader = open_gguf(path)
    counts = gguf_blocks.attach_gguf_blocks(model, reader)
    sparse = sum(args.is_sparse(i) for i in range(args.n_layers))
    assert counts["q8q8"] == 2 * args.n_layers + 2 * (args.n_layers - sparse) + 2 * args.moe.n_experts * sparse
    assert counts["bf16"] == 0
    check_every_matrix_runs_its_q8_0_blocks(model, reader)
    engine = engine_from_model(EngineConfig(num_blocks=256, prefix_caching=False), model)
    prompts = invariance_prompts(8, 300, lengths=(5, 17, 40, 9))      # the tiny model has 128 positions
    result = check_batch_invariance(engine, max_tokens=6, checked=2, prompts=prompts)
    assert result.identical, f"rows {result.mismatched} differ at {result.first_difference}"


def test_a_q4_k_m_moe_gguf_runs_its_experts_on_qk_linear(tmp_path, monkeypatch):
    """A qwen3moe file with a Q4_K_M file's expert types (gate and up Q4_K, down Q6_K, stacked;
    the router F32): every expert matrix runs `qk_linear` over its own slice of the stacked
    blocks, exactly the Q4_K / Q6_K x Q8_K reference of those blocks."""
    import gguf

    from engine.model import gguf_blocks
    from engine.model.kquant import Q4_K, Q6_K, qk_dequantize, qk_linear_reference
    from engine.model.linear import linear
    from engine.gguf_file import open_gguf
    from engine.model.weights import load_gguf
    from engine.runner.decode_loop import DecodeLoop
    from tests.engine.kernels.test_qk_linear import random_blocks
    from tests.engine.model.test_model import check_decode_loop_bits

    dim, hidden, experts, layers, vocab = 256, 256, 4, 2, 320
    g = torch.Generator().manual_seed(41)
    path = tmp_path / "moe-q4_k_m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 256), (w.add_embedding_length, dim),
                       (w.add_feed_forward_length, 512), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_key_length, 64), (w.add_value_length, 64), (w.add_rope_freq_base, 1e6),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_expert_count, experts),
                       (w.add_expert_used_count, 2), (w.add_expert_feed_forward_length, hidden)):
        add(value)
    w.add_tensor("token_embd.weight", (torch.randn(vocab, dim, generator=g) * 0.5).numpy())
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    w.add_tensor("output.weight", (torch.randn(vocab, dim, generator=g) * 0.05).numpy())
    Q = gguf.GGMLQuantizationType
    seed = 200
    for i in range(layers):
        for norm, size in (("attn_norm", dim), ("ffn_norm", dim), ("attn_q_norm", 64), ("attn_k_norm", 64)):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(size, np.float32))
        for leaf, rows in (("attn_q", 256), ("attn_k", 128), ("attn_v", 128), ("attn_output", dim)):
            w.add_tensor(f"blk.{i}.{leaf}.weight", (torch.randn(rows, 256, generator=g) * 0.05).numpy())
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", torch.randn(experts, dim, generator=g).numpy())
        for leaf, kind, rows, cols in (("ffn_gate_exps", Q4_K, hidden, dim), ("ffn_up_exps", Q4_K, hidden, dim),
                                       ("ffn_down_exps", Q6_K, dim, hidden)):
            stacked = []
            for _ in range(experts):
                seed += 1
                stacked.append(random_blocks(kind, rows, cols, seed=seed).numpy())
            w.add_tensor(f"blk.{i}.{leaf}.weight", np.stack(stacked), raw_dtype=Q(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    args, state = load_gguf(path)
    assert (args.moe.n_experts, args.moe.top_k, args.moe.expert_size, args.moe.norm_topk_prob) == \
        (experts, 2, hidden, True)
    model = Transformer.from_state_dict(args, state, torch.bfloat16)
    reader = open_gguf(path)
    counts = gguf_blocks.attach_gguf_blocks(model, reader)
    assert counts["qk"] == 2 * experts * layers and counts["bf16"] == 2 * layers   # attention stays F32-born bf16
    for module, name, parts in gguf_blocks._fused_parts(gguf_blocks.gguf_layer_blocks(reader), model):
        packed = getattr(module, name + "_packed")
        if name in ("wqkv", "wo"):
            continue
        assert packed.qk.kinds == {"w13": (Q4_K,), "w2": (Q6_K,)}[name]
        values = torch.cat([qk_dequantize(b, kind) for kind, b in parts]).to(torch.bfloat16)
        assert torch.equal(values, getattr(module, name))
        x = (torch.randn(3, values.shape[1], generator=g)).to(torch.bfloat16)
        want = torch.cat([qk_linear_reference(x, b, kind) for kind, b in parts], dim=1)
        assert torch.equal(linear(x, getattr(module, name), packed), want.to(torch.bfloat16))
    # a step's experts as one qk_linear_grouped call per matrix: each token's bits are the loop's
    moe = model.layers[0].feed_forward
    x = torch.randn(40, dim, generator=g).to(torch.bfloat16)
    assert moe._grouped_product(x, [1] * experts) == moe._qk_product
    together = moe(x, TorchLayerOps)
    assert all(torch.equal(moe(x[r:r + 1], TorchLayerOps)[0], together[r]) for r in (0, 17, 39))
    # the C++ decode loop runs these experts too (qk_linear_grouped), with the Python loop's bits
    loop = DecodeLoop.from_model(model)
    assert loop is not None and loop.moe == [1] * layers
    check_decode_loop_bits(model, loop, [[(5 * i + 3 * j) % vocab for j in range(n)]
                                         for i, n in enumerate((7, 30, 19))])
    monkeypatch.setattr(MoEFeedForward, "_grouped_product", lambda self, x, sizes: None)
    assert torch.equal(moe(x, TorchLayerOps), together)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_expert_product_gives_the_loops_outputs(dtype, monkeypatch):
    """The model built as for the grouped GEMM (`grouped_mm_device` forced true: on the CPU
    `torch._grouped_mm` runs torch's fallback, a product per group): every expert's w13 / w2 is a
    view of the layer's stacked tensor (one storage), and `forward` takes the grouped path, whose
    outputs are the loop's (same products, fp32 sums in the same expert order) and whose expert
    counts are the loop's, for 37 random rows, one row and a step where every row shares two
    experts."""
    import engine.model.transformer as transformer

    args = moe_args()
    state = random_weights(args, dtype, std=0.05)
    plain = Transformer.from_state_dict(args, state, dtype)
    monkeypatch.setattr(transformer, "grouped_mm_device", lambda *a: True)
    grouped = Transformer.from_state_dict(args, state, dtype)
    for moe in grouped.moe_layers:
        assert moe.w13_stacked.shape == (EXPERTS, 2 * 64, DIM) and moe.w2_stacked.shape == (EXPERTS, DIM, 64)
        for e, expert in enumerate(moe.experts):
            for name in ("w13", "w2"):
                whole = getattr(moe, f"{name}_stacked")
                assert getattr(expert, name).untyped_storage()._cdata == whole.untyped_storage()._cdata
                assert torch.equal(getattr(expert, name), whole[e])
    assert all(moe.w13_stacked is None for moe in plain.moe_layers)
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or grouped_mm(*a, **k))
    loop, fast = plain.moe_layers[0], grouped.moe_layers[0]
    shared = steer(fast, [[5, 2]], 24, seed=1)
    loop.router.copy_(fast.router)
    loop.pack_router()
    x = torch.randn(37, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    for rows in (x, x[:1], shared.to(dtype)):
        want, got = loop(rows, TorchLayerOps), fast(rows, TorchLayerOps)
        assert (got.float() - want.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 0.01) * \
            want.float().abs().max()
    assert calls == [(74, DIM), (74, 64), (2, DIM), (2, 64), (48, DIM), (48, 64)]
    assert torch.equal(fast.expert_rows, loop.expert_rows) and int(fast.expert_rows.sum()) == 2 * (37 + 1 + 24)
    assert fast.expert_rows[[2, 5]].tolist() >= [24, 24]


def test_weights_q4_refuses_a_moe_file_and_int8_serves_its_experts(tmp_path):
    """`--weights q4` reads the plain Llama block's Q4_1 layout only: a Mixtral Q4_1 file is a
    ValueError (which `--weights auto` turns into bf16), not a KeyError mid-load; `--weights int8`
    runs every expert's products on int8 arithmetic."""
    import gguf

    from engine.model.int8_weights import attach_int8
    from engine.model.quant import attach_q4
    from engine.model.weights import load_gguf
    from tests.engine.gguf_families import write_gguf

    path = write_gguf("mixtral", tmp_path / "ckpt", tmp_path / "q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)
    args, state = load_gguf(path)
    with pytest.raises(ValueError, match="weights 'q4' serves Q4_1 files of the plain Llama block"):
        attach_q4(Transformer.from_state_dict(args, state, torch.bfloat16), path)
    model = Transformer.from_state_dict(args, state, torch.bfloat16)
    attach_int8(model, None)
    moe = model.layers[0].feed_forward
    assert {e.w13_packed.method.name for e in moe.experts} == {"int8"}
    x = torch.randn(5, args.dim, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    together = moe(x, TorchLayerOps)
    assert all(torch.equal(moe(x[r:r + 1], TorchLayerOps)[0], together[r]) for r in range(5))


def test_the_cpu_grouped_experts_give_the_per_expert_loops_bits(model, monkeypatch):
    """On a CPU whose experts run `packed_linear`, a step's experts are one
    `packed_linear_grouped` call per matrix; a token's output is bit for bit what the loop of
    one call per expert gives, for decode-sized and prefill-sized batches."""
    moe = model.layers[1].feed_forward
    x = torch.randn(70, DIM, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    if moe._grouped_product(x, [1] * EXPERTS) != moe._packed_product:
        pytest.skip("the experts do not run packed_linear on this CPU (or it is not built here)")
    calls = []
    product = MoEFeedForward._packed_product
    monkeypatch.setattr(MoEFeedForward, "_packed_product",
                        lambda self, rows, which, counts: calls.append(which) or product(self, rows, which, counts))
    outs = {}
    for rows in (1, 5, 70):
        calls.clear()
        outs[rows] = moe(x[:rows], TorchLayerOps)
        assert calls == ["w13", "w2"]                       # one grouped call per matrix
    monkeypatch.setattr(MoEFeedForward, "_grouped_product", lambda self, x, sizes: None)
    for rows, together in outs.items():
        assert torch.equal(moe(x[:rows], TorchLayerOps), together), rows
