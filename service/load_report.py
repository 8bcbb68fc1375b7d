"""The engine's in-band load report (ORCA), read by Envoy's client-side weighted round robin.

Every Generate answer of this engine carries one metadata entry, in its trailers (a refusal
before any message is a trailers-only answer: there it rides in the headers):

    endpoint-load-metrics: TEXT application_utilization=0.420000,rps_fractional=3.1000,
                           named_metrics.kv_free_blocks=812,named_metrics.queued_device_s=0.800

(one line). This is the "TEXT" form Envoy parses (source/common/orca/orca_parser.cc: the header
`endpoint-load-metrics`, the prefix "TEXT ", comma-separated `name=value` pairs, standard fields
by their OrcaLoadReport names, others as `named_metrics.<name>`; a NaN, an infinity, an unknown
name or a duplicate makes Envoy drop the whole report). Envoy's router reads it from the response
headers or, failing that, the trailers, once per call, and hands it to the cluster's balancer when
that is `envoy.load_balancing_policies.client_side_weighted_round_robin` (chart value
`envoy.engines.lbPolicy: CLIENT_SIDE_WEIGHTED_ROUND_ROBIN`); other balancers ignore it.

What Envoy does with it (the ClientSideWeightedRoundRobin docs; gRPC's weighted round robin,
gRFC A58, the same formula): each replica's weight is

    weight = rps_fractional / application_utilization      (an integer, truncated; at least 1)

refreshed every `weight_update_period`, used once a replica has reported for `blackout_period`,
dropped after `weight_expiration_period` without a report (a replica without a valid weight gets
the median of the others'). A report with `rps_fractional` <= 0 or utilization <= 0 is ignored.
The weight estimates how many requests per second a replica could serve at full utilization; a
replica whose utilization climbs faster than its throughput (queueing, a full KV pool) loses share.

The figures, all from what the scheduler and the server already know (`SchedulerStats`, read
under the engine lock as the call ends, and the requests that ended lately):

* utilization (dimensionless, [UTILIZATION_FLOOR, 1]) = the largest of
    - row share:   rows busy / `max_rows`, where rows busy is the larger of the rows running now
                   and the rows busy on average over the last RPS_WINDOW_S seconds (the
                   row-seconds of the requests that ended in the window, each counted for at most
                   the window, over its length: Little's law);
    - queue share: queued device-seconds / `queue_budget_s` (1 = new requests get 429);
    - KV share:    1 - free KV blocks / all blocks (cached prefix blocks no request holds count
                   as free: they are taken back on demand);
  clamped to [0, 1] and raised to UTILIZATION_FLOOR, so that the weight stays finite on an idle
  replica (Envoy ignores a zero utilization);
* rps_fractional (requests/s) = Generate calls this engine admitted and that ended (finished,
  cancelled or failed) in the last RPS_WINDOW_S seconds, divided by RPS_WINDOW_S, counting at
  least one: Envoy ignores a report with rps 0, and a replica busy with streams that have not
  ended yet must still be heard;
* named_metrics.kv_free_blocks (blocks) and named_metrics.queued_device_s (s): the raw inputs, for
  anyone reading the reports (Envoy's weight does not use them).

Why the averaged rows: below saturation a replica's rows busy grow with its request rate (rows =
rate x duration), so rps / utilization comes out near `max_rows` / the mean request duration on
every replica, whatever share it got: the weights stay level, as they should between equal
replicas. With the rows running at the instant of the report alone (usually none on a lightly
loaded replica: the request reporting has just left), utilization would sit at the floor and the
weight would grow with the rps, so the replica that served more would be sent more, and so on.
Queueing, a full pool or streams this Envoy never sees raise utilization faster than the rps,
and that replica's weight falls.

One `LoadReporter` per engine, used from the server's event loop only (not thread-safe).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

HEADER = "endpoint-load-metrics"    # Envoy's ORCA metadata key (the TEXT, JSON and BIN forms)
FORMAT_PREFIX = "TEXT "
UTILIZATION_FLOOR = 0.001           # an idle replica's utilization: weight at most 1,000 × its rps
RPS_WINDOW_S = 30.0                 # finished requests counted over this many recent seconds


@dataclass(frozen=True, slots=True)
class Load:
    """The scheduler's figures a load report is made of.

    Attributes:
        running_rows: requests (samples) in the running batch now.
        max_rows: the batch's row cap (`EngineConfig.max_rows`).
        queued_device_s: estimated device-seconds of queued work (s).
        queue_budget_s: queued device-seconds above which a new request gets 429 (s).
        kv_blocks_free: KV blocks a request can be given now (cached ones no request holds
            included).
        kv_blocks_total: KV blocks in the pool.
        recent_rows: rows busy on average over the recent window (`LoadReporter.recent_rows`).
    """

    running_rows: int
    max_rows: int
    queued_device_s: float
    queue_budget_s: float
    kv_blocks_free: int
    kv_blocks_total: int
    recent_rows: float = 0.0


def _share(part: float, whole: float) -> float:
    """`part / whole` clamped to [0, 1]; 0 when `whole` is not positive or either is NaN."""
    if not whole > 0 or math.isnan(part):
        return 0.0
    return min(1.0, max(0.0, part / whole))


def utilization(load: Load) -> float:
    """The engine's utilization (dimensionless, in [UTILIZATION_FLOOR, 1]): the largest of its row,
    queue and KV shares (see the module docstring). Never raises: a share whose denominator is
    not positive, or whose inputs are NaN, counts 0; an infinite queue counts 1."""
    kv_used = load.kv_blocks_total - load.kv_blocks_free
    rows = load.recent_rows if load.recent_rows > load.running_rows else load.running_rows
    shares = (_share(rows, load.max_rows),
              _share(load.queued_device_s, load.queue_budget_s),
              _share(kv_used, load.kv_blocks_total))
    return max(UTILIZATION_FLOOR, *shares)


def _number(value: float, digits: int) -> str:
    """`value` with `digits` decimals, as Envoy's parser takes it (0 for NaN, never "inf")."""
    if math.isnan(value):
        value = 0.0
    value = min(max(value, -1e12), 1e12)
    return f"{value:.{digits}f}"


