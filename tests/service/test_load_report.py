"""The ORCA load report (service/load_report.py): its text from given scheduler figures, the
requests-per-second window, and the report on the real servicer's answers (simulated engine)."""

from __future__ import annotations

import math

import grpc
import pytest

from genserve.v1 import generate_pb2 as pb
from service.load_report import (HEADER, RPS_WINDOW_S, UTILIZATION_FLOOR, Load, LoadReporter,
                                 report_text, utilization)
from tests.service.harness import collect, request, running_server

IDLE = Load(running_rows=0, max_rows=32, queued_device_s=0.0, queue_budget_s=2.0,
            kv_blocks_free=1000, kv_blocks_total=1000)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def parse(text: str) -> dict[str, float]:
    """A TEXT report as Envoy reads it: the prefix, then comma-separated name=value pairs."""
    assert text.startswith("TEXT ")
    pairs = [item.split("=", 1) for item in text[len("TEXT "):].split(",")]
    names = [name for name, _ in pairs]
    assert len(set(names)) == len(names), names
    return {name: float(value) for name, value in pairs}


def test_report_text_from_scheduler_figures():
    """Queue share 1.6 / 2 = 0.8 beats rows 12 / 32 = 0.375 and KV 188 / 1000 = 0.188."""
    load = Load(running_rows=12, max_rows=32, queued_device_s=1.6, queue_budget_s=2.0,
                kv_blocks_free=812, kv_blocks_total=1000)
    assert report_text(load, rps=3.1) == (
        "TEXT application_utilization=0.800000,rps_fractional=3.1000,"
        "named_metrics.kv_free_blocks=812,named_metrics.queued_device_s=1.600")


@pytest.mark.parametrize("load, expected", [
    (IDLE, UTILIZATION_FLOOR),                                               # idle: the floor
    (Load(24, 32, 0.0, 2.0, 1000, 1000), 0.75),                              # rows
    (Load(1, 32, 0.5, 2.0, 1000, 1000), 0.25),                               # queue
    (Load(1, 32, 0.0, 2.0, 100, 1000), 0.9),                                 # KV pool
    (Load(32, 32, 9.0, 2.0, 0, 1000), 1.0),                                  # past the budget: 1
])
def test_utilization_is_the_largest_share(load, expected):
    assert utilization(load) == pytest.approx(expected)


@pytest.mark.parametrize("load", [
    Load(5, 0, 1.0, 0.0, 0, 0),                                   # zero denominators
    Load(-3, 32, -1.0, 2.0, 2000, 1000),                          # negative, more free than total
    Load(0, 32, math.nan, 2.0, 1000, 1000),                       # NaN
])
def test_bad_figures_give_a_finite_report_in_range(load):
    u = utilization(load)
    assert UTILIZATION_FLOOR <= u <= 1.0
    for value in parse(report_text(load, rps=math.nan)).values():
        assert math.isfinite(value) and value >= 0


def test_an_infinite_queue_is_full_and_the_text_stays_finite():
    load = Load(0, 32, math.inf, 2.0, 1000, 1000)
    assert utilization(load) == 1.0
    fields = parse(report_text(load, rps=math.inf))
    assert fields["application_utilization"] == 1.0
    assert all(math.isfinite(v) for v in fields.values())


def test_rps_counts_the_ended_requests_of_the_window():
    clock = FakeClock()
    reporter = LoadReporter(window_s=10.0, clock=clock)
    assert reporter.rps() == pytest.approx(1 / 10)          # none yet: one counted, never 0
    for _ in range(20):
        reporter.request_ended()
    clock.now += 4.5
    for _ in range(10):
        reporter.request_ended()
    assert reporter.rps() == pytest.approx(30 / 10)
    clock.now += 6.0                                         # the first 20 left the window
    assert reporter.rps() == pytest.approx(10 / 10)
    clock.now += 100.0
    assert reporter.rps() == pytest.approx(1 / 10)
    name, text = reporter.header(IDLE)
    assert name == HEADER == "endpoint-load-metrics"
    assert parse(text) == {"application_utilization": UTILIZATION_FLOOR, "rps_fractional": 0.1,
                           "named_metrics.kv_free_blocks": 1000.0, "named_metrics.queued_device_s": 0.0}


def test_rows_busy_average_the_windows_row_seconds():
    """Five requests of two samples held 3 s each: 30 row-seconds over a 10 s window, 3 rows on
    average; a request held longer than the window counts the window; 3 rows running now do not
    add to the average, the larger counts."""
    clock = FakeClock()
    reporter = LoadReporter(window_s=10.0, clock=clock)
    for _ in range(5):
        reporter.request_ended(3.0, rows=2)
    assert reporter.recent_rows() == pytest.approx(3.0)
    reporter.request_ended(100.0)
    reporter.request_ended(-1.0)
    reporter.request_ended(math.nan)
    assert reporter.recent_rows() == pytest.approx(4.0)
    assert reporter.rps() == pytest.approx(0.8)
    _, text = reporter.header(Load(3, 32, 0.0, 2.0, 1000, 1000))
    assert parse(text)["application_utilization"] == pytest.approx(4.0 / 32)
    clock.now += 10.0
    assert reporter.recent_rows() == 0.0


def test_weights_stay_level_between_replicas_that_served_different_shares():
    """Envoy's weight rps / utilization, for two equal replicas below saturation, one of which
    served four times the other's requests (1 s each): both come out at max_rows / 1 s."""
    weights = []
    for served in (20, 5):
        reporter = LoadReporter(window_s=30.0, clock=FakeClock())
        for _ in range(served):
            reporter.request_ended(1.0)
        fields = parse(reporter.header(IDLE)[1])
        weights.append(fields["rps_fractional"] / fields["application_utilization"])
    assert weights == [pytest.approx(32, rel=0.01)] * 2


@pytest.mark.parametrize("window_s", [0.0, -1.0, math.nan, math.inf])
def test_window_must_be_positive(window_s):
    with pytest.raises(ValueError, match="window_s"):
        LoadReporter(window_s=window_s)


# ---- on the servicer's answers ------------------------------------------------------------------

async def test_a_finished_generate_ends_with_the_load_report():
    """A lone request on a fresh engine (256 blocks, 32 rows): when it ends nothing runs or waits
    and every block is free again, and it is the one request of the window."""
    async with running_server() as srv:
        call = srv.stub.Generate(request("hello", max_tokens=4))
        msgs, err = await collect(call)
        assert err is None and msgs[-1].HasField("finished")
        trailers = dict(await call.trailing_metadata())
        assert parse(trailers[HEADER]) == {
            "application_utilization": UTILIZATION_FLOOR, "rps_fractional": round(1 / RPS_WINDOW_S, 4),
            "named_metrics.kv_free_blocks": 256.0, "named_metrics.queued_device_s": 0.0}


async def test_a_refused_generate_carries_the_report_beside_its_field():
    async with running_server() as srv:
        bad = pb.GenerateRequest(prompt="hi", max_tokens=4, sampling=pb.SamplingParams(top_p=2.0))
        call = srv.stub.Generate(bad)
        _, err = await collect(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailers = dict(err.trailing_metadata())
        assert trailers["invalid-field"] == "top_p"
        assert parse(trailers[HEADER])["application_utilization"] == UTILIZATION_FLOOR
