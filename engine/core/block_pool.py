"""The KV block pool: free list, reference counts and block tables.

This is the only code that hands out block ids (PagedAttention, Kwon et al. 2023). A block holds
the keys and values of `block_size` consecutive tokens of one sequence; a sequence's block table
lists its blocks in position order, so token position p lives in block `table[p // block_size]`
at offset `p % block_size`.

Prefix caching (as vLLM's automatic prefix caching and SGLang's radix cache): a full block of
prompt tokens can be registered under a hash chained over the previous block's hash and its own
token ids (`prefix_block_hashes`), so the hash names the whole prefix up to the block's end. A
later request whose prompt starts with the same tokens finds those blocks (`cached_prefix`) and
takes a reference to them (`attach_prefix`) instead of computing them again. A registered block
whose reference count drops to 0 is not returned to the free list: it stays cached, on a
least-recently-used list, and is taken back (its hash forgotten) only when the free list is empty
and a block is needed. Cached-but-unused blocks count as free everywhere (`num_free`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from engine.config import EngineConfig

HASH_BYTES = 16
"""Digest size of a block hash (BLAKE2b, 128 bits: collisions are out of reach for any cache)."""


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`.

    hash[i] = BLAKE2b-128(hash[i-1] || token ids of block i as little-endian int32), with
    hash[-1] = `salt`, so equal hashes mean equal token prefixes through block i's end (the
    scheme of vLLM's prefix caching). Anything else that changes a block's keys and values
    (another model or dtype) is a property of the engine process, whose pool is its own; `salt`
    is there for a caller that serves several.

    Args:
        token_ids: the sequence's token ids.
        block_size: tokens per block.
        salt: bytes mixed into the first block's hash.
    Returns:
        len(token_ids) // block_size hashes of HASH_BYTES bytes; a trailing partial block has none.
    """
    hashes: list[bytes] = []
    parent = salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("i", token_ids[start:start + block_size])
        if block.itemsize != 4:                     # pragma: no cover - every CPython platform
            raise RuntimeError("array('i') is not 32-bit on this platform")
        parent = hashlib.blake2b(parent + block.tobytes(), digest_size=HASH_BYTES).digest()
        hashes.append(parent)
    return hashes


class BlockPoolError(RuntimeError):
    """A block-accounting invariant broke (double free, free of an unknown table...). A bug."""


NULL_BLOCK = 0
"""The block a sliding group's table points at where its window dropped a block: reserved (never
handed out) in a pool with sliding groups, zero-filled, read only under a mask that hides it."""


