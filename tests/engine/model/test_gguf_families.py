"""GGUF files of every registered family, written as llama.cpp's converter writes them
(tests/engine/gguf_families.py), loaded by genserve: logits against transformers' forward on the
checkpoint the file holds, and against transformers reading the file itself (`gguf_file=`) where
transformers reads that family right; Llama 3's `rope_freqs`; every tensor type the `gguf`
package dequantizes; bad files refused at load with the file and the fault named.
"""

from __future__ import annotations

import pathlib
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers as tf

from engine.model.layer_ops import TorchLayerOps
from engine.model.transformer import Transformer
from engine.gguf_file import open_gguf
from engine.model.weights import load_gguf
from engine.runner.kv_cache import KVCache
from tests.engine.attention_oracle import step_metadata
from tests.engine.gguf_families import GGUF_ARCH, write_gguf
from tests.engine.hf_families import FAMILIES, reference_logits

Q = gguf.GGMLQuantizationType
# every type gguf.quants can write (llama.cpp's own quantizer writes the K and IQ types)
WRITABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# families whose GGUF transformers 5 reads with llama.cpp's meaning; the others it misreads on
# these tiny files (Llama 3: it ignores rope_freqs; Gemma: it assumes query_pre_attn_scalar 256;
# Qwen3 and Phi-3: it takes vocab and head sizes from its config defaults)
TRANSFORMERS_READS = ("mistral", "qwen2")
TOKENS = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1))


def genserve_logits(path: pathlib.Path) -> torch.Tensor:
    """fp32 logits [40, vocab] of `TOKENS` from the GGUF at `path`, computed as the engine does:
    two 16-token prefill pieces over a paged pool, then eight one-token decode steps."""
    args, state = load_gguf(path)
    model = Transformer.from_state_dict(args, state, torch.float32)
    kv = KVCache(args, 8, 16, torch.float32, "cpu")
    rows = []
    with torch.inference_mode():
        for start, length in [(0, 16), (16, 16)] + [(p, 1) for p in range(32, 40)]:
            meta = step_metadata([(start, length, [3, 1, 5], length == 1)], 16, num_blocks=8)
            hidden = model(TOKENS[start:start + length], torch.arange(start, start + length), kv.layers,
                           meta, TorchLayerOps)
            rows.append(model.logits(hidden))
    return torch.cat(rows)


def rewrite_gguf(source: pathlib.Path, target: pathlib.Path, value=None, tensor=None) -> pathlib.Path:
    """Copy the GGUF `source` to `target`, each metadata value through `value(name, v)` and each
    tensor through `tensor(t)`, which gives (data, GGML type or None for F32 numpy data) or None
    to drop it (defaults: unchanged). Returns `target`."""
    reader = open_gguf(source)
    w = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            v = field.contents() if value is None else value(field.name, field.contents())
            w.add_key_value(field.name, v, field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        out = (np.array(t.data), t.tensor_type) if tensor is None else tensor(t)
        if out is not None:
            data, qtype = out
            if qtype in (None, Q.F32):
                w.add_tensor(t.name, data)
            else:
                w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return target


@pytest.mark.parametrize("family", FAMILIES)
def test_an_f32_gguf_gives_transformers_logits_on_its_checkpoint(family, tmp_path):
    path = write_gguf(family, tmp_path / "ckpt", tmp_path / "model.gguf")
    args, _ = load_gguf(path)
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                    "qwen3moe": "Qwen3MoeForCausalLM"}[GGUF_ARCH[family]]
    if family == "mixtral":                   # a llama file with experts
        architecture = "MixtralForCausalLM"
    assert args.architecture == architecture
    diff = (genserve_logits(path) - reference_logits(tmp_path / "ckpt", TOKENS.tolist())).abs().max().item()
    print(f"{family}: max |logit difference| = {diff:.2e}")
    assert diff < 1e-4, diff


