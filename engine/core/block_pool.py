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


class BlockPool:
    """Free list + `ref_count[block_id]` + `block_table[request_id]` + the prefix cache.

    Args:
        num_blocks: blocks in the pool (the KV tensors' first dimension).
        block_size: tokens per block.
        prefix_caching: keep registered blocks cached after their last reference goes (see the
            module docstring); False frees every block at once, as before prefix caching.

    Check/act pairs: call `can_allocate(n)` before `ensure_capacity`, which raises
    `BlockPoolError` when the free list cannot cover the request (a scheduler bug).
    """

    @classmethod
    def from_config(cls, config: EngineConfig, num_blocks: int) -> BlockPool:
        """A pool of `num_blocks` blocks of `config.block_size` tokens, with prefix caching as
        `config.prefix_caching` says (the one place a serving pool is made)."""
        return cls(num_blocks, config.block_size, prefix_caching=config.prefix_caching)

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._block_hash: dict[int, bytes] = {}       # registered block -> its prefix hash
        self._cached: dict[bytes, int] = {}           # prefix hash -> block
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
        """Blocks of the longest cached prefix: block i for hashes[i], i = 0, 1, ... until a miss.

        Args:
            hashes: the request's `prefix_block_hashes`.
        Returns:
            Block ids in position order (empty when prefix caching is off or block 0 misses).
        """
        blocks: list[int] = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def ref_count(self, block_id: int) -> int:
        """References to `block_id` (0 when free; above 1 when n samples share a prompt)."""
        return self._ref_count[block_id]

    def table(self, request_id: str) -> list[int]:
        """The block table of `request_id` (empty when it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks `request_id` needs so that its table covers `num_tokens` positions."""
        have = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

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

    # -- actions ----------------------------------------------------------------------------
    def ensure_capacity(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow `request_id`'s table to cover positions [0, num_tokens); returns the new blocks.

        Raises:
            BlockPoolError: the free list is too short (check `can_allocate` first).
        """
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.num_free:
            raise BlockPoolError(f"{request_id}: needs {need} blocks, {self.num_free} free")
        new = [self._take() for _ in range(need)]
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def attach_prefix(self, request_id: str, blocks: Sequence[int]) -> None:
        """Start `request_id`'s table with cached `blocks` (from `cached_prefix`), ref + 1 each.

        Raises:
            BlockPoolError: the request already has a table, or a block is not cached.
        """
        if self._tables.get(request_id):
            raise BlockPoolError(f"{request_id} already has a block table")
        for b in blocks:
            if b not in self._block_hash:
                raise BlockPoolError(f"block {b} is not in the prefix cache")
            if self._ref_count[b] == 0:
                del self._evictable[b]
            self._ref_count[b] += 1
        self._tables[request_id] = list(blocks)

    def register_prefix(self, request_id: str, hashes: Sequence[bytes], num_blocks: int,
                        first: int = 0) -> int:
        """Register blocks `first` .. `num_blocks` - 1 of `request_id`'s table under the same
        entries of `hashes` (the earlier blocks were registered already, or are not to be).

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
        table = self._tables.get(request_id, [])
        if num_blocks > len(table) or num_blocks > len(hashes):
            raise BlockPoolError(f"{request_id}: cannot register {num_blocks} blocks "
                                 f"({len(table)} in table, {len(hashes)} hashes)")
        added = 0
        for b, h in zip(table[first:num_blocks], hashes[first:num_blocks]):
            if b in self._block_hash or h in self._cached:
                continue
            self._block_hash[b] = h
            self._cached[h] = b
            added += 1
        return added

    def share(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give `child_id` the parent's blocks covering [0, num_tokens), ref_count + 1 each.

        Used for n > 1 samples of one prompt. Raises BlockPoolError if the child has a table.
        """
        if child_id in self._tables:
            raise BlockPoolError(f"{child_id} already has a block table")
        blocks = self._tables[parent_id][: -(-num_tokens // self.block_size)]
        for b in blocks:
            self._ref_count[b] += 1
        self._tables[child_id] = list(blocks)

    def copy_on_write(self, request_id: str, position: int) -> tuple[int, int] | None:
        """Make the block holding `position` private to `request_id` before it is written.

        When that block is shared (ref_count > 1), a free block replaces it in the table and the
        shared block loses one reference; returns (source, destination) for the executor to
        copy. Returns None when the block is already private.
        Raises BlockPoolError when a copy is needed and the free list is empty.
        """
        table = self._tables[request_id]
        i = position // self.block_size
        src = table[i]
        if self._ref_count[src] <= 1:
            return None
        if not self.num_free:
            raise BlockPoolError(f"{request_id}: copy-on-write needs a block, none free")
        dst = self._take()
        self._ref_count[src] -= 1
        table[i] = dst
        return src, dst

    def is_shared(self, request_id: str, position: int) -> bool:
        """True when the block holding `position` of `request_id` has other references."""
        table = self._tables.get(request_id, ())
        i = position // self.block_size
        return i < len(table) and self._ref_count[table[i]] > 1

    def free(self, request_id: str) -> int:
        """Drop `request_id`'s table; blocks whose ref_count reaches 0 return to the free list.

        Returns the number of blocks that became free (cached ones included). Unknown ids free
        nothing.
        Raises BlockPoolError on a block whose ref_count is already 0 (a double free).
        """
        returned = 0
        # Last block first: a sequence's tail becomes the least recently used, so eviction eats
        # cached prefixes from their ends and the shared beginnings stay (as vLLM frees them).
        for b in reversed(self._tables.pop(request_id, [])):
            if self._ref_count[b] <= 0:
                raise BlockPoolError(f"block {b} freed with ref_count {self._ref_count[b]}")
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                if b in self._block_hash:
                    self._evictable[b] = None       # most recently used last
                else:
                    self._free.append(b)
                returned += 1
        return returned

    def check_all_free(self) -> None:
        """Raise BlockPoolError unless every block is free (cached-but-unused counts as free)
        with ref_count 0 and no table is held."""
        if self._tables or self.num_free != self.num_blocks or any(self._ref_count):
            raise BlockPoolError(
                f"pool not empty: {self.num_free}/{self.num_blocks} free, "
                f"{len(self._tables)} tables, {sum(1 for r in self._ref_count if r)} referenced")
