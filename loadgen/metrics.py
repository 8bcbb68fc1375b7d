"""Reading a running genserve's Prometheus endpoint: one scrape as a flat dict, and waiting until
the engine is idle. Used by the soak, the live-server benchmarks and the end-to-end tests."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

IDLE_GAUGES = ("genserve_running_rows", "genserve_queue_depth")


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition as {"name{label=value,...}": value} (labels
    sorted by name; a sample without labels is its bare name), parsed by prometheus_client.

    Raises:
        ValueError: the text is not the Prometheus format.
    """
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """`parse_metrics` of GET {base_url}/metrics.

    Raises:
        httpx.HTTPError: the endpoint cannot be reached.
    """
    return parse_metrics(httpx.get(f"{base_url}/metrics", timeout=timeout_s).text)


def wait_idle(base_url: str, timeout_s: float = 120.0, settle_s: float = 0.3) -> dict[str, float]:
    """Poll /metrics until no request runs or waits, and still none `settle_s` seconds later;
    returns that later scrape. The engine frees a finished row under its lock and tells the
    metrics listener just after, so one scrape can see the row gone and its finish (a cancel, its
    steps) not yet counted; the second look comes after that gap.

    Raises:
        TimeoutError: still busy after `timeout_s` seconds (the message gives the last counts).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(base_url)
        if all(m.get(g, 0) == 0 for g in IDLE_GAUGES):
            time.sleep(settle_s)
            m = scrape_metrics(base_url)
            if all(m.get(g, 0) == 0 for g in IDLE_GAUGES):
                return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine not idle after {timeout_s} s: "
                               + ", ".join(f"{g} {m.get(g)}" for g in IDLE_GAUGES))
        time.sleep(0.1)
