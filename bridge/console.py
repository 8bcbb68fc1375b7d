"""The web console's data: its static files and the JSON of one scheduler snapshot.

The console is a page the bridge serves at `/` (files in `bridge/static/`, shipped with the
package: no build step, no CDN). Its live view reads `GET /v1/console/events`, a server-sent event
stream with one `data:` event per `SchedulerSnapshot` from the engine's `WatchScheduler` stream,
as the JSON object `snapshot_event` builds (fields and units: docs/console.md).
"""

from __future__ import annotations

from pathlib import Path

from genserve.v1 import generate_pb2 as pb

STATIC_DIR = Path(__file__).parent / "static"
INDEX_HTML = STATIC_DIR / "index.html"
# The block map as one character per block: the state byte's digit ("0" free, "1" used, "2" shared).
_STATE_DIGITS = bytes.maketrans(bytes(range(10)), b"0123456789")


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
