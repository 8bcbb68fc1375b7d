"""Prefix caching over the block pool: what a request takes from the cache, what it offers back.

`BlockPool` keeps the cache (hash → block, reference counts, the LRU list of unused cached
blocks); this module is the policy on top, modelled on vLLM's `v1/core/kv_cache_manager.py`:

* `get_computed_blocks(req, align)`: the cached blocks a request takes at admission, one list
  per KV group (`engine.core.kv_groups`) — its longest cached prefix, never its whole prompt (its last prompt token is computed, to sample
  from) and cut to whole multiples of `align` tokens, so every token it still computes is cut on
  the same grid as from scratch (batch invariance). The scheduler passes `prefill_piece`.
* `take_computed_blocks(req, blocks)`: attach them to the request and count the hit.
* `cache_piece(req, start, length, align)`: offer a prompt piece just computed, when it is a
  whole `align`-aligned piece (a shorter tail piece would be cut elsewhere by a later prompt).

Scope: a block is found only by requests in the scope that computed it (`cache_scope`): under
`prefix_cache_scope` "key" (the default) the API key and the request's `cache_salt`, under
"global" the salt alone; under either, the request's LoRA adapter (its name and load id: a block
computed under adapter A never serves adapter B, the base model, or A loaded again). The scope is the salt of the first block's hash, so scopes never share a
hash, a block or a hit: one tenant's hit count and time to first token do not depend on what
another tenant sent.

Torch-free and clock-free, like the rest of `engine.core`.
"""

from __future__ import annotations

import hashlib

from engine.config import PREFIX_CACHE_SCOPES
from engine.core.block_pool import HASH_BYTES, BlockPool, prefix_block_hashes
from engine.core.request import Request

__all__ = ["KVCacheManager"]


class KVCacheManager:
    """Prefix-cache hits and registration for one `BlockPool`, and the hit counters.

    Args:
        pool: the block pool (its `prefix_caching` flag turns everything here off when False).
        scope: "key" (blocks shared per API key and cache salt) or "global" (per cache salt
            only); `engine.config.PREFIX_CACHE_SCOPES`.

    Attributes:
        prefix_queried_tokens: prompt tokens looked up in the prefix cache at admission.
        prefix_hit_tokens: ... of which the cache held (not computed again).

    Raises:
        ValueError: `scope` is not one of `PREFIX_CACHE_SCOPES`.

    Thread-safety: none; the engine lock serialises every call.
    """

    def __init__(self, pool: BlockPool, scope: str = "key") -> None:
        if scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"scope must be one of {PREFIX_CACHE_SCOPES}, got {scope!r}")
        self.pool = pool
        self.scope = scope
        self.block_size = pool.block_size
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def cache_scope(self, req: Request) -> bytes:
        """The salt of `req`'s first block hash: a digest of its API key (scope "key"), its
        `cache_salt` and its LoRA adapter (name and load id, `Request.lora`); empty for the global
        scope without a salt or an adapter (the unscoped hashes)."""
        lora = req.lora
        if self.scope == "global" and not req.cache_salt and lora is None:
            return b""
        key = req.api_key if self.scope == "key" else ""
        adapter = "" if lora is None else f"\0lora\0{lora.lora_id}\0{len(lora.name)}\0{lora.name}"
        parts = f"{self.scope}\0{len(key)}\0{key}\0{req.cache_salt}{adapter}".encode()
        return hashlib.blake2b(parts, digest_size=HASH_BYTES, person=b"genserve-scope").digest()

    def block_hashes(self, req: Request) -> list[bytes]:
        """`req`'s prompt block hashes in its cache scope (computed once and kept on
        `req.prefix_hashes`; none when prefix caching is off)."""
        if not self.pool.prefix_caching:
            return []
        if req.prefix_hashes is None:
            req.prefix_hashes = prefix_block_hashes(req.prompt_ids, self.block_size, self.cache_scope(req))
        return req.prefix_hashes

    def computed_tokens(self, req: Request, hits: list[int], align: int) -> int:
        """Prompt tokens `req` may take from `hits` (its cached prefix blocks): whole multiples of
        `align` tokens only, and never its whole prompt (the last prompt token is computed to
        sample from); none for a request that asks for prompt logprobs."""
        if req.sampling.prompt_logprobs is not None:
            return 0                   # every prompt position's logits are needed
        tokens = min(len(hits) * self.block_size, req.num_prompt - 1)
        return tokens // align * align

    def _hit(self, req: Request, align: int) -> list[list[int]]:
        """Per KV group, the cached blocks of `req`'s longest usable prefix hit (empty lists for
        none). Group 0's chain bounds it (`computed_tokens`); with several groups the hit is
        shortened, `align` tokens at a time, until every group holds what it needs
        (`BlockPool.group_hit`: a sliding group only the blocks its window still sees)."""
        hashes = self.block_hashes(req)
        pool = self.pool
        if pool.windows[0] is None:
            bound = pool.cached_prefix(hashes)
        else:                          # no global group: only the windows' blocks matter
            bound = hashes
        step = align // self.block_size
        for k in range(self.computed_tokens(req, bound, align) // self.block_size, 0, -step):
            if pool.num_groups == 1 and pool.windows[0] is None:
                return [bound[:k]]
            groups = pool.group_hit(hashes, k)
            if groups is not None:
                return groups
        return [[] for _ in pool.windows]

    def num_cached_tokens(self, req: Request, align: int) -> int:
        """Prompt tokens `req` would take from the cache as it stands, for the admission
        estimate: the request holds no blocks yet."""
        return len(self._hit(req, align)[0]) * self.block_size

    def get_computed_blocks(self, req: Request, align: int) -> list[list[int]]:
        """The cached blocks `req` would take at admission, per KV group in position order: its
        cached prefix cut to `computed_tokens` (`align` must be a multiple of the block size),
        shortened until every group can serve it; a sliding group's entries its window no longer
        sees are `NULL_BLOCK`. Empty lists when `req` already holds blocks."""
        if self.pool.table(req.request_id):
            return [[] for _ in self.pool.windows]
        return self._hit(req, align)

    def take_computed_blocks(self, req: Request, blocks: list[list[int]]) -> int:
        """Start `req`'s block tables with `blocks` (from `get_computed_blocks`) and count the
        lookup in the hit counters.

        Returns:
            The prompt tokens those blocks hold (the request computes from there).
        Raises:
            BlockPoolError: `req` already has a table, or a block is not cached.
        """
        if blocks[0]:
            self.pool.attach_prefix(req.request_id, blocks)
        cached = len(blocks[0]) * self.block_size
        if self.pool.prefix_caching:
            self.prefix_queried_tokens += req.num_prompt
            self.prefix_hit_tokens += cached
        return cached

    def cache_piece(self, req: Request, start: int, length: int, align: int) -> None:
        """Offer the prompt piece [start, start + length) of `req`, just computed, to the prefix
        cache when it is a whole `align`-token piece on the `align` grid within the prompt (a
        shorter tail piece is not offered: a later prompt would cut it elsewhere). No-op when
        prefix caching is off."""
        if not self.pool.prefix_caching:
            return
        end = start + length
        if length == align and start % align == 0 and end <= req.num_prompt:
            bs = self.block_size
            self.pool.register_prefix(req.request_id, self.block_hashes(req), end // bs, start // bs)

    def reset_stats(self) -> None:
        """Zero the hit counters (after start-up warm-up, so they count served traffic only)."""
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
