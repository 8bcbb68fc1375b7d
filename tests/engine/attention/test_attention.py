"""Paged attention against a dense reference, and its batch invariance, on random caches."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import GatherBuffer, store_kv
from engine.attention.paged_sdpa import prefill_attention
from tests.engine.attention_oracle import step_metadata

BS, KVH, HD, GROUP = 16, 3, 64, 3          # SmolLM2's shape: 9 query heads over 3 KV heads
H = KVH * GROUP



def dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """fp32 softmax(q·kᵀ/√d + causal) · v; q [T, H, hd], keys/values [L, KVH, hd]."""
    k = keys.float().repeat_interleave(GROUP, dim=1)                    # [L, H, hd]
    v = values.float().repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * HD ** -0.5    # [H, T, L]
    scores.masked_fill_(torch.arange(len(keys))[None, None, :] > positions[None, :, None],
                        float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


def fill(cache: torch.Tensor, table: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
    for p in range(len(keys)):
        cache[0, table[p // BS], p % BS] = keys[p]
        cache[1, table[p // BS], p % BS] = values[p]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_and_prefill_match_dense_attention(dtype, tol, kernels):
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 64, BS, KVH, HD, dtype=dtype)
    contexts = [1, 17, 64, 200, 333]           # decode rows: context incl. the new token
    prefill_ctx, prefill_start = 150, 86       # a 64-token piece at positions [86, 150)
    tables, nxt = [], 1
    for c in [*contexts, prefill_ctx]:
        tables.append(list(range(nxt, nxt + -(-c // BS))))
        nxt += len(tables[-1])
    prefill_table = tables.pop()
    kv = {}
    for name, c, table in [*zip(range(5), contexts, tables), ("p", prefill_ctx, prefill_table)]:
        k = torch.randn(c, KVH, HD, generator=g).to(dtype)
        v = torch.randn(c, KVH, HD, generator=g).to(dtype)
        fill(cache, table, k[:-1] if name != "p" else k[:prefill_start],
             v[:-1] if name != "p" else v[:prefill_start])
        kv[name] = (k, v)
    spans = [(c - 1, 1, t, True) for c, t in zip(contexts, tables)]
    spans.append((prefill_start, prefill_ctx - prefill_start, prefill_table, False))
    gather = None if kernels else GatherBuffer()       # as the executor builds it
    meta = step_metadata(spans, BS, dtype, kernels, gather)
    q = torch.randn(len(contexts) + 64, H, HD, generator=g).to(dtype)
    new_k = torch.cat([kv[i][0][-1:] for i in range(5)] + [kv["p"][0][prefill_start:]])
    new_v = torch.cat([kv[i][1][-1:] for i in range(5)] + [kv["p"][1][prefill_start:]])
    store_kv(new_k, new_v, cache, meta.slots)
    out = meta.backend.attend(q, cache, meta)
    for i, c in enumerate(contexts):
        want = dense_reference(q[i:i + 1], *kv[i], torch.tensor([c - 1]))
        assert (out[i:i + 1].float() - want).abs().max().item() < tol
    want = dense_reference(q[5:], *kv["p"], torch.arange(prefill_start, prefill_ctx))
    assert (out[5:].float() - want).abs().max().item() < tol


def test_decode_row_bits_do_not_depend_on_batch_or_padding(kernels):
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 400, BS, KVH, HD, generator=g).bfloat16()
    contexts = [5, 17, 64, 65, 100, 300, 513, 700, 1100, 1500]
    tables, nxt = [], 1
    for c in contexts:
        tables.append(list(range(nxt, nxt + -(-c // BS))))
        nxt += len(tables[-1])
    q = torch.randn(len(contexts), H, HD, generator=g).bfloat16()
    # The SDPA path gathers into one buffer across calls, as across steps: the first (largest)
    # call leaves stale keys behind for the smaller ones.
    gather = None if kernels else GatherBuffer()

    def decode(rows: list[int]) -> torch.Tensor:
        meta = step_metadata([(contexts[i] - 1, 1, tables[i], True) for i in rows],
                                       BS, torch.bfloat16, kernels, gather)
        k = cache[0, [tables[i][(contexts[i] - 1) // BS] for i in rows], [(contexts[i] - 1) % BS for i in rows]]
        v = cache[1, [tables[i][(contexts[i] - 1) // BS] for i in rows], [(contexts[i] - 1) % BS for i in rows]]
        store_kv(k, v, cache, meta.slots)
        return meta.backend.attend(q[rows], cache, meta)

    together = decode(list(range(len(contexts))))
    for i in range(len(contexts)):
        assert torch.equal(decode([i])[0], together[i]), f"row of context {contexts[i]}"
    assert torch.equal(decode([0, 9])[0], together[0])           # padded to 1,536 keys, not 64


def test_gather_buffer_is_reused_until_a_step_needs_more():
    buf = GatherBuffer()
    first = buf.take(1000, torch.bfloat16)
    assert first.shape == (1000,) and first.dtype == torch.bfloat16
    same = buf.take(1250, torch.bfloat16)                      # within the 1.25× headroom
    assert same.data_ptr() == first.data_ptr() and same.numel() == 1250
    assert buf.take(10, torch.bfloat16).data_ptr() == first.data_ptr()
    grown = buf.take(1251, torch.bfloat16)
    assert grown.data_ptr() != first.data_ptr() and grown.numel() == 1251
    assert buf.take(1500, torch.bfloat16).data_ptr() == grown.data_ptr()     # 1.25 × 1,251
    assert buf.take(100, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("start,length", [(0, 1), (0, 13), (5, 7), (0, 256), (256, 256),
                                          (100, 300), (1000, 17), (3000, 64), (0, 2100)])
def test_prefill_pieces_match_dense_attention_and_sdpa(kernels, start, length):
    """Pieces of every kind the scheduler cuts — first or later, tiles of 16 queries full or not,
    contexts ending inside a block or a 64-key softmax block, contexts of thousands of tokens (the
    long prompts' pieces) — on a shuffled block table."""
    g = torch.Generator().manual_seed(start * 7 + length)
    end = start + length
    pool = max(90, -(-end // BS) + 8)
    cache = torch.randn(2, pool, BS, KVH, HD, generator=g).bfloat16()
    table = torch.randperm(pool, generator=g)[:-(-end // BS)].tolist()
    meta = step_metadata([(start, length, table, False)], BS, torch.bfloat16, kernels)
    q = torch.randn(length, H, HD, generator=g).bfloat16()
    keys, values = (cache[i, table].reshape(-1, KVH, HD)[:end] for i in (0, 1))
    out = meta.backend.attend(q, cache, meta)
    want = dense_reference(q, keys, values, torch.arange(start, end))
    err = (out.float() - want).abs().max().item()
    sdpa = (prefill_attention(q, cache, meta.pieces[0]).float() - want).abs().max().item()
    assert err < 2e-2 and err <= 1.5 * sdpa + 1e-3, (err, sdpa)


@pytest.mark.parametrize("preferred", [True, False])
def test_prefill_pieces_run_the_kernel_only_where_it_is_preferred(monkeypatch, preferred):
    """With the kernels, a piece runs `paged_prefill` where `prefill_kernel_preferred` (no usable
    AMX) and torch's flash attention elsewhere: the output is bit for bit the chosen path's."""
    from engine import kernels as genserve_kernels
    if not genserve_kernels.prefill_kernel_available():
        pytest.skip("paged_prefill is built only where the CPU has AVX512-BF16, or AVX2 and FMA")
    monkeypatch.setattr(genserve_kernels, "prefill_kernel_preferred", lambda: preferred)
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(2, 40, BS, KVH, HD, generator=g).bfloat16()
    start, length = 192, 64
    table = torch.randperm(40, generator=g)[:-(-(start + length) // BS)].tolist()
    meta = step_metadata([(start, length, table, False)], BS, torch.bfloat16, True)
    q = torch.randn(length, H, HD, generator=g).bfloat16()
    out = meta.backend.attend(q, cache, meta)
    piece = meta.pieces[0]
    kernel = torch.ops.genserve.paged_prefill(q, cache[0], cache[1], piece.blocks, start, HD ** -0.5)
    sdpa = prefill_attention(q, cache, piece)
    assert not torch.equal(kernel, sdpa)          # the two paths round differently: the test can tell
    assert torch.equal(out, kernel if preferred else sdpa)


def test_a_steps_prefill_pieces_in_one_call_have_each_pieces_bits_alone():
    """`paged_prefill_pieces` (every piece of a step in one call, each context's values packed
    once) gives every piece the bits `paged_prefill` gives it alone: decode rows first, then two
    requests cut into consecutive pieces (which share a context) and a lone piece, tiles full
    and not; the backend groups the contexts and runs it."""
    from engine import kernels as genserve_kernels
    from engine.attention.cpu import PieceContexts
    if not genserve_kernels.prefill_kernel_preferred():
        pytest.skip("paged_prefill runs only where built and no usable AMX is present")
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 120, BS, KVH, HD, generator=g).bfloat16()
    blocks = torch.randperm(120, generator=g).tolist()
    a, b, c, d = blocks[:20], blocks[20:40], blocks[40:60], blocks[60:64]
    segments = [(40, 1, d, True), (17, 1, d[:2], True),                        # decode rows
                (0, 64, a, False), (64, 64, a, False), (128, 37, a, False),    # one prompt's pieces
                (192, 64, b, False), (256, 13, b, False),                      # a later part of another
                (5, 50, c, False)]                                             # a piece alone
    meta = step_metadata(segments, BS, torch.bfloat16, True)
    assert isinstance(meta.state, PieceContexts)
    assert meta.state.tables.shape[0] == 3                 # three contexts for the six pieces
    assert meta.state.pieces[:, 3].tolist() == [0, 0, 0, 1, 1, 2]
    q = torch.randn(sum(s[1] for s in segments), H, HD, generator=g).bfloat16()
    out = meta.backend.attend(q, cache, meta)
    for s in meta.pieces:
        alone = torch.ops.genserve.paged_prefill(q[s.q_start:s.q_end].contiguous(), cache[0], cache[1],
                                                 s.blocks, s.context_len - (s.q_end - s.q_start),
                                                 HD ** -0.5)
        assert torch.equal(out[s.q_start:s.q_end], alone), s.q_start
    both = meta.backend.attend(q[:2], cache, step_metadata(segments[:2], BS, torch.bfloat16, True))
    assert torch.equal(out[:2], both)                       # the decode rows as a decode-only step


def test_prefill_pieces_op_names_its_bad_arguments():
    from engine import kernels as genserve_kernels
    if not genserve_kernels.prefill_kernel_available():
        pytest.skip("paged_prefill is built only where the CPU has AVX512-BF16, or AVX2 and FMA")
    op = torch.ops.genserve.paged_prefill_pieces
    cache = torch.zeros(2, 4, BS, KVH, HD, dtype=torch.bfloat16)
    q = torch.zeros(8, H, HD, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match=r"rows \[4, 12\) outside q's 8"):
        op(q, cache[0], cache[1], tables, torch.tensor([[4, 8, 0, 0]]), 0.125)
    with pytest.raises(RuntimeError, match="cannot hold 40 tokens"):
        op(q, cache[0], cache[1], tables, torch.tensor([[0, 8, 32, 0]]), 0.125)
    with pytest.raises(RuntimeError, match="block 9 outside the pool"):
        op(q, cache[0], cache[1], torch.tensor([[0, 9]]), torch.tensor([[0, 8, 16, 0]]), 0.125)
    with pytest.raises(RuntimeError, match="context 1 out of range"):
        op(q, cache[0], cache[1], tables, torch.tensor([[0, 8, 0, 1]]), 0.125)
    with pytest.raises(RuntimeError, match=r"int64 \[P, 4\]"):
        op(q, cache[0], cache[1], tables, torch.tensor([[0, 8, 0]]), 0.125)
