"""The web console's data: its static files, the JSON of one scheduler snapshot, and the
replicas' counters.

The console is a page the bridge serves at `/` (files in `bridge/static/`, shipped with the
package: no build step, no CDN). Its live view reads `GET /v1/console/events`, a server-sent event
stream with one `data:` event per `SchedulerSnapshot` from the engine's `WatchScheduler` stream,
as the JSON object `snapshot_event` builds, and polls `GET /v1/console/replicas`, each engine
replica's counters from its Prometheus endpoint, as the JSON object `replicas_event` builds
(fields and units: docs/console.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from genserve.v1 import generate_pb2 as pb

STATIC_DIR = Path(__file__).parent / "static"
INDEX_HTML = STATIC_DIR / "index.html"
# The block map as one character per block: the state byte's digit ("0" free, "1" used, "2" shared).
_STATE_DIGITS = bytes.maketrans(bytes(range(10)), b"0123456789")
# A replica's fields and the engine samples each sums over their labels (service/metrics.py).
_REPLICA_FIELDS = (
    ("prefix_cache_queried_tokens", "genserve_prefix_cache_queried_tokens_total"),
    ("prefix_cache_hit_tokens", "genserve_prefix_cache_hit_tokens_total"),
    ("requests_finished", "genserve_requests_finished_total"),
    ("running_rows", "genserve_running_rows"),
)


def _latency(summary: pb.LatencySummary) -> dict:
    return {"count": summary.count, "p50_ms": round(summary.p50_ms, 3), "p95_ms": round(summary.p95_ms, 3),
            "max_ms": round(summary.max_ms, 3)}


def snapshot_event(snap: pb.SchedulerSnapshot) -> dict:
    """One snapshot as the console's JSON event (times in s or ms as each key says; counts are
    plain numbers; `kv_pool.map` is one digit per block by block id: 0 not held, 1 held by one
    request, 2 held by several).

    Raises ValueError: a block state above 9 (not in the contract)."""
    states = snap.kv_pool.block_states
    if states and max(states) > 9:
        raise ValueError(f"block state {max(states)} is not in the contract")
    return {
        "unix_time_s": snap.unix_time_s,
        "engine": snap.engine,
        "steps": snap.steps,
        "running_rows": snap.running_rows,
        "prefill_rows": snap.prefill_rows,
        "decode_rows": snap.running_rows - snap.prefill_rows,
        "max_rows": snap.max_rows,
        "queues": [{"name": q.name, "queued": q.queued, "running": q.running} for q in snap.queues],
        "queue_depth": sum(q.queued for q in snap.queues),
        "adapters": [{"name": a.name, "running": a.running, "queued": a.queued} for a in snap.adapters],
        "queued_device_s": round(snap.queued_device_s, 4),
        "queue_budget_s": snap.queue_budget_s,
        "kv_pool": {"block_size": snap.kv_pool.block_size, "total": snap.kv_pool.total_blocks,
                    "free": snap.kv_pool.free_blocks, "used": snap.kv_pool.used_blocks,
                    "cached": snap.kv_pool.cached_blocks, "map": states.translate(_STATE_DIGITS).decode("ascii")},
        "recent_steps": [{"age_s": round(s.age_s, 4), "decode_rows": s.decode_rows,
                          "prefill_tokens": s.prefill_tokens, "decode_ms": round(s.decode_ms, 3),
                          "prefill_ms": round(s.prefill_ms, 3)} for s in snap.recent_steps],
        "latency": {"window_s": snap.latency_window_s, "ttft": _latency(snap.ttft),
                    "tpot": _latency(snap.tpot), "max_token_gap": _latency(snap.max_token_gap)},
        "rejected_total": snap.rejected_total,
        "preemptions_total": snap.preemptions_total,
        "finished_total": snap.finished_total,
    }


def replicas_event(expositions: Sequence[bytes | None]) -> dict:
    """The replicas' counters as the console's JSON: `{"replicas": [...]}`, one object per engine
    exposition in the order given, `replica` its position ("0", "1", ...; the `replica` label of
    GET /metrics). Each holds `up` and, as integers summed over the samples' labels, the prompt
    tokens looked up in the prefix cache and found there (`prefix_cache_queried_tokens`,
    `prefix_cache_hit_tokens`; tokens), `requests_finished` (count) and `running_rows` (rows), and
    `hit_ratio`, hit / queried tokens (0 to 1, null while nothing was queried).

    An exposition that is None (the engine was not reached) or not in the Prometheus text format
    gives `up: false` and every other field null; a sample missing from it, or whose sum is not
    finite, gives null for its field. Raises nothing."""
    return {"replicas": [_replica(str(i), text) for i, text in enumerate(expositions)]}


def _replica(name: str, exposition: bytes | None) -> dict:
    """One replica's object of `replicas_event`."""
    totals = None if exposition is None else _sample_sums(exposition)
    out = {"replica": name, "up": totals is not None}
    out.update((field, None if totals is None else totals.get(sample)) for field, sample in _REPLICA_FIELDS)
    queried, hit = out["prefix_cache_queried_tokens"], out["prefix_cache_hit_tokens"]
    out["hit_ratio"] = round(hit / queried, 4) if queried and hit is not None else None
    return out


def _sample_sums(exposition: bytes) -> dict[str, int] | None:
    """The sum of each `_REPLICA_FIELDS` sample over its labels, by sample name (absent when the
    exposition has no such sample or the sum is not finite); None when it is not the text format."""
    wanted = {sample for _, sample in _REPLICA_FIELDS}
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(exposition.decode()):
            for s in family.samples:
                if s.name in wanted:
                    values.setdefault(s.name, []).append(s.value)
    except ValueError:                 # UnicodeDecodeError included
        return None
    sums = {name: sum(vs) for name, vs in values.items()}
    return {name: int(total) for name, total in sums.items() if math.isfinite(total)}
