"""genserve_step_time_ratio: measured step time over the cost model's prediction, per step."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.core.cost_model import CostModel
from engine.core.engine import Engine
from engine.core.sim_executor import SimExecutor
from service.metrics import EngineMetrics
from tests.engine.sim import make_request


class SlowDevice:
    """A SimExecutor whose steps really take `slowdown` × their modelled time (a drifted device)."""

    def __init__(self, slowdown: float) -> None:
        self.sim = SimExecutor(decode_1_ms=10.0, decode_32_ms=12.0, prefill_ms_per_token=0.02)
        self.slowdown = slowdown

    def execute(self, plan):
        out = self.sim.execute(plan)
        time.sleep(self.sim.last_step_s * self.slowdown)
        return out


def _mean_ratio(slowdown: float) -> float:
    cfg = EngineConfig(num_blocks=256, prefix_caching=False)
    device = SlowDevice(slowdown)
    engine = Engine(cfg, device, cost_model=CostModel(**device.sim.device_costs.params(), refit_every=0))
    metrics = EngineMetrics(engine)
    for _ in range(4):
        engine.submit(make_request(100, 6))
    steps = engine.run_until_idle()
    got = {s.name: s.value for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode())
           for s in fam.samples if s.name.startswith("genserve_step_time_ratio")}
    assert got["genserve_step_time_ratio_count"] == steps
    return got["genserve_step_time_ratio_sum"] / steps


def test_ratio_shows_a_device_slower_than_its_model():
    on_model = _mean_ratio(1.0)
    drifted = _mean_ratio(2.0)
    # sleep never ends early, and the loop adds the same small overhead to both runs, so the
    # measured/predicted ratio doubles with the device's slowdown.
    assert on_model >= 1.0
    assert drifted / on_model == pytest.approx(2.0, rel=0.15)
