"""`torch.ops.genserve.paged_decode` at long contexts: against a dense fp32 reference on shuffled
block tables, for every GQA group size and block size the kernel takes, with both ways it computes
scores (AMX tiles and vdpbf16ps), with the AVX2 kernel too on hosts whose own build is AVX512's,
and a row's bits whatever else is in the call."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import kernels as genserve_kernels

HD = 64


@pytest.fixture(autouse=True)
def _kernels_built():
    if not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?)")


@pytest.fixture(params=["default", "vdpbf16ps", pytest.param("avx2", marks=pytest.mark.slow)])
def decode(request, monkeypatch) -> Callable:
    """paged_decode(q, k_pool, v_pool, tables, lens) at scale 1/√64, by each way it runs: this
    host's build (AMX scores where this CPU and OS have them, else the same as the next),
    vdpbf16ps scores forced with GENSERVE_DECODE_AMX=0 (the kernel reads it at every call), and
    the AVX2 kernel (the fixture `avx2_attention`: an x86-64-v3 build, on AVX512 hosts)."""
    op = torch.ops.genserve.paged_decode
    if request.param == "vdpbf16ps":
        monkeypatch.setenv("GENSERVE_DECODE_AMX", "0")
    elif request.param == "avx2":
        op = request.getfixturevalue("avx2_attention")
    return lambda q, k_pool, v_pool, tables, lens: op(q, k_pool, v_pool, tables, lens, HD ** -0.5)


def make_case(contexts: list[int], kv_heads: int, group: int, block: int, dtype: torch.dtype,
              seed: int, q_scale: float = 1.0, hd: int = HD):
    """Random pools of just enough blocks (plus 7 spare) for `contexts`, handed out to the rows
    in a shuffled order, each row's table padded with block 0 to the widest; returns
    (q [B, H, hd], k_pool, v_pool [blocks, block, kv_heads, hd], tables int64 [B, nb], lens int64 [B])."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block) for c in contexts]
    n_blocks = sum(need) + 7
    k_pool = torch.randn(n_blocks, block, kv_heads, hd, generator=g).to(dtype)
    v_pool = torch.randn(n_blocks, block, kv_heads, hd, generator=g).to(dtype)
    order = torch.randperm(n_blocks, generator=g).tolist()
    tables = torch.zeros(len(contexts), max(need), dtype=torch.long)
    at = 0
    for row, n in enumerate(need):
        tables[row, :n] = torch.tensor(order[at:at + n])
        at += n
    q = (torch.randn(len(contexts), kv_heads * group, hd, generator=g) * q_scale).to(dtype)
    return q, k_pool, v_pool, tables, torch.tensor(contexts, dtype=torch.long)


