"""benchmarks.llama_q4km's file plan: every tensor genserve's loader expects for a Llama 3.2
1B-shaped model, with the shape it expects, under llama.cpp's names (writing the 2.1 GB file
itself is the benchmark's job, not a test's)."""

from __future__ import annotations

from benchmarks.llama_q4km import SHAPE, tensor_plan
from engine.model.config import ModelArgs
from engine.model.gguf_config import GGUF_LAYER_NAMES
from engine.model.weights import expected_shapes


def test_the_plan_holds_every_tensor_genserve_expects_with_its_shape():
    vocab = 49152
    args = ModelArgs(dim=SHAPE["hidden"], n_layers=SHAPE["layers"], n_heads=SHAPE["heads"],
                     n_kv_heads=SHAPE["kv_heads"], intermediate_size=SHAPE["ffn"], vocab_size=vocab,
                     max_context=SHAPE["context"], rope_theta=SHAPE["theta"], norm_eps=SHAPE["eps"],
                     tie_embeddings=True, head_dim=SHAPE["head_dim"])
    ours = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight"}
    plan = {}
    for name, shape, kind in tensor_plan(vocab):
        if name.startswith("blk."):
            _, i, leaf, _ = name.split(".")
            name = f"layers.{i}.{GGUF_LAYER_NAMES[leaf]}.weight"
        elif name in ours:
            name = ours[name]
        plan[name] = shape
    want = {name: shape for name, shape in expected_shapes(args) if name != "output.weight"}   # tied
    assert plan.pop("rope_freqs.weight") == (SHAPE["head_dim"] // 2,)
    assert plan == want
