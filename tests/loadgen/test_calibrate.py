"""loadgen.calibrate without the model: the fit recovers a known cost model; capacity and SLO
scaling."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.sim_executor import SimExecutor
from loadgen.calibrate import capacity_rps, cpu_slo_ms, fit_cost_model
from loadgen.workload import LengthMix

TRUE = {"step_base_ms": 4.0, "decode_1_ms": 30.0, "decode_32_ms": 200.0, "prefill_ms_per_token": 2.5,
        "decode_ms_per_context_token": 0.01, "prefill_ms_per_kpair": 0.0}


def _samples(noise: float = 0.0, outliers: int = 0):
    sim = SimExecutor(**TRUE)
    rng = np.random.default_rng(0)
    out = []
    for b in (0, 1, 4, 16, 32):
        for c in (0, 64, 256, 512):
            for ctx in (32, 256):
                if b == 0 and c == 0:
                    continue
                k = b * ctx
                p = c * ctx + c * (c + 1) // 2
                ms = sim.step_seconds(b, c, k, p) * 1000 * (1 + noise * rng.standard_normal())
                out.append({"rows": b, "prefill": c, "context": k, "pairs": p, "ms": ms})
    for i in range(outliers):                     # steps slowed 5x by someone else's work
        out[3 * i]["ms"] *= 5
    return out


def test_fit_recovers_the_model_that_made_the_samples():
    fields, quality = fit_cost_model(_samples())
    for k, v in TRUE.items():
        assert fields[k] == pytest.approx(v, abs=1e-6 + 1e-6 * v)
    assert quality["median_abs_rel_error"] < 1e-9 and quality["r2"] == pytest.approx(1.0)
    # The fields load straight into the simulator.
    assert SimExecutor.from_json(fields).device_costs.params() == pytest.approx(fields)


def test_fit_survives_noise_and_leaves_out_slowed_steps():
    fields, quality = fit_cost_model(_samples(noise=0.03, outliers=4))
    assert quality["num_outliers"] >= 4
    assert all(v >= 0 for v in fields.values())
    assert fields["decode_32_ms"] == pytest.approx(200.0, rel=0.1)
    assert fields["prefill_ms_per_token"] == pytest.approx(2.5, rel=0.1)


def test_capacity_and_cpu_slos_follow_the_designs_ratios():
    design = {"step_base_ms": 0.0, "decode_1_ms": 25.0, "decode_32_ms": 40.0, "prefill_ms_per_token": 0.1,
              "decode_ms_per_context_token": 0.0, "prefill_ms_per_kpair": 0.0}
    mix = LengthMix.design()
    # The design's own arithmetic: 0.125 s prefill + 300 tokens × 40 ms / 32 = 0.5 s per request.
    cap = capacity_rps(design, mix)
    assert cap == pytest.approx(2.0, rel=0.02)
    ttft, tpot = cpu_slo_ms(design, mix)
    assert tpot == pytest.approx(70.0)                      # 70/40 × the 40 ms 32-row step
    assert ttft == pytest.approx(3000.0 / 2.1 * 32 * 0.0656, rel=1e-6)   # 32 chunks of 65.6 ms
