"""BlockPool: ref counts, copy-on-write and the prefix cache's chained hashes and LRU eviction."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool, BlockPoolError, HASH_BYTES, prefix_block_hashes

BS = 4


def test_hashes_are_chained_over_full_blocks_only():
    a = prefix_block_hashes(list(range(10)), BS)
    assert len(a) == 2 and all(len(h) == HASH_BYTES for h in a)
    # Same second block after a different first block: a different hash (the chain).
    b = prefix_block_hashes([9, 9, 9, 9] + list(range(4, 8)), BS)
    assert a[0] != b[0] and a[1] != b[1]
    # A shared first block hashes the same whatever follows; the salt separates namespaces.
    c = prefix_block_hashes(list(range(4)) + [7, 7, 7, 7], BS)
    assert c[0] == a[0] and c[1] != a[1]
    assert prefix_block_hashes(list(range(8)), BS, salt=b"other") != a
    # Token ids are hashed as int32, not bytes of a small range: 256 and 0 differ.
    assert prefix_block_hashes([256, 0, 0, 0], BS) != prefix_block_hashes([0, 1, 0, 0], BS)


def _computed(pool: BlockPool, rid: str, tokens: list[int]) -> list[bytes]:
    """Give `rid` blocks for `tokens` and register its full blocks, as after its prefill."""
    hashes = prefix_block_hashes(tokens, BS)
    pool.ensure_capacity(rid, len(tokens))
    pool.register_prefix(rid, hashes, len(hashes))
    return hashes


def test_freed_blocks_stay_cached_and_count_as_free():
    pool = BlockPool(8, BS, prefix_caching=True)
    hashes = _computed(pool, "a", list(range(10)))   # 3 blocks, 2 full
    table = list(pool.table("a"))
    assert pool.num_cached == 2 and pool.num_free == 5
    assert pool.free("a") == 3
    assert pool.num_free == 8 and pool.num_cached == 2 and pool.num_cached_unused == 2
    pool.check_all_free()
    # A new request with the same first 8 tokens finds both blocks, in order.
    assert pool.cached_prefix(prefix_block_hashes(list(range(8)) + [5] * 8, BS)) == table[:2]
    assert pool.cached_prefix(hashes[:1]) == table[:1]
    assert pool.cached_prefix(prefix_block_hashes([1] * 8, BS)) == []


def test_attach_takes_references_and_removes_from_the_evictable_list():
    pool = BlockPool(6, BS, prefix_caching=True)
    hashes = _computed(pool, "a", list(range(8)))
    blocks = pool.cached_prefix(hashes)
    pool.attach_prefix("b", blocks)                  # while a still holds them
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free("a")
    assert pool.num_cached_unused == 0 and pool.num_free == 4
    pool.ensure_capacity("b", 12)                    # one new block after the cached two
    assert pool.table("b")[:2] == blocks and len(pool.table("b")) == 3
    pool.free("b")
    assert pool.num_cached_unused == 2 and pool.num_free == 6
    with pytest.raises(BlockPoolError):
        pool.attach_prefix("c", [5])                 # block 5 was never registered


def test_eviction_is_least_recently_used_and_only_when_the_free_list_is_empty():
    pool = BlockPool(4, BS, prefix_caching=True)
    old = _computed(pool, "old", [1] * 4)
    new = _computed(pool, "new", [2] * 4)
    pool.free("old")
    pool.free("new")                                 # "new" is the more recently used
    pool.ensure_capacity("x", 8)                     # two blocks: the free list covers them
    assert pool.num_cached == 2
    pool.ensure_capacity("y", 4)                     # free list empty: evict the LRU ("old")
    assert pool.cached_prefix(old) == [] and len(pool.cached_prefix(new)) == 1
    assert pool.num_cached == 1 and pool.num_free == 1
    # y's block (the evicted one) is plain now: freed, it goes to the free list, and the next
    # allocation takes it rather than the cached block.
    pool.free("y")
    pool.attach_prefix("z", pool.cached_prefix(new))
    pool.free("z")
    pool.ensure_capacity("w", 4)
    assert pool.cached_prefix(new) != [] and pool.num_cached == 1
    for rid in ("x", "w"):
        pool.free(rid)
    pool.check_all_free()


def test_duplicate_prefix_keeps_the_first_block_and_frees_the_second():
    pool = BlockPool(6, BS, prefix_caching=True)
    _computed(pool, "a", [3] * 8)
    first = list(pool.table("a"))
    _computed(pool, "b", [3] * 8)                    # computed at the same time: not registered
    assert pool.num_cached == 2
    pool.free("b")
    assert pool.num_cached_unused == 0 and pool.num_free == 4   # b's copies went to the free list
    pool.free("a")
    assert pool.cached_prefix(prefix_block_hashes([3] * 8, BS)) == first
    pool.check_all_free()


def test_prefix_caching_off_frees_at_once_and_never_matches():
    pool = BlockPool(4, BS)
    hashes = _computed(pool, "a", list(range(8)))
    assert pool.num_cached == 0
    pool.free("a")
    assert pool.cached_prefix(hashes) == [] and pool.num_free == 4
    pool.check_all_free()


def test_register_checks_its_arguments():
    pool = BlockPool(4, BS, prefix_caching=True)
    pool.ensure_capacity("a", 4)
    with pytest.raises(BlockPoolError):
        pool.register_prefix("a", prefix_block_hashes([1] * 8, BS), 2)
    with pytest.raises(BlockPoolError):
        pool.attach_prefix("a", [])                  # a already has a table