class BlockPool:
    """Free list + `ref_count[block_id]` + block tables per request and KV group + the prefix cache.

    Args:
        num_blocks: blocks in the pool (the KV tensors' block dimension).
        block_size: tokens per block.
        prefix_caching: keep registered blocks cached after their last reference goes (see the
            module docstring); False frees every block at once, as before prefix caching.
        windows: per KV group (`engine.core.kv_groups.KVGroups.windows`), None for a global group
            or its sliding window in tokens. The default is one global group (every model without
            a sliding window). With a sliding group, block `NULL_BLOCK` is reserved.

    A request holds one table per group; all have the same length (position p lives at index
    p // block_size of each), and a sliding group's entries its window can no longer see are
    `NULL_BLOCK` once `slide` dropped them. `table(rid)` is group 0's, `tables(rid)` all of them.
    The prefix cache keys a block by (group, prefix hash): group g's blocks serve group g only.

    Attributes:
        num_usable: blocks that can be handed out: `num_blocks`, less the null block with
            sliding groups.
        num_groups: KV groups (block tables per request).
        sliding: True when some group has a sliding window (then `slide` gives blocks back).

    Check/act pairs: call `can_allocate(n)` before `ensure_capacity`, which raises
    `BlockPoolError` when the free list cannot cover the request (a scheduler bug).
    """

    @classmethod
    def from_config(cls, config: EngineConfig, num_blocks: int,
                    windows: Sequence[int | None] = (None,)) -> BlockPool:
        """A pool of `num_blocks` blocks of `config.block_size` tokens, with prefix caching as
        `config.prefix_caching` says and the KV groups' `windows` (the one place a serving pool
        is made)."""
        return cls(num_blocks, config.block_size, prefix_caching=config.prefix_caching, windows=windows)

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 windows: Sequence[int | None] = (None,)) -> None:
        if not windows:
            raise ValueError("a block pool needs at least one KV group")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.sliding = any(w is not None for w in self.windows)
        self._null = NULL_BLOCK if self.sliding else None  # reserved in a pool with sliding groups
        first = 1 if self.sliding else 0
        self.num_usable = num_blocks - first
        self._free: deque[int] = deque(range(first, num_blocks))
        self._ref_count = [0] * num_blocks
        self._tables: dict[str, list[list[int]]] = {}
        self._block_hash: dict[int, tuple[int, bytes]] = {}  # registered block -> (group, hash)
        self._cached: dict[tuple[int, bytes], int] = {}      # (group, prefix hash) -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; LRU first

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a request can be given: the free list plus cached blocks no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, in use or not."""
        return len(self._cached)

    @property
    def num_cached_unused(self) -> int:
        """Cached blocks no request holds (counted in `num_free`, evicted least recently used)."""
        return len(self._evictable)

    def cached_unused_blocks(self) -> list[int]:
        """Ids of the cached blocks no request holds, least recently used first."""
        return list(self._evictable)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Group 0's blocks of the longest cached prefix: block i for hashes[i], i = 0, 1, ...
        until a miss (for a pool of one global group, the whole answer; with several groups see
        `group_hit`).

        Args:
            hashes: the request's `prefix_block_hashes`.
        Returns:
            Block ids in position order (empty when prefix caching is off or block 0 misses).
        """
        blocks: list[int] = []
        for h in hashes:
            b = self._cached.get((0, h))
            if b is None:
                break
            blocks.append(b)
        return blocks

    def group_hit(self, hashes: Sequence[bytes], num_blocks: int) -> list[list[int]] | None:
        """Every group's blocks for a prefix hit of `num_blocks` blocks, or None when some group
        lacks one it needs.

        A global group needs blocks 0 .. num_blocks - 1 cached; a sliding group with window W
        only those its window still sees from the first position computed next
        (p = num_blocks × block_size: keys from p - W + 1), the earlier entries are `NULL_BLOCK`.

        Args:
            hashes: the request's `prefix_block_hashes` (at least `num_blocks` of them).
            num_blocks: the hit's length in blocks.
        Returns:
            Per group, num_blocks block ids in position order.
        """
        groups: list[list[int]] = []
        for g, window in enumerate(self.windows):
            first = self._first_visible(num_blocks * self.block_size, window)
            table = [NULL_BLOCK] * first
            for h in hashes[first:num_blocks]:
                b = self._cached.get((g, h))
                if b is None:
                    return None
                table.append(b)
            groups.append(table)
        return groups

    def _first_visible(self, position: int, window: int | None) -> int:
        """Index of the first block a query at `position` reads through a group with `window`."""
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def ref_count(self, block_id: int) -> int:
        """References to `block_id` (0 when free; above 1 when n samples share a prompt)."""
        return self._ref_count[block_id]

    def table(self, request_id: str, group: int = 0) -> list[int]:
        """The block table of `request_id` in KV group `group` (empty when it holds none). Do not
        mutate."""
        tables = self._tables.get(request_id)
        return tables[group] if tables else []

    def tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """`request_id`'s block tables, one per KV group, as tuples (empty ones when it holds
        none)."""
        tables = self._tables.get(request_id)
        return tuple(map(tuple, tables)) if tables else ((),) * self.num_groups

    def held_blocks(self, request_id: str) -> list[int]:
        """Every block `request_id` holds, all groups, `NULL_BLOCK` entries left out."""
        return [b for t in self._tables.get(request_id, ()) for b in t if b != self._null]

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks `ensure_capacity(request_id, num_tokens)` takes now: in every group, the
        entries that extend its table to cover `num_tokens` positions."""
        have = len(self.table(request_id))
        return max(0, -(-num_tokens // self.block_size) - have) * self.num_groups

    def blocks_to_compute(self, request_id: str | None, num_tokens: int, step_tokens: int) -> int:
        """Blocks `request_id` (None: a request holding none) still has to take to compute up to
        `num_tokens` positions, at most `step_tokens` of them a step: a global group needs the
        whole table, a sliding group at most what a step's queries see
        (⌈(W - 1 + step_tokens) / block_size⌉ + 1 blocks), less what it holds. The admission
        estimate; equal to `blocks_needed` without sliding groups."""
        tables = self._tables.get(request_id, ()) if request_id is not None else ()
        bs, total = self.block_size, -(-num_tokens // self.block_size)
        need = 0
        for g, window in enumerate(self.windows):
            held = sum(b != self._null for b in tables[g]) if tables else 0
            bound = total if window is None else min(total, -(-(window - 1 + step_tokens) // bs) + 1)
            need += max(0, bound - held)
        return need

    def max_request_tokens(self, step_tokens: int, limit: int) -> int:
        """The longest request (prompt + answer, in tokens, at most `limit`) that fits the empty
        pool alone: the largest n with `blocks_to_compute(None, n, step_tokens)` ≤ `num_usable`,
        so a request of n tokens is admitted once nothing else holds blocks. 0 when not even one
        token fits.

        Args:
            step_tokens: the most prompt tokens of one request a step computes
                (`StepBudget.request_step_tokens`).
            limit: the largest n asked about (the engine's `max_context`).
        """
        lo, hi = 0, limit                      # blocks_to_compute grows with n: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_to_compute(None, mid, step_tokens) <= self.num_usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def can_allocate(self, num_blocks: int) -> bool:
        """True when at least `num_blocks` blocks are free (cached-but-unused ones included)."""
        return num_blocks <= self.num_free

    def _take(self) -> int:
        """A block with ref_count 1: from the free list, else the least recently used cached
        block that no request holds (its hash is forgotten). The caller checked `num_free`."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_hash.pop(b)]
        self._ref_count[b] = 1
        return b

    def _release(self, b: int) -> bool:
        """One reference to `b` less; True when it became free (cached ones go to the LRU list).

        Raises BlockPoolError on a block whose ref_count is already 0 (a double free)."""
        if self._ref_count[b] <= 0:
            raise BlockPoolError(f"block {b} freed with ref_count {self._ref_count[b]}")
        self._ref_count[b] -= 1
        if self._ref_count[b]:
            return False
        if b in self._block_hash:
            self._evictable[b] = None       # most recently used last
        else:
            self._free.append(b)
        return True

    # -- actions ----------------------------------------------------------------------------
    def ensure_capacity(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow `request_id`'s tables to cover positions [0, num_tokens); returns the new blocks.

        Raises:
            BlockPoolError: the free list is too short (check `can_allocate` first).
        """
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.num_free:
            raise BlockPoolError(f"{request_id}: needs {need} blocks, {self.num_free} free")
        tables = self._tables.setdefault(request_id, [[] for _ in self.windows])
        per_group = need // self.num_groups
        new = []
        for table in tables:
            blocks = [self._take() for _ in range(per_group)]
            table.extend(blocks)
            new.extend(blocks)
        return new

    def slide(self, request_id: str, position: int) -> int:
        """Drop from each sliding group's table of `request_id` the blocks a query at `position`
        or later can no longer see (wholly before position - W + 1): they lose this reference and
        their entries become `NULL_BLOCK`. Call with the first position a step computes.

        Returns:
            Blocks that became free (cached ones included).
        """
        tables = self._tables.get(request_id) if self.sliding else None
        if not tables:
            return 0
        returned = 0
        for table, window in zip(tables, self.windows):
            if window is None:
                continue
            # Last dropped first onto the LRU list, as `free` orders a sequence's blocks.
            for i in reversed(range(min(self._first_visible(position, window), len(table)))):
                b = table[i]
                if b != self._null:
                    table[i] = NULL_BLOCK
                    returned += self._release(b)
        return returned

    def attach_prefix(self, request_id: str, blocks: Sequence[int] | Sequence[Sequence[int]]) -> None:
        """Start `request_id`'s tables with cached blocks, ref + 1 each: one table per group
        (`group_hit`), or, in a pool of one group, group 0's list (`cached_prefix`).
        `NULL_BLOCK` entries of a sliding group are kept as they are.

        Raises:
            BlockPoolError: the request already has a table, a block is not cached, or the
                tables' lengths differ.
        """
        if self._tables.get(request_id):
            raise BlockPoolError(f"{request_id} already has a block table")
        groups = [list(t) for t in blocks] if blocks and not isinstance(blocks[0], int) else [list(blocks)]
        if len(groups) != self.num_groups or len({len(t) for t in groups}) > 1:
            raise BlockPoolError(f"{request_id}: {len(groups)} tables of lengths "
                                 f"{[len(t) for t in groups]} for {self.num_groups} groups")
        for table in groups:
            for b in table:
                if b == self._null:
                    continue
                if b not in self._block_hash:
                    raise BlockPoolError(f"block {b} is not in the prefix cache")
                if self._ref_count[b] == 0:
                    del self._evictable[b]
                self._ref_count[b] += 1
        self._tables[request_id] = groups

    def register_prefix(self, request_id: str, hashes: Sequence[bytes], num_blocks: int,
                        first: int = 0) -> int:
        """Register blocks `first` .. `num_blocks` - 1 of `request_id`'s tables (each group's,
        under (group, hash)) with the same entries of `hashes` (the earlier blocks were
        registered already, or are not to be); `NULL_BLOCK` entries are skipped.

        Call once their keys and values are computed. A hash already cached under another block
        (two requests computed the same prefix at once) keeps the first block; the duplicate is
        freed normally when its request ends. No-op when prefix caching is off.
        Returns:
            The number of blocks newly registered.
        Raises:
            BlockPoolError: num_blocks exceeds the table or the hashes given.
        """
        if not self.prefix_caching:
            return 0
        table = self.table(request_id)
        if num_blocks > len(table) or num_blocks > len(hashes):
            raise BlockPoolError(f"{request_id}: cannot register {num_blocks} blocks "
                                 f"({len(table)} in table, {len(hashes)} hashes)")
        added = 0
        for g, table in enumerate(self._tables[request_id]):
            for b, h in zip(table[first:num_blocks], hashes[first:num_blocks]):
                key = (g, h)
                if b == self._null:
                    continue
                if b in self._block_hash or key in self._cached:
                    continue
                self._block_hash[b] = key
                self._cached[key] = b
                added += 1
        return added

    def share(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give `child_id` the parent's blocks covering [0, num_tokens) in every group,
        ref_count + 1 each (`NULL_BLOCK` entries copied as they are).

        Used for n > 1 samples of one prompt. Raises BlockPoolError if the child has a table.
        """
        if child_id in self._tables:
            raise BlockPoolError(f"{child_id} already has a block table")
        n = -(-num_tokens // self.block_size)
        tables = [list(t[:n]) for t in self._tables[parent_id]]
        for b in (b for t in tables for b in t):
            if b != self._null:
                self._ref_count[b] += 1
        self._tables[child_id] = tables

    def copy_on_write(self, request_id: str, position: int) -> list[tuple[int, int]]:
        """Make the blocks holding `position` private to `request_id` before they are written.

        In each group where that block is shared (ref_count > 1), a free block replaces it in the
        table and the shared block loses one reference. Returns the (source, destination) pairs
        for the executor to copy (empty when every block is already private).
        Raises BlockPoolError when a copy is needed and the free list is empty.
        """
        copies = []
        i = position // self.block_size
        for table in self._tables[request_id]:
            src = table[i]
            if self._ref_count[src] <= 1:
                continue
            if not self.num_free:
                raise BlockPoolError(f"{request_id}: copy-on-write needs a block, none free")
            dst = self._take()
            self._ref_count[src] -= 1
            table[i] = dst
            copies.append((src, dst))
        return copies

    def is_shared(self, request_id: str, position: int) -> int:
        """How many of `request_id`'s blocks holding `position` (one per group) have other
        references: the blocks `copy_on_write` would take (0: none; a count, usable as a bool)."""
        i = position // self.block_size
        return sum(i < len(t) and t[i] != self._null and self._ref_count[t[i]] > 1
                   for t in self._tables.get(request_id, ()))

    def free(self, request_id: str) -> int:
        """Drop `request_id`'s tables; blocks whose ref_count reaches 0 return to the free list.

        Returns the number of blocks that became free (cached ones included). Unknown ids free
        nothing.
        Raises BlockPoolError on a block whose ref_count is already 0 (a double free).
        """
        returned = 0
        for table in self._tables.pop(request_id, []):
            # Last block first: a sequence's tail becomes the least recently used, so eviction
            # eats cached prefixes from their ends and the shared beginnings stay (as vLLM frees).
            for b in reversed(table):
                if b != self._null:
                    returned += self._release(b)
        return returned

    def check_all_free(self) -> None:
        """Raise BlockPoolError unless every block is free (cached-but-unused counts as free)
        with ref_count 0 and no table is held."""
        if self._tables or self.num_free != self.num_usable or any(self._ref_count):
            raise BlockPoolError(
                f"pool not empty: {self.num_free}/{self.num_usable} free, "
                f"{len(self._tables)} tables, {sum(1 for r in self._ref_count if r)} referenced")
