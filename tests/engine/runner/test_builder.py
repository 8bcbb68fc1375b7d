"""engine.runner.builder.set_threads: torch's thread count, and the warning about pinned threads."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine.config import EngineConfig
from engine.runner.builder import set_threads, threads_bound


def test_threads_default_to_the_usable_cores(restore_threads):
    assert set_threads(EngineConfig(num_threads=1)) == 1 and torch.get_num_threads() == 1
    cores = len(os.sched_getaffinity(0))
    assert set_threads(EngineConfig()) == cores and torch.get_num_threads() == cores


@pytest.mark.parametrize("env,bound", [
    ({"OMP_PROC_BIND": "true"}, "OMP_PROC_BIND=true"), ({"OMP_PROC_BIND": "close"}, "OMP_PROC_BIND=close"),
    ({"OMP_PROC_BIND": "FALSE"}, None), ({}, None), ({"OMP_PLACES": "cores"}, "OMP_PLACES=cores"),
    ({"GOMP_CPU_AFFINITY": "0-1"}, "GOMP_CPU_AFFINITY=0-1"),
    ({"OMP_PROC_BIND": "false", "OMP_PLACES": "cores"}, None)])
def test_bound_threads_are_told_apart(env, bound):
    assert threads_bound(env) == bound


@pytest.mark.parametrize("bind,warns", [("true", True), ("FALSE", False)])
def test_pinned_threads_are_warned_about(restore_threads, monkeypatch, caplog, bind, warns):
    for name in ("OMP_PLACES", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_PROC_BIND", bind)
    with caplog.at_level(logging.WARNING, logger="engine.runner.builder"):
        set_threads(EngineConfig(num_threads=1))
    warned = [r.getMessage() for r in caplog.records if "OMP_PROC_BIND" in r.getMessage()]
    assert bool(warned) == warns, warned


@pytest.mark.parametrize("config", [dict(max_rows=8), dict(num_blocks=24)])
def test_cost_measurement_fits_a_small_row_cap_or_pool(config):
    """The start-up measurement runs at most the row cap's rows and reads the decode cost off the
    fullest decode steps the pool allowed, so a small --max-rows or --num-blocks still starts."""
    from engine.runner.builder import measure_costs
    from tests.engine.sim import sim_engine

    engine, _ = sim_engine(**{"num_blocks": 512, **config})
    cost = measure_costs(engine)
    assert cost.prefill_ms_per_token >= 0 and cost.decode_ms_per_token >= 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_start_up_measurement_leaves_the_prefix_cache_counters_at_zero():
    """The warm-up requests are not traffic: prefix-cache hit rates start from the first user."""
    from engine.runner.builder import measure_costs
    from tests.engine.sim import sim_engine

    engine, _ = sim_engine(num_blocks=512, prefix_caching=True)
    measure_costs(engine)
    stats = engine.stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (0, 0)
