"""Prefix caching in the scheduler: what a request takes from the cache, what it computes, what is
charged, and that a cached answer is bit-identical to one computed from scratch."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.runner.builder import engine_from_weights
from tests.engine.conftest import generate
from tests.engine.sim import make_request, sim_engine
from tests.engine.model.test_model import PARAGRAPH


def _prefill_tokens(engine, req) -> list[int]:
    """Run `req` to the end; the prompt tokens each step computed for it."""
    computed = []
    engine.step_listeners.append(
        lambda plan, ev, s: computed.append(sum(g.length for g in plan.segments
                                                if g.request is req and not g.decode)))
    engine.submit(req)
    engine.run_until_idle()
    engine.step_listeners.pop()
    return [c for c in computed if c]


def test_a_repeated_prompt_computes_only_past_its_cached_whole_pieces():
    engine, _ = sim_engine(prefix_caching=True)
    first = make_request(300, 4, api_key="k")
    assert sum(_prefill_tokens(engine, first)) == 300
    served_after_first = engine.scheduler.queue.usage["k"].weighted_tokens_served
    second = make_request(300, 4, api_key="k")
    # 18 full blocks (288 tokens) are cached; whole 64-token pieces of them are taken: 256.
    assert _prefill_tokens(engine, second) == [44]
    assert second.stats.num_cached == 256
    stats = engine.stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (600, 256)
    # Fairness charges what was computed: 44 prompt tokens (+ the outputs), not 300.
    w = engine.config.output_token_weight
    assert engine.scheduler.queue.usage["k"].weighted_tokens_served - served_after_first == 44 + 4 * w
    engine.pool.check_all_free()                # cached-but-unused blocks count as free
    assert stats.kv_blocks_cached == 16 and stats.kv_blocks_free == engine.pool.num_blocks


@pytest.mark.parametrize(("prompt", "cached"), [(64, 0), (65, 64), (128, 64), (129, 128), (40, 0)])
def test_the_last_prompt_token_is_always_computed_and_reuse_is_whole_pieces(prompt, cached):
    engine, _ = sim_engine(prefix_caching=True)
    _prefill_tokens(engine, make_request(prompt, 2))
    again = make_request(prompt, 2)
    assert sum(_prefill_tokens(engine, again)) == prompt - cached
    assert again.stats.num_cached == cached


def test_admission_estimate_charges_only_the_tokens_to_compute():
    engine, _ = sim_engine(prefix_caching=True)
    _prefill_tokens(engine, make_request(1000, 2))
    cached = make_request(1000, 2)
    fresh = make_request(1000, 2, prompt_ids=[7, *cached.prompt_ids[1:]])   # differs from token 0 on
    engine.scheduler.add(cached, 0.0)
    engine.scheduler.add(fresh, 0.0)
    per_token = engine.scheduler.cost.estimate_ms(1, 0, 32)
    assert fresh.est_device_ms - cached.est_device_ms == pytest.approx(960 * per_token, rel=1e-6)


def test_cached_blocks_are_evicted_least_recently_used_when_the_pool_needs_them():
    engine, _ = sim_engine(num_blocks=64, prefix_caching=True, free_margin=0.0)
    first = make_request(600, 2)
    _prefill_tokens(engine, first)                          # 37 full blocks, 36 of them in pieces
    assert engine.stats().kv_blocks_cached == 36
    big = make_request(900, 8, prompt_ids=[9] * 900)        # shares nothing; needs 57 blocks
    assert sum(_prefill_tokens(engine, big)) == 900
    # 28 blocks were free; 29 more were taken back from the cache, the prefix's tail first.
    assert len(engine.pool.cached_prefix(first.prefix_hashes)) == 36 - 29
    engine.pool.check_all_free()


def test_identical_prompts_at_once_both_compute_and_both_finish():
    engine, _ = sim_engine(prefix_caching=True)
    a, b = make_request(200, 3), make_request(200, 3)
    engine.submit(a)
    engine.submit(b)
    engine.run_until_idle()
    assert len(a.generated) == len(b.generated) == 3 and a.stats.num_cached == b.stats.num_cached == 0
    engine.pool.check_all_free()


def test_off_means_no_reuse():
    engine, _ = sim_engine(prefix_caching=False)
    _prefill_tokens(engine, make_request(300, 2))
    again = make_request(300, 2)
    assert sum(_prefill_tokens(engine, again)) == 300
    assert engine.stats().prefix_queried_tokens == 0


@pytest.mark.slow
def test_cached_tokens_are_bit_identical_to_computed_ones(gguf_weights, gguf_tokenizer):
    """Greedy and seeded samples of prompts that share a long prefix: with the cache (the second
    and later requests take the prefix) equal to a cache-less engine computing every token."""
    args, state = gguf_weights
    config = dict(num_blocks=1024, dtype="bfloat16")
    cached = engine_from_weights(EngineConfig(**config), args, state)
    scratch = engine_from_weights(EngineConfig(**config, prefix_caching=False), args, state)
    system = gguf_tokenizer.encode(PARAGRAPH * 9)
    prompts = [system + gguf_tokenizer.encode(q) for q in
               ("Question: what is it about?", "In one word:", "Summarise in French:")]
    assert len(system) > 256
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=7)):
        want = [generate(scratch, [p], 10, ignore_eos=True, **sampling)[0] for p in prompts]
        got = [generate(cached, [p], 10, ignore_eos=True, **sampling)[0] for p in prompts]
        assert got == want
        # Together in one batch, after the prefix is cached: still the same tokens.
        assert generate(cached, prompts, 10, ignore_eos=True, **sampling) == want
    assert cached.stats().prefix_hit_tokens >= 5 * (len(system) // 64 * 64)
    assert scratch.stats().prefix_hit_tokens == 0


def _run_cached(engine, api_key: str, salt: str = "", events=None) -> tuple[int, list[int]]:
    """Run a 300-token prompt (always the same) as `api_key` with `salt`; returns the prompt
    tokens it took from the cache and those each step computed."""
    req = make_request(300, 4, api_key=api_key, events=events, cache_salt=salt)
    computed = _prefill_tokens(engine, req)
    return req.stats.num_cached, computed


def test_another_keys_prompt_is_a_miss_as_a_fresh_prompt_is():
    engine, _ = sim_engine(prefix_caching=True)
    assert _run_cached(engine, "alice") == (0, [300])     # computes it all (as any first time)
    before = engine.stats()
    events: list = []
    # bob, on alice's prompt: nothing from her cache, the same steps as alice's first time.
    assert _run_cached(engine, "bob", events=events) == (0, [300])
    after = engine.stats()
    assert after.prefix_hit_tokens == before.prefix_hit_tokens               # no global signal
    assert events[-1].num_cached_tokens == 0
    # alice still hits her own cache, and bob now hits his.
    assert _run_cached(engine, "alice")[0] == 256
    assert _run_cached(engine, "bob")[0] == 256
    engine.pool.check_all_free()


def test_the_cache_salt_separates_requests_of_one_key():
    engine, _ = sim_engine(prefix_caching=True)
    assert _run_cached(engine, "alice", "s1")[0] == 0
    assert _run_cached(engine, "alice", "s2")[0] == 0          # another salt: a miss
    assert _run_cached(engine, "alice")[0] == 0                # no salt: a scope of its own
    events: list = []
    assert _run_cached(engine, "alice", "s1", events)[0] == 256
    assert events[-1].num_cached_tokens == 256
    assert _run_cached(engine, "bob", "s1")[0] == 0            # a salt never crosses keys


def test_the_global_scope_shares_across_keys_within_a_salt():
    engine, _ = sim_engine(prefix_caching=True, prefix_cache_scope="global")
    assert _run_cached(engine, "alice")[0] == 0
    assert _run_cached(engine, "bob")[0] == 256                # the side channel it opens
    assert _run_cached(engine, "bob", "s")[0] == 0
    assert _run_cached(engine, "alice", "s")[0] == 256


def test_n_samples_report_the_cached_tokens_of_their_shared_prompt():
    engine, _ = sim_engine(prefix_caching=True)
    _run_cached(engine, "alice")
    events: list = []
    req = make_request(300, 4, api_key="alice", events=events)
    req.fork(2, [1, 2])
    _prefill_tokens(engine, req)
    assert sorted((e.index, e.num_cached_tokens) for e in events if e.finish_reason) == [(0, 256), (1, 256)]