@pytest.mark.parametrize("qtype", WRITABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_quantized_gguf_gives_transformers_logits_on_the_weights_it_holds(family, qtype, tmp_path):
    path = write_gguf(family, tmp_path / "ckpt", tmp_path / "model.gguf", qtype)
    matrices = [t for t in open_gguf(path).tensors if len(t.shape) >= 2 and "ffn_gate_inp" not in t.name]
    assert {t.tensor_type for t in matrices} == {qtype}       # the routers stay F32, as llama-quantize leaves them
    diff = (genserve_logits(path) - reference_logits(tmp_path / "ckpt", TOKENS.tolist())).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("qtype", (Q.F32, *WRITABLE), ids=lambda q: q.name)
@pytest.mark.parametrize("family", TRANSFORMERS_READS)
def test_genserve_and_transformers_read_the_same_gguf_alike(family, qtype, tmp_path):
    path = write_gguf(family, tmp_path / "ckpt", tmp_path / "model.gguf", qtype)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model(input_ids=TOKENS[None], use_cache=False).logits[0]
    diff = (genserve_logits(path) - theirs).abs().max().item()
    assert diff < 1e-4, diff


def test_a_llama3_gguf_serves_the_rope_scaling_it_stores_as_rope_freqs(tmp_path):
    """llama.cpp writes Llama 3.1+'s RoPE scaling only as the tensor rope_freqs.weight; read
    without it, the tiny checkpoint's logits are off by far more than the tolerance."""
    path = write_gguf("llama3", tmp_path / "ckpt", tmp_path / "model.gguf")
    args, _ = load_gguf(path)
    assert args.rope_scaling.kind == "freq_factors"
    factors = np.array(args.rope_scaling.freq_factors)
    assert factors.shape == (args.head_dim // 2,)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    ref = reference_logits(tmp_path / "ckpt", TOKENS.tolist())
    assert (genserve_logits(path) - ref).abs().max().item() < 1e-4
    # the same file without the tensor: what a loader ignoring it computes
    plain = rewrite_gguf(path, tmp_path / "plain.gguf",
                         tensor=lambda t: None if t.name == "rope_freqs.weight" else (np.array(t.data), t.tensor_type))
    assert load_gguf(plain)[0].rope_scaling.kind == "default"
    assert (genserve_logits(plain) - ref).abs().max().item() > 1e-2


# types gguf.quants dequantizes, with the bytes and weights of one block
def _dequantizable() -> list[Q]:
    out = []
    for qtype in Q:
        if qtype in (Q.F32, Q.F16, Q.BF16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64):
            continue
        try:
            size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            gguf.quants.dequantize(np.zeros((1, nbytes), dtype=np.uint8), qtype)
        except (NotImplementedError, KeyError):
            continue
        out.append(qtype)
    return out


@pytest.mark.parametrize("qtype", _dequantizable(), ids=lambda q: q.name)
def test_every_dequantizable_tensor_type_loads(qtype, tmp_path):
    """A Qwen2 file (MLP width 256, so the down projection's rows hold whole 256-weight blocks)
    whose matrices are of one type: the loader's weights equal gguf.quants.dequantize of the
    file's bytes (random block bytes, redrawn until every value is finite), so K-quants, IQ and
    TQ types load as llama.cpp's reference dequantizer reads them."""
    path = write_gguf("qwen2", tmp_path / "ckpt", tmp_path / "f32.gguf", intermediate_size=256)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    expected = {}

    def typed(t):
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) != 2 or shape[1] % block:
            return np.array(t.data), None
        raw = rng.integers(0, 256, size=(shape[0], shape[1] // block * nbytes), dtype=np.uint8)
        values = gguf.quants.dequantize(raw, qtype)
        for _ in range(50):              # redraw the blocks whose values are not all finite
            bad = ~np.isfinite(values).reshape(shape[0], -1, block).all(axis=2)
            if not bad.any():
                break
            for r, b in zip(*np.nonzero(bad)):
                raw[r, b * nbytes:(b + 1) * nbytes] = rng.integers(0, 256, nbytes, dtype=np.uint8)
            values = gguf.quants.dequantize(raw, qtype)
        expected[t.name] = values
        return raw, qtype

    out = rewrite_gguf(path, tmp_path / "typed.gguf", tensor=typed)
    assert "blk.0.ffn_down.weight" in expected
    _, state = load_gguf(out)
    got = state["layers.0.feed_forward.w2.weight"].numpy()
    want = expected["blk.0.ffn_down.weight"]
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()


def _write_bad(tmp_path: pathlib.Path, change) -> pathlib.Path:
    good = write_gguf("qwen2", tmp_path / "ckpt", tmp_path / "good.gguf")
    bad = tmp_path / "bad.gguf"
    data = bytearray(good.read_bytes())
    bad.write_bytes(change(data))
    return bad


def test_a_file_with_the_wrong_magic_is_refused_by_name(tmp_path):
    bad = _write_bad(tmp_path, lambda d: b"GGML" + d[4:])
    with pytest.raises(ValueError, match="bad.gguf: not a readable GGUF"):
        load_gguf(bad)


def test_a_truncated_file_is_refused_at_load(tmp_path):
    bad = _write_bad(tmp_path, lambda d: d[: len(d) // 2])
    with pytest.raises(ValueError, match="bad.gguf"):
        load_gguf(bad)


def test_an_unknown_tensor_type_is_refused_at_load(tmp_path):
    good = write_gguf("qwen2", tmp_path / "ckpt", tmp_path / "good.gguf")
    reader = open_gguf(good)
    t = reader.tensors[0]
    # the type field is the uint32 after the name, n_dims and dims of the tensor's info record
    data = bytearray(good.read_bytes())
    name = t.name.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims
    assert int.from_bytes(data[at:at + 4], "little") == int(t.tensor_type)
    data[at:at + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match="bad.gguf: not a readable GGUF"):
        load_gguf(bad)


def test_a_tensor_whose_shape_disagrees_with_the_metadata_is_refused_by_name(tmp_path):
    good = write_gguf("qwen2", tmp_path / "ckpt", tmp_path / "good.gguf")
    # the file's matrices say 128
    bad = rewrite_gguf(good, tmp_path / "bad.gguf", value=lambda name, v: 96 if name == "qwen2.feed_forward_length" else v)
    with pytest.raises(ValueError, match=r"bad.gguf: layers.0.feed_forward.w1.weight has shape \(128, 64\), expected \(96, 64\)"):
        load_gguf(bad)


def test_an_unregistered_gguf_architecture_is_refused_with_the_supported_list(tmp_path):
    good = write_gguf("qwen2", tmp_path / "ckpt", tmp_path / "good.gguf")
    data = good.read_bytes()
    bad = tmp_path / "bad.gguf"
    # "qwen2" -> "qwen9" everywhere: the architecture and its key prefix
    bad.write_bytes(data.replace(b"qwen2", b"qwen9"))
    with pytest.raises(ValueError, match="GGUF architecture 'qwen9' is not supported; supported: gemma2, gemma3, llama, phi3, qwen2, qwen3"):
        load_gguf(bad)
    shutil.rmtree(tmp_path / "ckpt")


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_q5_0_and_q4_0_blocks_convert_to_q8_0_blocks_of_the_same_floats(qtype):
    """`as_q8_0` (what `q8q8_linear` serves a Q5_0 or Q4_0 matrix from) against the `gguf`
    package's own dequantizer: on random block bytes (every d and q bit pattern, signed zeros,
    subnormal and huge d, NaN / inf d included) and on a real quantization, the Q8_0 blocks
    dequantize to the original blocks' floats bit for bit."""
    from engine.model.gguf_blocks import as_q8_0

    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(96, 40 * nbytes), dtype=np.uint8)
    d = raw.reshape(96, 40, nbytes)[:, :, :2].copy().view(np.float16)
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 65504.0, np.inf, np.nan, 1.0], dtype=np.float16)
    d[0, :8, 0] = special
    raw.reshape(96, 40, nbytes)[:, :, :2] = d.view(np.uint8)
    values = rng.standard_normal((64, 1024)).astype(np.float32)
    for data in (raw, gguf.quants.quantize(values, qtype)):
        want = gguf.quants.dequantize(data, qtype)
        q8 = as_q8_0(torch.from_numpy(np.ascontiguousarray(data)), int(qtype)).numpy()
        assert q8.shape == (data.shape[0], data.shape[1] // nbytes * 34)
        got = gguf.quants.dequantize(q8, Q.Q8_0)
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
    with pytest.raises(ValueError, match="Q5_1"):
        as_q8_0(torch.zeros(2, 24, dtype=torch.uint8), int(Q.Q5_1))
    with pytest.raises(ValueError, match="K / 32"):
        as_q8_0(torch.zeros(2, 23, dtype=torch.uint8), int(Q.Q5_0))
