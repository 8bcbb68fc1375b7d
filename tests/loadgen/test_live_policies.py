"""`python -m loadgen.live_policies`: the parts that need no live server (fit, goodput, flags)."""

from __future__ import annotations

import pytest

from loadgen import live_policies as lp
from loadgen.sim import design_config
from loadgen.workload import LengthMix, arrival_times, synthetic_workload

CPU = {"step_base_ms": 8.5, "decode_1_ms": 0.0, "decode_32_ms": 9.3, "prefill_ms_per_token": 0.26,
       "decode_ms_per_context_token": 0.001, "prefill_ms_per_kpair": 0.066}
FACTS = {"vocab_size": 49152, "eos_token_id": 2}


def test_live_path_terms_are_recovered_from_a_known_slower_run():
    items = synthetic_workload(arrival_times(4.0, duration_s=20.0, seed=1), LengthMix.design(0.064), seed=1)
    config = design_config(num_blocks=5825, queue_budget_s=60.0)
    # "Live": the same items with 2 ms more per step and 15 ms of request path.
    live = lp.simulate_policy(items, CPU, FACTS, config, step_overhead_ms=2.0, submit_delay_s=0.015)
    overhead, delay = lp.fit_live_path(items, live, CPU, FACTS, config, (261.0, 36.0))
    assert overhead == pytest.approx(2.0, abs=0.3)
    assert delay == pytest.approx(15.0, abs=3.0)


def test_gap_goodput_needs_the_gap_target_at_every_lower_rate():
    runs = [{"rate": r, "slo": {"attainment": 0.99}, "max_gap_ms": {"p99": gap}}
            for r, gap in ((2.0, 40.0), (4.0, 50.0), (6.0, 60.0))]
    assert lp.gap_goodput(runs, 52.0) == 4.0
    assert lp.gap_goodput(runs, 30.0) is None


def test_caps_get_1_ms_targets_and_the_default_a_share_of_the_client_side_targets():
    assert lp.POLICIES == ("caps", "default")
    assert lp._target_args("caps", 36.0, 51.4, 0.9) == ["--tpot-target-ms", "1", "--gap-target-ms", "1"]
    assert lp._target_args("default", 36.0, 51.4, 0.9) == ["--tpot-target-ms", "32.4", "--gap-target-ms", "46.26"]
    # The simulator's engine gets the same targets as the live server's flags.
    assert lp._targets("caps", 36.0, 51.4, 0.9) == (1.0, 1.0)
    assert lp._targets("default", 36.0, 51.4, 0.9) == (32.4, 46.26)
    with pytest.raises(ValueError):
        lp._targets("slo", 36.0, 51.4, 0.9)


def test_the_server_flags_parse_to_the_simulated_targets():
    import argparse

    from engine.config_cli import add_engine_config_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_config_args(parser)
    for policy in lp.POLICIES:
        cfg = engine_config_from_args(parser.parse_args(lp._target_args(policy, 36.0, 51.4, 0.9)))
        assert (cfg.tpot_target_ms, cfg.gap_target_ms) == lp._targets(policy, 36.0, 51.4, 0.9)
