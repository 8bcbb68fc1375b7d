"""The soak (loadgen/soak.py) for GENSERVE_SOAK_S seconds (default 60; `make soak` runs an hour):
the design's length mix, scaled for the CPU, through Envoy at 70 % of the capacity measured just
before, a fifth of the clients disconnecting mid-stream and some cancelling. Every check of the
soak must hold: the KV pool whole at the end, no 5xx, no transport error but the planned
disconnects, every served request's events complete and counted once by the engine, and the
engine's and bridge's RSS flat after the warm-up.

Length. A minute of arrivals at 70 % of a quiet two-core host's capacity is about 200 requests
(docs/benchmarks/soak: 4.8 requests/s), with dozens of disconnects and cancels. The seeded plan
depends on the rate, so on a slow or busy host a minute can hold only a dozen requests and, for
some rates, no disconnect or no cancel at all: the test then lengthens the run (`soak_length`)
until the plan has at least MIN_REQUESTS requests with both kinds among them, so every check
always has its cases.

The RSS bound depends on the length. Over the first minutes the engine's RSS still rises while
native caches fill (oneDNN's primitive cache gains an entry per new matmul shape, the allocator's
arenas grow to the peak batch; docs/testing.md, the soak row): a short run is held to 25 % growth
over its second half (the capacity probe has run the peak batch before it, and its first half
warms the rest), which still catches a per-request leak; the hour-long run to 5 % after 10 minutes.
The figures and plot go to GENSERVE_SOAK_OUT when set.

A LoRA adapter for the served model (drawn here, `write_adapter`) is loaded and unloaded under the
load: its streams finish through the unload, and requests after it get 404 model_not_found.
"""

from __future__ import annotations

import os
import pathlib

from engine.model.weights import random_shape
from loadgen.soak import LOAD, LengthMix, Target, measure_capacity, run_soak, soak_plans, write_report
from tests.engine.lora_adapters import write_adapter

SOAK_S = float(os.environ.get("GENSERVE_SOAK_S", "60"))
MIN_REQUESTS = 40        # a short run's least number of requests
SCALE = 0.064            # run_soak's default length scale (`LengthMix.design`)
SEED = 0                 # run_soak's default seed


def soak_length(rate_rps: float, duration_s: float, step_s: float = 15.0) -> float:
    """The shortest duration, from `duration_s` up in steps of `step_s` seconds, whose seeded plan
    at `rate_rps` (requests/s; what `run_soak` builds: its default scale, key and seed) holds at
    least MIN_REQUESTS requests, a disconnect and a cancel; at most 4 × `duration_s` (a host so
    slow that even that plan is thin fails the soak's checks rather than running for ever)."""
    mix = LengthMix.design(SCALE)
    longest = 4 * duration_s
    while duration_s < longest:
        todo = soak_plans(rate_rps, duration_s, mix, ("",), SEED)
        if (len(todo) >= MIN_REQUESTS and any(p.disconnect_after is not None for p in todo)
                and any(p.cancel_after is not None for p in todo)):
            return duration_s
        duration_s += step_s
    return longest


def test_soak_length_grows_until_the_plan_has_every_case():
    assert soak_length(3.4, 60.0) == 60.0               # a quiet host: ~200 requests in a minute
    slow = soak_length(0.3, 60.0)                       # a busy one: 18 in a minute, 40 take longer
    assert slow >= MIN_REQUESTS / 0.3 - 15
    todo = soak_plans(0.3, slow, LengthMix.design(SCALE), ("",), SEED)
    assert len(todo) >= MIN_REQUESTS and any(p.cancel_after for p in todo) and any(p.disconnect_after for p in todo)


def test_soak_at_70_percent_of_capacity_ends_clean(server, tmp_path):
    long_run = SOAK_S >= 1800
    adapter = write_adapter(tmp_path / "soak-lora", random_shape("smollm2-135m"),
                            {0: ("self_attn.q_proj", "self_attn.v_proj"), 3: ("mlp.down_proj",)})
    target = Target(server.base_url, server.grpc_target, server.process.pid)
    capacity = measure_capacity(target, 60.0 if long_run else 20.0, LengthMix.design(SCALE), ("",), SEED)
    duration = SOAK_S if long_run else soak_length(LOAD * capacity, SOAK_S)
    result = run_soak(target, duration_s=duration, capacity_rps=capacity, scale=SCALE, seed=SEED,
                      warmup_s=600.0 if long_run else duration / 2,
                      rss_tolerance=0.05 if long_run else 0.25,
                      sample_s=5.0 if long_run else 1.0, adapters=[("soak-lora", str(adapter))])
    out = pathlib.Path(os.environ.get("GENSERVE_SOAK_OUT") or tmp_path)
    write_report(result, out)
    print(f"\n  soak {duration:.0f} s: {result.settings}\n  {result.counts}\n  {result.checks}")
    assert "adapters_loaded_and_unloaded_under_load" in result.checks
    assert (out / "soak.json").exists() and (out / "soak.png").stat().st_size > 0
    assert result.counts.get("complete", 0) > result.settings["requests"] / 2
    failed = {name: c for name, c in result.checks.items() if not c["ok"]}
    assert not failed, (failed, result.failures[:5])
