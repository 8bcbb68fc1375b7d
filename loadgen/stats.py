"""Per-request records, percentiles, throughput, SLO attainment, goodput and reports.

Definitions (every time is measured from the request's *intended* arrival, so a late load
generator cannot hide queueing, i.e. no coordinated omission):

* TTFT: arrival → first token received.
* TPOT: (last token − first token) / (tokens − 1), the mean time per output token after the
  first; None for answers of one token.
* max gap: the longest time between two consecutive tokens (the stall alarm of docs/design.md).
* queue wait: the server's own ``timing.queue_ms`` from the final event (arrival → admission).
* end-to-end: arrival → final event (or the disconnect).

Percentiles are ``numpy.percentile(values, q, method="linear")`` (Hyndman–Fan type 7, numpy's
default: linear interpolation between the two nearest ranks) over the requests that have the
value; None when none has.

Throughput is over the run's span, first arrival → last request end: requests that completed
(status 200, finish reason stop or length) per second, and output tokens received (by every
request, disconnected ones included) per second.

SLO attainment: the share of all requests sent (a 429 or an error counts as a miss) whose TTFT
≤ the TTFT target and whose TPOT ≤ the TPOT target (a one-token answer has no TPOT and passes
that half). A request the load generator disconnected on purpose is judged on what it received.

Goodput (the capacity figure of docs/design.md): the highest tested arrival rate at which at least 95 %
of requests meet both targets. It is taken conservatively: the highest rate r such that every
tested rate ≤ r meets the target, so a lucky run above a failing one does not count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)
PERCENTILE_METHOD = "linear"
GOODPUT_QUANTILE = 0.95
DEFAULT_SLO_TTFT_MS = 3000.0   # an 8,000-token prompt needs ≈ 2.1 s of chunked prefill alone
DEFAULT_SLO_TPOT_MS = 70.0     # a 32-row step + 256-token chunk is 65.6 ms (docs/design.md), target 70 ms

STATUS_OK = 200
STATUS_REJECTED = 429
STATUS_ERROR = 0               # no HTTP status: transport error, timeout, broken stream


@dataclass(slots=True)
class RequestRecord:
    """What one request saw. Times are seconds; None when the moment never came.

    Attributes:
        request_id: the id sent (or the server's), for cross-reference with server logs.
        api_key: the caller's key.
        arrival_s: intended arrival, seconds from the start of the run.
        prompt_tokens / max_tokens: request size.
        status: 200, 429, another HTTP status (400, 401, 503...), or 0 for a transport error.
        finish_reason: "stop", "length", "cancelled" (server-side: deadline, cancel), or None.
        output_tokens: tokens received.
        ttft_s / tpot_s / max_gap_s / queue_s / e2e_s: see the module docstring.
        disconnected: the load generator left mid-stream on purpose.
        retries: 429 answers retried before this outcome.
        error: short error text, "" when none.
    """

    request_id: str
    api_key: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    status: int = STATUS_ERROR
    finish_reason: str | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    max_gap_s: float | None = None
    queue_s: float | None = None
    e2e_s: float | None = None
    disconnected: bool = False
    retries: int = 0
    error: str = ""

    @property
    def completed(self) -> bool:
        """Status 200 and the answer ran to its end (stop or length)."""
        return self.status == STATUS_OK and self.finish_reason in ("stop", "length")

    @property
    def end_s(self) -> float | None:
        """When the request ended, seconds from the start of the run."""
        return None if self.e2e_s is None else self.arrival_s + self.e2e_s

    def meets_slo(self, ttft_ms: float, tpot_ms: float) -> bool:
        """TTFT ≤ ttft_ms and TPOT ≤ tpot_ms (no TPOT passes); 429s and errors never do."""
        if self.status != STATUS_OK or self.ttft_s is None or self.error:
            return False
        if not self.disconnected and self.finish_reason not in ("stop", "length"):
            return False
        return self.ttft_s * 1000.0 <= ttft_ms and (self.tpot_s is None or self.tpot_s * 1000.0 <= tpot_ms)


class TokenTimer:
    """Streams token arrival times into TTFT, TPOT and max gap without keeping them all."""

    __slots__ = ("arrival", "first", "last", "count", "max_gap")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0
        self.max_gap: float | None = None

    def token(self, t: float) -> None:
        """One token arrived at time `t` (same clock as `arrival`)."""
        if self.first is None:
            self.first = t
        else:
            gap = t - self.last
            self.max_gap = gap if self.max_gap is None else max(self.max_gap, gap)
        self.last = t
        self.count += 1

    def fill(self, rec: RequestRecord) -> None:
        """Write output_tokens, ttft_s, tpot_s and max_gap_s into `rec`."""
        rec.output_tokens = self.count
        if self.first is not None:
            rec.ttft_s = self.first - self.arrival
            rec.max_gap_s = self.max_gap if self.max_gap is not None else 0.0
            if self.count > 1:
                rec.tpot_s = (self.last - self.first) / (self.count - 1)


# -- numbers ------------------------------------------------------------------------------------
def percentiles(values: Iterable[float | None], qs: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """{"p50": ..., "p95": ..., "p99": ..., "mean": ..., "n": ...} over the non-None values.

    Method: numpy linear interpolation (type 7). Empty input gives None for each statistic.
    """
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    out: dict[str, float | None] = {}
    for q in qs:
        out[f"p{q:g}"] = float(np.percentile(arr, q, method=PERCENTILE_METHOD)) if arr.size else None
    out["mean"] = float(arr.mean()) if arr.size else None
    out["n"] = int(arr.size)
    return out


def slo_attainment(records: Sequence[RequestRecord], ttft_ms: float, tpot_ms: float) -> float | None:
    """Share of `records` meeting both targets (None for no records)."""
    if not records:
        return None
    return sum(r.meets_slo(ttft_ms, tpot_ms) for r in records) / len(records)


def goodput(points: Iterable[tuple[float, float | None]], quantile: float = GOODPUT_QUANTILE) -> float | None:
    """Highest rate r such that every tested rate ≤ r has attainment ≥ `quantile`.

    Args:
        points: (arrival rate, SLO attainment) per run; several runs of one rate must all pass.
    Returns:
        The rate, or None when the lowest tested rate already misses.
    """
    best = None
    by_rate: dict[float, bool] = {}
    for rate, att in points:
        ok = att is not None and att >= quantile
        by_rate[rate] = by_rate.get(rate, True) and ok
    for rate in sorted(by_rate):
        if not by_rate[rate]:
            break
        best = rate
    return best


def _ms(stats: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (v * 1000.0 if v is not None and k != "n" else v) for k, v in stats.items()}


def summarize(records: Sequence[RequestRecord], *, rate: float | None = None, ttft_ms: float = DEFAULT_SLO_TTFT_MS,
              tpot_ms: float = DEFAULT_SLO_TPOT_MS, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One run's numbers as a JSON-ready dict (latencies in ms)."""
    ends = [r.end_s for r in records if r.end_s is not None]
    start = min((r.arrival_s for r in records), default=0.0)
    span = (max(ends) - start) if ends else 0.0
    completed = [r for r in records if r.completed]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    out_tokens = sum(r.output_tokens for r in records)
    ok = [r for r in records if r.status == STATUS_OK]
    summary: dict[str, Any] = {
        "rate": rate,
        "num_requests": len(records),
        "num_completed": len(completed),
        "num_rejected_429": sum(r.status == STATUS_REJECTED for r in records),
        "num_errors": sum(r.status not in (STATUS_OK, STATUS_REJECTED) or (r.status == STATUS_OK and bool(r.error))
                          for r in records),
        "num_disconnected": sum(r.disconnected for r in records),
        "num_server_cancelled": sum(r.finish_reason == "cancelled" and not r.disconnected for r in records),
        "num_retries": sum(r.retries for r in records),
        "statuses": statuses,
        "span_s": span,
        "throughput_rps": len(completed) / span if span > 0 else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / span if span > 0 else None,
        "ttft_ms": _ms(percentiles(r.ttft_s for r in ok)),
        "tpot_ms": _ms(percentiles(r.tpot_s for r in ok)),
        "max_gap_ms": _ms(percentiles(r.max_gap_s for r in ok)),
        "queue_ms": _ms(percentiles(r.queue_s for r in ok)),
        "e2e_ms": _ms(percentiles(r.e2e_s for r in completed)),
        "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms,
                "attainment": slo_attainment(records, ttft_ms, tpot_ms)},
        "per_key": per_key(records),
    }
    if extra:
        summary.update(extra)
    return summary


