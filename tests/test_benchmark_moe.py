"""benchmarks.moe: its shapes (Qwen3-30B-A3B's layer, the dense twin of the same active width), the
GGUF plan against what genserve's loader expects, the router steering (exactly N distinct experts,
the products the engine's own), and each mode run end to end at the toy shape (seconds; the GGUF
mode without llama.cpp: written, then read back by genserve)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.moe import (QWEN3_30B_A3B, TOY, Steering, build_model, dense_twin, main, moe_args, pooled_ids,
                            step_bytes, tensor_plan, tensor_types)
from engine.model.gguf_config import GGUF_LAYER_NAMES
from engine.model.layer_ops import TorchLayerOps
from engine.model.weights import expected_shapes, load_gguf


def test_the_shape_is_qwen3_30b_a3b_layer_and_the_twin_has_its_active_width():
    args = moe_args(QWEN3_30B_A3B, 4, 8192)
    assert (args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.qk_norm) == (2048, 32, 4, 128, True)
    assert (args.moe.n_experts, args.moe.top_k, args.moe.expert_size, args.moe.norm_topk_prob) == (128, 8, 768, True)
    assert all(args.moe.sparse_layers) and len(args.moe.sparse_layers) == 4
    twin = dense_twin(args)
    assert twin.moe is None and twin.intermediate_size == 6144 == 8 * 768
    assert twin.replace(moe=args.moe, intermediate_size=args.intermediate_size,
                        architecture=args.architecture) == args            # only the MLP differs
    # one row reads the same matrix bytes but for the MoE's fp32 router
    assert step_bytes(args, 8) - step_bytes(twin, 0) == 4 * 128 * 2048 * 4
    # the weights the toy tests build are the shapes expected_shapes says, experts per layer
    names = dict(expected_shapes(args))
    assert names["layers.0.feed_forward.experts.127.w1.weight"] == (768, 2048)
    assert "layers.0.feed_forward.w1.weight" in dict(expected_shapes(twin))


def test_the_gguf_plan_holds_every_tensor_genserve_expects_with_its_shape():
    vocab, layers = 49152, 2
    args = moe_args(QWEN3_30B_A3B, layers, vocab, context=QWEN3_30B_A3B.context)
    ours = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
            "output.weight": "output.weight"}
    stacked = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
    plan = {}
    for name, shape, kind in tensor_plan(QWEN3_30B_A3B, layers, vocab):
        if name.startswith("blk."):
            _, i, leaf, _ = name.split(".")
            if leaf in stacked:                 # [experts, out, in] -> each expert's [out, in]
                assert kind == "matrix" and shape[0] == 128
                for e in range(shape[0]):
                    plan[f"layers.{i}.feed_forward.experts.{e}.{stacked[leaf]}.weight"] = shape[1:]
                continue
            assert kind == ("router" if leaf == "ffn_gate_inp" else "norm" if leaf.endswith("norm") else "matrix")
            name = f"layers.{i}.{GGUF_LAYER_NAMES[leaf]}.weight"
        else:
            name = ours[name]
        plan[name] = shape
    assert plan == dict(expected_shapes(args))


@pytest.mark.parametrize("n", [4, 5, 8, 16])
def test_pooled_ids_give_each_row_k_distinct_experts_and_the_step_exactly_n(n):
    pool = torch.randperm(16, generator=torch.Generator().manual_seed(n))[:n]
    ids = pooled_ids(8, 4, pool)
    assert ids.shape == (8, 4)
    assert all(len(set(row)) == 4 for row in ids.tolist())
    assert set(ids.flatten().tolist()) == set(pool.tolist())
    counts = torch.bincount(ids.flatten(), minlength=16)[pool]
    assert counts.max() - counts.min() <= 1                               # spread evenly
    with pytest.raises(ValueError):
        pooled_ids(8, 4, pool[:3])


def test_steering_picks_from_the_pool_and_the_products_are_the_experts_own():
    torch.manual_seed(0)
    model = build_model(moe_args(TOY, 1, 128), seed=1)
    moe = model.layers[0].feed_forward
    steer = Steering(model, seed=2)
    x = (torch.randn(8, TOY.hidden)).to(torch.bfloat16)
    free_w, free_ids = moe.route(x)
    steer.distinct = 8
    w, ids = moe.route(x)
    assert torch.equal(w, free_w) and ids.unique().numel() == 8 and steer.seen[-1] == (8, 8)
    # forward runs the steered ids through the experts: the same as each expert by hand
    routes = []
    steer.distinct = 6
    original = moe.route
    moe.route = lambda x: routes.append(original(x)) or routes[-1]
    out = moe(x, TorchLayerOps).float()
    (w, ids), = routes
    assert ids.unique().numel() == 6
    want = torch.zeros_like(out)
    for r in range(x.shape[0]):
        for j in range(ids.shape[1]):
            expert = moe.experts[int(ids[r, j])]
            want[r] += w[r, j] * expert(x[r:r + 1], TorchLayerOps)[0].float()
    assert (out - want).abs().max() <= 0.02 * want.abs().max()
    moe.route = original
    steer.remove()
    assert moe.route.__func__ is type(moe).route                         # the method again


def test_step_mode_runs_at_the_toy_shape(tmp_path):
    out = tmp_path / "step.json"
    assert main(["step", "--toy", "--layers", "1", "--vocab", "128", "--steps", "3", "--warmup", "1",
                 "--prompt-len", "8", "--rows", "1,4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"1", "4"}
    one = result["rows"]["1"]
    assert one["ms"]["moe"]["n"] == 3 and one["ms"]["dense"]["n"] == 3
    assert one["distinct_experts_per_layer"] == TOY.top_k
    assert one["ratio"] == pytest.approx(one["ms"]["moe"]["median"] / one["ms"]["dense"]["median"])


def test_experts_mode_runs_at_the_toy_shape_and_plots(tmp_path):
    out, png = tmp_path / "experts.json", tmp_path / "experts.png"
    assert main(["experts", "--toy", "--layers", "1", "--vocab", "128", "--steps", "2", "--warmup", "1",
                 "--prompt-len", "8", "--rows", "8", "--distinct", "4,8,16", "--json", str(out),
                 "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    for n in (4, 8, 16):
        assert result["points"][str(n)]["distinct_seen"] == [n]
        assert result["points"][str(n)]["ms"]["n"] == 2
    assert "router" in result["points"] and set(result["fit"]) >= {"slope", "intercept", "r2"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):                       # 8 rows · top 4 cannot touch 64 experts
        main(["experts", "--toy", "--rows", "8", "--distinct", "64"])


def test_gguf_mode_writes_a_file_genserve_reads_as_the_shape(tmp_path):
    f16 = tmp_path / "f16.gguf"
    out = tmp_path / "gguf.json"
    assert main(["gguf", "--toy", "--out", str(f16), "--quantized", "none", "--json", str(out)]) == 0
    args, state = load_gguf(f16)
    assert args == moe_args(TOY, 2, args.vocab_size, context=TOY.context)
    assert args.vocab_size == 49152 and not args.tie_embeddings          # SmolLM2's tokenizer, untied
    types = tensor_types(f16)            # matrices F16; norms and the routers F32, as llama.cpp keeps them
    assert types["F16"][0] == 2 + 2 * (4 + 3) and types["F32"][0] == 1 + 2 * (4 + 1)
    assert json.loads(out.read_text())["f16_bytes"] == f16.stat().st_size