def report_text(load: Load, rps: float) -> str:
    """The `endpoint-load-metrics` value for `load` and `rps` (requests/s): "TEXT " followed by
    application_utilization, rps_fractional, named_metrics.kv_free_blocks and
    named_metrics.queued_device_s. Never raises, and never writes a value Envoy would reject (NaN
    and infinities are replaced by finite numbers; rps below 0 is written as 0)."""
    fields = (("application_utilization", _number(utilization(load), 6)),
              ("rps_fractional", _number(max(rps, 0.0), 4)),
              ("named_metrics.kv_free_blocks", _number(max(load.kv_blocks_free, 0), 0)),
              ("named_metrics.queued_device_s", _number(max(load.queued_device_s, 0.0), 3)))
    return FORMAT_PREFIX + ",".join(f"{name}={value}" for name, value in fields)


class LoadReporter:
    """Counts the requests that end on this engine and their row-seconds; writes its load reports.

    Args:
        window_s: seconds of recent history `rps` and `recent_rows` average over (RPS_WINDOW_S).
        clock: seconds, monotonic (tests pass a fake one).

    Raises:
        ValueError: `window_s` is not a positive finite number.
    """

    def __init__(self, window_s: float = RPS_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        self.window_s = window_s
        self.clock = clock
        # [whole second, requests ended in it, their row-seconds]
        self._buckets: deque[list] = deque()

    def request_ended(self, duration_s: float = 0.0, rows: int = 1) -> None:
        """Count one admitted request that ended now (finished, cancelled or failed), which held
        `rows` rows (its samples) for `duration_s` seconds (counted for at most `window_s`; a
        negative or NaN duration counts 0)."""
        held = min(duration_s, self.window_s) if duration_s > 0 else 0.0
        second = math.floor(self.clock())
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += 1
            self._buckets[-1][2] += held * max(rows, 0)
        else:
            self._buckets.append([second, 1, held * max(rows, 0)])
        self._forget(second)

    def rps(self) -> float:
        """Requests ended per second over the last `window_s` seconds (requests/s), counting at
        least one request (so never 0; see the module docstring)."""
        self._forget(math.floor(self.clock()))
        return max(1, sum(bucket[1] for bucket in self._buckets)) / self.window_s

    def recent_rows(self) -> float:
        """Rows busy on average over the last `window_s` seconds: the row-seconds of the requests
        that ended in it over its length (rows)."""
        self._forget(math.floor(self.clock()))
        return sum(bucket[2] for bucket in self._buckets) / self.window_s

    def header(self, load: Load) -> tuple[str, str]:
        """The metadata entry (`HEADER`, report text) to send with an answer: `load` with its
        `recent_rows` set from this window, and `rps()`."""
        load = dataclasses.replace(load, recent_rows=self.recent_rows())
        return HEADER, report_text(load, self.rps())

    def _forget(self, now: int) -> None:
        """Drop the seconds that left the window."""
        oldest = now - math.ceil(self.window_s) + 1
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()
