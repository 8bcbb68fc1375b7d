"""The KV block pool: free list, reference counts and block tables.

This is the only code that hands out block ids (PagedAttention, Kwon et al. 2023). A block holds
the keys and values of `block_size` consecutive tokens of one sequence; a sequence's block table
lists its blocks in position order, so token position p lives in block `table[p // block_size]`
at offset `p % block_size`.
"""

from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """A block-accounting invariant broke (double free, free of an unknown table...). A bug."""


class BlockPool:
    """Free list + `ref_count[block_id]` + `block_table[request_id]`.

    Args:
        num_blocks: blocks in the pool (the KV tensors' first dimension).
        block_size: tokens per block.

    Check/act pairs: call `can_allocate(n)` before `ensure_capacity`, which raises
    `BlockPoolError` when the free list cannot cover the request (a scheduler bug).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

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
        """True when the free list holds at least `num_blocks` blocks."""
        return num_blocks <= len(self._free)

    # -- actions ----------------------------------------------------------------------------
    def ensure_capacity(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow `request_id`'s table to cover positions [0, num_tokens); returns the new blocks.

        Raises:
            BlockPoolError: the free list is too short (check `can_allocate` first).
        """
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            raise BlockPoolError(f"{request_id}: needs {need} blocks, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(need)]
        for b in new:
            self._ref_count[b] = 1
        self._tables.setdefault(request_id, []).extend(new)
        return new

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
        if not self._free:
            raise BlockPoolError(f"{request_id}: copy-on-write needs a block, none free")
        dst = self._free.popleft()
        self._ref_count[dst] = 1
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

        Returns the number of blocks returned to the free list. Unknown ids free nothing.
        Raises BlockPoolError on a block whose ref_count is already 0 (a double free).
        """
        returned = 0
        for b in self._tables.pop(request_id, []):
            if self._ref_count[b] <= 0:
                raise BlockPoolError(f"block {b} freed with ref_count {self._ref_count[b]}")
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free.append(b)
                returned += 1
        return returned

    def check_all_free(self) -> None:
        """Raise BlockPoolError unless every block is free with ref_count 0 and no table is held."""
        if self._tables or len(self._free) != self.num_blocks or any(self._ref_count):
            raise BlockPoolError(
                f"pool not empty: {len(self._free)}/{self.num_blocks} free, "
                f"{len(self._tables)} tables, {sum(1 for r in self._ref_count if r)} referenced")