def per_key(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Requests, completions, 429s and TTFT percentiles (ms) per API key."""
    keys: dict[str, list[RequestRecord]] = {}
    for r in records:
        keys.setdefault(r.api_key, []).append(r)
    return {k: {"num_requests": len(rs), "num_completed": sum(r.completed for r in rs),
                "num_rejected_429": sum(r.status == STATUS_REJECTED for r in rs),
                "ttft_ms": _ms(percentiles(r.ttft_s for r in rs if r.status == STATUS_OK))}
            for k, rs in sorted(keys.items())}


def report(runs: Sequence[dict[str, Any]], *, title: str = "genserve load test",
           config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole results.json: configuration, one summary per rate, goodput."""
    points = [(r["rate"], r["slo"]["attainment"]) for r in runs if r.get("rate") is not None]
    slo = runs[0]["slo"] if runs else {}
    return {"title": title, "config": dict(config or {}), "runs": list(runs),
            "goodput_rps": goodput(points), "goodput_quantile": GOODPUT_QUANTILE,
            "slo_ttft_ms": slo.get("ttft_ms"), "slo_tpot_ms": slo.get("tpot_ms"),
            "percentile_method": f"numpy.percentile(method={PERCENTILE_METHOD!r})"}


def dumps(obj: Any) -> str:
    """JSON with NaN/inf turned into null."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(obj), indent=2)


# -- markdown -----------------------------------------------------------------------------------
def _f(x: float | None, nd: int = 0) -> str:
    return "–" if x is None else f"{x:,.{nd}f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100.0 * x:.1f} %"


def markdown(rep: Mapping[str, Any]) -> str:
    """A human summary of `report(...)`: one table row per run, then per-key and engine tables."""
    runs = rep["runs"]
    lines = [f"# {rep.get('title', 'load test')}", ""]
    cfg = rep.get("config") or {}
    if cfg:
        lines += ["| setting | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in cfg.items()]
        lines.append("")
    lines += [
        f"SLO: TTFT ≤ {_f(rep.get('slo_ttft_ms'))} ms and TPOT ≤ {_f(rep.get('slo_tpot_ms'))} ms. "
        f"Goodput (highest rate with ≥ {100 * rep['goodput_quantile']:.0f} % meeting both, every lower "
        f"rate too): **{_f(rep['goodput_rps'], 2) + ' req/s' if rep['goodput_rps'] is not None else 'none'}**.",
        "",
        f"Percentiles: {rep.get('percentile_method')}; latencies in ms; times from intended arrival.",
        "",
        "| rate req/s | sent | done | 429 | err | disc | TTFT p50 / p95 / p99 | TPOT p50 / p95 / p99 "
        "| max gap p50 / p95 / p99 | queue p50 / p95 / p99 | e2e p50 / p95 | req/s | out tok/s | SLO met |",
        "|---:|---:|---:|---:|---:|---:|---|---|---|---|---|---:|---:|---:|",
    ]
    for r in runs:
        t = lambda k, qs=("p50", "p95", "p99"): " / ".join(_f(r[k][q]) for q in qs)  # noqa: E731
        lines.append(
            f"| {_f(r['rate'], 2)} | {r['num_requests']} | {r['num_completed']} | {r['num_rejected_429']} "
            f"| {r['num_errors']} | {r['num_disconnected']} | {t('ttft_ms')} | {t('tpot_ms')} | {t('max_gap_ms')} "
            f"| {t('queue_ms')} | {t('e2e_ms', ('p50', 'p95'))} | {_f(r['throughput_rps'], 2)} "
            f"| {_f(r['output_tokens_per_s'])} | {_pct(r['slo']['attainment'])} |")
    lines.append("")
    if any(len(r.get("per_key", {})) > 1 for r in runs):
        lines += ["## Per API key", "", "| rate | key | sent | done | 429 | TTFT p50 / p95 / p99 |",
                  "|---:|---|---:|---:|---:|---|"]
        for r in runs:
            for key, k in r["per_key"].items():
                ttft = " / ".join(_f(k["ttft_ms"][q]) for q in ("p50", "p95", "p99"))
                lines.append(f"| {_f(r['rate'], 2)} | {key} | {k['num_requests']} | {k['num_completed']} "
                             f"| {k['num_rejected_429']} | {ttft} |")
        lines.append("")
    engines = [r for r in runs if "engine" in r]
    if engines:
        lines += ["## Engine (simulated)", "",
                  "| rate | steps | rows/step mean / p95 / max | prefill tok/step mean | pool use mean / max "
                  "| preemptions | 429s | cancelled tokens | virtual s | wall s |",
                  "|---:|---:|---|---:|---|---:|---:|---:|---:|---:|"]
        for r in engines:
            e = r["engine"]
            lines.append(
                f"| {_f(r['rate'], 2)} | {e['num_steps']} | {_f(e['rows_per_step']['mean'], 1)} / "
                f"{_f(e['rows_per_step']['p95'])} / {_f(e['rows_per_step']['max'])} "
                f"| {_f(e['prefill_tokens_per_step_mean'], 1)} | {_pct(e['pool_use']['mean'])} / "
                f"{_pct(e['pool_use']['max'])} | {e['num_preemptions']} | {e['num_rejected']} "
                f"| {e['num_cancelled_tokens']} | {_f(e['virtual_s'], 1)} | {_f(e['wall_s'], 2)} |")
        lines.append("")
    return "\n".join(lines)
