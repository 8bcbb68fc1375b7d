"""KV groups: how mixed sliding-window / global layers split into groups, and what a sliding
group holds in the block pool as a request runs (the real scheduler over the SimExecutor)."""

from __future__ import annotations

import pytest

from engine.core.block_pool import NULL_BLOCK, BlockPool, BlockPoolError
from benchmarks.families import kv_blocks_held
from engine.core.kv_groups import KVGroups
from tests.engine.sim import make_request, sim_engine

GEMMA3_270M = tuple(None if i % 6 == 5 else 512 for i in range(18))   # 5 sliding : 1 global


def test_layers_split_into_equal_groups_global_first():
    g = KVGroups.for_layers(GEMMA3_270M, max_context=32768)
    assert g.group_size == 3 and g.windows == (None, 512, 512, 512, 512, 512)
    assert [i for i, grp in enumerate(g.layer_group) if grp == 0] == [5, 11, 17]
    assert g.layer_group[:5] == (1, 1, 1, 2, 2) and g.layer_slot[:5] == (0, 1, 2, 0, 1)
    # Gemma 3 1B: 4 global, 22 sliding: groups of 4, the last sliding group half empty
    one_b = tuple(None if i % 6 == 5 else 512 for i in range(26))
    g = KVGroups.for_layers(one_b, max_context=32768)
    assert g.group_size == 4 and g.windows == (None,) + (512,) * 6
    assert sorted(g.layer_slot[i] for i in range(26) if g.layer_group[i] == 6) == [0, 1]
    # one kind: one group of every layer, sliding or not
    assert KVGroups.for_layers((4096,) * 4, max_context=32768).windows == (4096,)
    assert KVGroups.for_layers((None,) * 4, max_context=8192) == KVGroups.single(4)
    # a window that covers the whole context is global
    assert KVGroups.for_layers((8192, None), max_context=8192) == KVGroups.single(2)
    with pytest.raises(ValueError, match="layer 1: sliding window 0"):
        KVGroups.for_layers((None, 0), max_context=8192)


def test_a_sliding_group_gives_back_what_its_window_no_longer_sees():
    pool = BlockPool(40, 16, windows=(None, 32))
    assert pool.num_free == 39                                # block 0 is the null block
    pool.ensure_capacity("r", 80)                             # 5 blocks in each group
    assert pool.num_free == 29
    # a query at position 80 sees keys 49..80: blocks 3.. of the sliding group
    assert pool.slide("r", 80) == 3
    assert pool.table("r", 1)[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in pool.table("r", 0)
    assert len(pool.held_blocks("r")) == 7 and pool.num_free == 32
    assert pool.slide("r", 80) == 0                           # nothing more to drop
    # n > 1: a child shares the live blocks; writing the shared last block copies it per group
    pool.share("r", "c", 80)
    assert len(pool.copy_on_write("c", 79)) == 2
    assert pool.free("r") == 2                                # its copied-away last blocks
    assert pool.free("c") == 7 and pool.num_free == 39
    pool.check_all_free()
    with pytest.raises(BlockPoolError, match="lengths"):
        pool.attach_prefix("x", [[], [1]])


def test_a_gemma3_request_at_8k_holds_under_a_quarter_of_the_all_global_kv_bytes():
    """The 270M layout (18 layers, window 512, blocks of 3 layers) against one global group
    (blocks of 18 layers): the bytes an 8,192-token request holds at its last step, and the most
    it held at any step (a prefill step's own tokens come on top of the window)."""
    groups = KVGroups.for_layers(GEMMA3_270M, max_context=8192)
    all_global = kv_blocks_held((None,), 18)
    assert all_global == (512 * 18, 512 * 18)                 # 8,192 tokens in every layer
    at_8k, peak = (h / all_global[0] for h in kv_blocks_held(groups.windows, groups.group_size))
    # 3 of 18 layers keep 8,192 tokens, 15 keep 512 + a block: (512 + 5 × 33) / (6 × 512)
    assert at_8k == (512 + 5 * 33) / (6 * 512), at_8k
    # a 1,024-token prefill step (alone, `prefill_token_budget_few_rows`) reads its window too
    assert peak < 0.4, peak


def test_prefix_hits_need_each_sliding_groups_window_blocks():
    engine, _ = sim_engine(num_blocks=201, kv_windows=(None, 32), prefix_caching=True)
    pool = engine.pool
    first = make_request(300, 2, api_key="k")
    engine.submit(first)
    engine.run_until_idle()
    # Four whole 64-token pieces are cached in each group (16 blocks each). The sliding group
    # gave its back at the first decode step (position 300 sees keys from 269: block 16 on),
    # before the request ended; like the rest they stay cached until evicted.
    assert pool.num_cached == pool.num_cached_unused == 2 * 16
    again = make_request(300, 2, api_key="k")
    engine.submit(again)
    engine.run_until_idle()
    assert again.stats.num_cached == 256      # global blocks 0..15, sliding 14..15 (keys from 226)
    # Evict the 16 least recently used cached blocks, the sliding group's (given back first at
    # each request's first decode step): a filler request takes the free list and 16 more.
    take = pool.num_free - pool.num_cached_unused + 16
    assert take % 2 == 0
    pool.ensure_capacity("filler", take // 2 * 16)
    pool.free("filler")
    assert pool.num_cached == 16 and pool.group_hit(again.prefix_hashes, 16) is None
    # every hit on the 64-token grid (64, 128, 192, 256) needs some of them: none is left
    third = make_request(300, 2, api_key="k")
    engine.submit(third)
    engine.run_until_idle()
    assert third.stats.num_cached == 0
    pool.check_all_free()


@pytest.mark.parametrize("windows, expected", [
    ((None,), 8 * 16),                 # one global group: every block of the pool
    ((None, None), 4 * 16),            # two global groups share the blocks
    # 7 usable (block 0 is the null block); at 16 tokens a step the sliding group holds up to
    # ⌈(32 - 1 + 16) / 16⌉ + 1 = 4 blocks: 3 + 3 fit, 4 + 4 do not
    ((None, 32), 3 * 16),
])
def test_max_context_is_lowered_to_the_longest_request_the_pool_holds(windows, expected):
    engine, _ = sim_engine(num_blocks=8, kv_windows=windows, max_context=8192,
                           prefill_token_budget=16, prefill_token_budget_few_rows=16,
                           prefill_piece=16)
    assert engine.config.max_context == expected
    # the longest request still runs to its end alone, holding the whole pool at its last step
    req = make_request(expected - 4, 4, ignore_eos=True)
    engine.submit(req)
    engine.run_until_idle(max_steps=10_000)
    assert len(req.generated) == 4
    engine.pool.check_all_free()


def test_a_pool_that_holds_every_request_leaves_max_context_alone():
    engine, _ = sim_engine(num_blocks=1024, max_context=4096)
    assert engine.config.max_context == 4096
    with pytest.raises(ValueError, match="holds no request"):
        sim_engine(num_blocks=2, kv_windows=(None, None, None))
