"""Randomized: the real Scheduler/Engine over a checking SimExecutor, with sliding-window KV groups,
prefix caching, small pools (preemption), shared prompt prefixes, n > 1 forks and cancellations.

The executor keeps a model of the KV pool's contents: every position a segment computes is
written (in each group's block) as the identity of the token prefix it ends, copy-on-write
copies move contents, and every key a segment's queries read (a global group: all earlier
positions; a sliding group: its window) must hold the right prefix's identity. So a prefix hit
that lacks a sliding block, a block given back too early, a shared block written in place or a
cached block overwritten all fail. Pool accounting is checked after every step."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.core.block_pool import NULL_BLOCK
from engine.core.sched.admission import AdmissionRejected
from engine.core.sim_executor import SimExecutor
from engine.core.engine import Engine
from engine.config import EngineConfig
from tests.engine.sim import FakeClock, make_request

BS = 16
LAYOUTS = [(None,), (32,), (None, 32), (None, 48, 48), (None, 16), (40, None)]


class CheckingExecutor(SimExecutor):
    """SimExecutor that writes and reads a model of the KV pool's contents."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = None
        self.content: dict[int, dict[int, int]] = {}   # block -> offset -> prefix identity
        self.ident: dict[str, list[int]] = {}           # request id -> prefix identities
        self.reads = 0

    def _identity(self, req, pos: int) -> int:
        ids = self.ident.setdefault(req.request_id, [])
        while len(ids) <= pos:
            k = len(ids)
            ids.append(hash((ids[-1] if ids else 0, req.token_at(k))))
        return ids[pos]

    def execute(self, plan):
        pool = self.pool
        windows = pool.windows
        for src, dst in plan.block_copies:
            assert NULL_BLOCK not in (src, dst) or not any(w is not None for w in windows), (src, dst)
            assert pool.ref_count(dst) == 1, ("copy into a shared block", dst)
            self.content[dst] = dict(self.content.get(src, {}))
        for seg in plan.segments:
            req = seg.request
            tables = (seg.block_table, *seg.group_tables)
            assert len(tables) == pool.num_groups
            live = pool.tables(req.request_id)
            for g, (t, w) in enumerate(zip(tables, windows)):
                assert len(t) * BS >= seg.end, (req.request_id, g, len(t), seg.end)
                assert tuple(live[g][:len(t)]) == tuple(t), ("table changed after planning", g)
                if w is not None:           # slid to the step's first position, not further
                    first = max(0, req.num_computed - w + 1) // BS
                    assert all(b == NULL_BLOCK for b in live[g][:first]), (req.request_id, g, live[g])
            # write this segment's positions
            for pos in range(seg.start, seg.end):
                v = self._identity(req, pos)
                for g, t in enumerate(tables):
                    b = t[pos // BS]
                    assert b != NULL_BLOCK or pool._null is None, ("write into the null block", g, pos)
                    assert pool.ref_count(b) == 1, ("write into a shared block", req.request_id, g, pos, b)
                    assert b not in pool._block_hash, ("write into a cached block", g, pos, b)
                    self.content.setdefault(b, {})[pos % BS] = v
            # every key the segment's queries read
            for g, (t, w) in enumerate(zip(tables, windows)):
                lo = 0 if w is None else max(0, seg.start - w + 1)
                for k in range(lo, seg.end):
                    b = t[k // BS]
                    assert b != NULL_BLOCK or pool._null is None, ("read of a dropped key", req.request_id, g, k)
                    got = self.content.get(b, {}).get(k % BS)
                    assert got == self._identity(req, k), ("wrong key", req.request_id, g, k, b)
                    self.reads += 1
        return super().execute(plan)


def check_pool(engine) -> None:
    pool = engine.pool
    refs: Counter = Counter()
    group_of: dict[int, int] = {}
    for rid, tables in pool._tables.items():
        assert len(tables) == pool.num_groups
        assert len({len(t) for t in tables}) == 1, (rid, [len(t) for t in tables])
        for g, t in enumerate(tables):
            nonnull = [b for b in t if b != NULL_BLOCK or pool._null is None]
            assert len(nonnull) == len(set(nonnull)), ("block twice in one table", rid, g, t)
            if pool.windows[g] is None:
                assert len(nonnull) == len(t), ("null in a global table", rid, g, t)
            for b in nonnull:
                refs[b] += 1
                assert group_of.setdefault(b, g) == g, ("block in two groups", b)
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) == refs[b], ("ref_count", b, pool.ref_count(b), refs[b])
    free, evictable = list(pool._free), list(pool._evictable)
    assert len(set(free)) == len(free) and not set(free) & set(evictable)
    assert not set(free) & set(refs) and not set(evictable) & set(refs)
    assert all(b in pool._block_hash for b in evictable)
    null = 1 if pool._null is not None else 0
    if null:
        assert NULL_BLOCK not in free and NULL_BLOCK not in evictable and pool.ref_count(0) == 0
        assert NULL_BLOCK not in pool._block_hash
    assert pool.num_free + len(refs) + null == pool.num_blocks
    for (g, h), b in pool._cached.items():
        assert pool._block_hash[b] == (g, h) and group_of.get(b, g) == g
    assert len(pool._cached) == len(pool._block_hash)


def run_workload(seed: int, windows, steps_cap: int = 3000) -> dict:
    rng = random.Random(seed)
    piece = rng.choice([16, 32, 64])
    budget = rng.choice([64, 128])
    batching = rng.choice(["continuous"] * 4 + ["continuous_unchunked", "dynamic"])
    cfg = EngineConfig(block_size=BS, prefill_piece=piece, prefill_token_budget=budget,
                       prefill_token_budget_few_rows=budget, max_rows=rng.choice([4, 8]),
                       per_key_rows=rng.choice([2, 8]), prefix_caching=rng.random() < 0.85,
                       queue_budget_s=1e9, num_blocks=2, batching=batching)
    max_len = 200
    groups = len(windows)
    # the longest request fits alone, barely: forks and concurrency force preemption
    per_group = -(-(max_len + 40) // BS)
    num_blocks = groups * per_group + 2 + rng.randint(0, groups * per_group)
    if None not in windows and batching == "continuous" and rng.random() < 0.5:
        # every group sliding: a pool far below the prompts, sized by what admission counts
        # (the window plus a step's tokens) for the longest request and a few blocks more
        per_group = -(-(max(windows) - 1 + cfg.prefill_step_tokens) // BS) + 1
        num_blocks = groups * per_group + 1 + rng.randint(0, 6)
    executor = CheckingExecutor()
    clock = FakeClock()
    engine = Engine(cfg, executor, num_blocks, kv_windows=windows, clock=clock)
    executor.pool = engine.pool
    bases = [[rng.randrange(1, 500) for _ in range(max_len)] for _ in range(3)]
    reqs, cancelled = [], set()
    stats = Counter()
    n_requests = rng.randint(8, 20)
    steps = 0
    while True:
        if len(reqs) < n_requests and rng.random() < 0.35:
            base = rng.choice(bases)
            plen = rng.randint(2, max_len)
            cut = rng.randint(0, plen) if rng.random() < 0.4 else plen
            prompt = base[:cut] + [rng.randrange(1, 500) for _ in range(plen - cut)]
            req = make_request(0, rng.randint(1, 40), api_key=rng.choice("ab"), prompt_ids=prompt)
            n = rng.choice([1, 1, 1, 2, 3])
            if n > 1:
                req.fork(n, [None] * n)
            try:
                engine.submit(req)
            except AdmissionRejected:
                continue
            reqs.append(req)
        if reqs and rng.random() < 0.03:
            victim = rng.choice(reqs)
            if not victim.finished:
                engine.cancel(victim.request_id)
                cancelled.add(victim.request_id)
        busy = engine.scheduler.has_work
        clock.now += 0.005              # virtual time (static/dynamic batching wait on it)
        if busy:
            engine.step()
            clock.now += executor.last_step_s
            steps += 1
            check_pool(engine)
        elif len(reqs) >= n_requests:
            break
        assert steps < steps_cap, f"seed {seed}: no progress after {steps} steps"
    engine.pool.check_all_free()
    for req in reqs:
        for sample in [req, *req.children]:
            assert sample.finished
            if req.request_id not in cancelled:
                assert len(sample.generated) == sample.max_tokens, (seed, sample.request_id)
    s = engine.scheduler.stats()
    stats.update(preempted=s.num_preemptions, hit_tokens=s.prefix_hit_tokens, reads=executor.reads,
                 steps=steps)
    return stats


@pytest.mark.parametrize("windows", LAYOUTS, ids=str)
def test_random_workloads_keep_the_pool_and_every_window_consistent(windows):
    total = Counter()
    for seed in range(12):
        total += run_workload(seed * 7919 + len(windows) * 31 + (windows[0] or 0), windows)
    # the workloads did exercise preemption and prefix hits
    assert total["preempted"] > 0 and total["hit_tokens"] > 0, total


def test_a_lone_prompt_longer_than_a_sliding_pool_runs_without_preempting_itself():
    """Regression: admission counts a sliding group's window plus `prefill_step_tokens`, but a
    step the cost model allowed carried the whole 400-token prompt (25 blocks of a 12-block pool),
    so the lone request preempted itself at every step and never ran. Its pieces now stop at
    `prefill_step_tokens` a step; without chunked prefill admission counts the whole prompt."""
    for batching, num_blocks in (("continuous", 12), ("continuous_unchunked", 27)):
        cfg = EngineConfig(block_size=BS, prefill_token_budget=64, prefill_token_budget_few_rows=64,
                           prefix_caching=False, num_blocks=2, batching=batching)
        engine = Engine(cfg, CheckingExecutor(), num_blocks, kv_windows=(32,), clock=FakeClock())
        engine.executor.pool = engine.pool
        req = make_request(400, 3)
        engine.submit(req)
        for _ in range(40):
            if not engine.scheduler.has_work:
                break
            engine.step()
            check_pool(engine)
        assert req.finished and len(req.generated) == 3, (batching, req.state, req.num_computed)
        assert engine.scheduler.num_preemptions == 0
        engine.pool.check_all_free()