def dense_reference(q, k_pool, v_pool, tables, lens) -> torch.Tensor:
    """fp32 softmax(q·kᵀ/√d)·v of each row over its context, K/V heads shared by groups of
    query heads (GQA); [B, H, D] fp32."""
    out = []
    group = q.shape[1] // k_pool.shape[2]
    for row in range(len(q)):
        n = int(lens[row])
        blocks = tables[row, :-(-n // k_pool.shape[1])]
        k = k_pool[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)   # [n, H, D]
        v = v_pool[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * HD ** -0.5
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def assert_close_to_reference(out: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: within the output's own rounding (half a bf16 ulp ≤ |x|·2⁻⁸) plus fp32 summation
    error; fp32: 1e-5."""
    err = (out.float() - want).abs()
    if out.dtype == torch.bfloat16:
        bound = want.abs() * 2.0 ** -8 + 2e-5
    else:
        bound = torch.full_like(want, 1e-5)
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (f"error {err.flatten()[worst]:.3g} > bound "
                                        f"{bound.flatten()[worst]:.3g}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_contexts_match_dense_fp32(request, decode, dtype):
    """SmolLM2's shape (9 query heads over 3 KV heads, 16-token blocks): contexts from 1 token to
    1,537 (ending inside a block, on its edge, one past it), 12 rows, shuffled tables."""
    if dtype == torch.float32 and request.node.callspec.params["decode"] == "avx2":
        pytest.skip("fp32 pools take the generic kernel in every build; 'default' covers it")
    contexts = [1, 15, 16, 17, 100, 511, 1024, 1499, 1500, 1501, 1536, 1537]
    case = make_case(contexts, kv_heads=3, group=3, block=16, dtype=dtype, seed=0)
    assert_close_to_reference(decode(*case), dense_reference(*case))


def test_sharp_late_maximum_rescales_earlier_keys(decode):
    """Large queries make the softmax sharp and its running maximum jump late in the context
    (the online rescaling of what was accumulated before), across 1,500 keys."""
    case = make_case([1500, 1501, 777], kv_heads=3, group=3, block=16, dtype=torch.bfloat16,
                     seed=1, q_scale=6.0)
    q, k_pool, v_pool, tables, lens = case
    last = tables[0, (1500 - 1) // 16]
    k_pool[last, (1500 - 1) % 16] = (q[0, ::3] * 2).to(k_pool.dtype)   # key 1,499 matches row 0
    assert_close_to_reference(decode(*case), dense_reference(*case))


@pytest.mark.parametrize("kv_heads,group,block", [
    (3, 1, 16), (2, 2, 16), (5, 4, 16), (2, 8, 16),    # runs of 3, 2, 4 + 1 (ragged), 2 KV heads
    (3, 3, 32), (3, 3, 8), (3, 3, 24),                 # two tiles a block; blocks AMX cannot tile
])
def test_group_sizes_and_block_sizes(decode, kv_heads, group, block):
    contexts = [1, 9, 200, 1000, 1203, 1, 64, 65, 700, 333, 1100, 17]
    case = make_case(contexts, kv_heads, group, block, torch.bfloat16, seed=kv_heads * 100 + group + block)
    assert_close_to_reference(decode(*case), dense_reference(*case))


def test_row_bits_do_not_depend_on_the_batch_or_threads(decode, restore_threads):
    """32 rows at 1,400–1,560 tokens (6–7 context chunks each, a run of KV heads per work item)
    against each row alone, subsets, a permuted order, one thread, and rows alone on more threads
    than they have chunks (one KV head per item): the same bits."""
    g = torch.Generator().manual_seed(5)
    contexts = torch.randint(1400, 1561, (32,), generator=g).tolist()
    q, k_pool, v_pool, tables, lens = make_case(contexts, 3, 3, 16, torch.bfloat16, seed=2)
    together = decode(q, k_pool, v_pool, tables, lens)
    for row in range(32):
        alone = decode(q[row:row + 1], k_pool, v_pool, tables[row:row + 1], lens[row:row + 1])
        assert torch.equal(alone[0], together[row]), f"row {row}"
    perm = torch.randperm(32, generator=g)
    assert torch.equal(decode(q[perm], k_pool, v_pool, tables[perm], lens[perm]), together[perm])
    for rows in ([0, 31], list(range(3, 11)), list(range(0, 32, 2))):
        idx = torch.tensor(rows)
        assert torch.equal(decode(q[idx], k_pool, v_pool, tables[idx], lens[idx]), together[idx])
    torch.set_num_threads(1)
    assert torch.equal(decode(q, k_pool, v_pool, tables, lens), together)
    torch.set_num_threads(8)
    for row in (0, 13, 31):
        alone = decode(q[row:row + 1], k_pool, v_pool, tables[row:row + 1], lens[row:row + 1])
        assert torch.equal(alone[0], together[row]), f"row {row} on 8 threads"


@pytest.mark.parametrize("bad,message", [
    ("len_zero", "a row's context is 1 to"), ("len_past_table", "a row's context is 1 to"),
    ("block_past_pool", "not a block of the pool"), ("negative_block", "not a block of the pool"),
    ("rows_differ", "for q's B rows")])
def test_bad_lengths_and_tables_raise(bad, message):
    """A length outside 1 .. the table's tokens, a table entry outside the pool, or tables / lens
    for another number of rows raise (RuntimeError naming what is wrong) before any read."""
    q, k_pool, v_pool, tables, lens = make_case([40, 17], kv_heads=3, group=3, block=16,
                                                dtype=torch.bfloat16, seed=4)
    tables, lens = tables.clone(), lens.clone()
    if bad == "len_zero":
        lens[1] = 0
    elif bad == "len_past_table":
        lens[0] = tables.shape[1] * 16 + 1
    elif bad == "block_past_pool":
        tables[1, 1] = k_pool.shape[0]
    elif bad == "negative_block":
        tables[0, 0] = -1
    else:
        lens = lens[:1].contiguous()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.genserve.paged_decode(q, k_pool, v_pool, tables, lens, HD ** -0.5)

