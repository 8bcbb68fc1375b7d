"""Fair queueing by API key: the waiting requests per key and what each key has been served.

The join admits from the key with the fewest weighted tokens served (prompt tokens computed count
1 each, output tokens `output_token_weight`), keys under `per_key_rows` running rows first; a key
that becomes active starts level with the least-served active key (start-time fair queueing), so
an idle key cannot bank credit. In the spirit of vLLM's `v1/core/sched/request_queue.py`, but one
queue per key instead of one FCFS or priority queue.

Pure bookkeeping: no clock, no blocks, no cost model. `FairQueue` is the only code that changes a
key's `KeyUsage`, its queue, or the queued-work gauge (`queued_device_ms`); the scheduler decides
when (admit, preempt, finish, charge).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from engine.core.request import Request

__all__ = ["FairQueue", "KeyUsage"]


@dataclass(slots=True)
class KeyUsage:
    """Fair-queueing account of one API key (design: weighted tokens served, running rows).

    Attributes:
        api_key: the key.
        weighted_tokens_served: prompt tokens computed (weight 1) plus sampled tokens (weight
            `output_token_weight`) so far, raised on activation to the least-served active key's.
        running_rows: the key's requests (samples included) running now.
    """

    api_key: str
    weighted_tokens_served: float = 0.0
    running_rows: int = 0


class FairQueue:
    """The per-key waiting queues, the per-key usage accounts and the queued-work gauge.

    Args:
        per_key_rows: most running rows one key may hold while another key waits (the cap that
            `next_candidate` and `preemptible_key` enforce).

    Attributes:
        waiting: api key → its queued requests, oldest first (preempted ones at the front). A key
            keeps its (possibly empty) deque once it has one; key order is first-arrival order.
        usage: api key → its `KeyUsage`, created when the key's first request is queued
            (dropped by `forget_key`).
        queued_device_ms: the estimated device time of every queued request (`est_device_ms`),
            ms: raised on enqueue and push-front, lowered (never below 0) on removal.

    Thread-safety: none; the engine lock serialises every call.
    """

    def __init__(self, per_key_rows: int) -> None:
        self.per_key_rows = per_key_rows
        self.waiting: dict[str, deque[Request]] = {}
        self.usage: dict[str, KeyUsage] = {}
        self.queued_device_ms = 0.0

    # -- queries ------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Requests waiting to be admitted (including preempted ones)."""
        return sum(len(q) for q in self.waiting.values())

    def requests(self) -> Iterator[Request]:
        """Every queued request: key by key in first-arrival order of the keys, each key's queue
        front to back."""
        return (r for q in self.waiting.values() for r in q)

    def served(self, api_key: str) -> float:
        """Weighted tokens served to `api_key` (its account must exist: KeyError otherwise)."""
        return self.usage[api_key].weighted_tokens_served

    def active_keys(self, api_key: str) -> set[str]:
        """Keys with a queued request or a running row, plus `api_key`."""
        active = {k for k, q in self.waiting.items() if q}
        return active | {k for k, u in self.usage.items() if u.running_rows} | {api_key}

    def next_candidate(self, skip: Collection[str] = ()) -> Request | None:
        """Head of the least-served waiting key; keys under the row cap first (work-conserving:
        when every waiting key is at its cap, the least-served one still gets the free row).
        Ties go to the key with fewer rows, then to the older head request. Keys in `skip` are
        passed over (their heads wait for something else than rows or blocks). None when nothing
        waits."""
        keys = [k for k, q in self.waiting.items() if q and k not in skip]
        if not keys:
            return None
        under = [k for k in keys if self.usage[k].running_rows < self.per_key_rows]
        key = min(under or keys, key=lambda k: (self.usage[k].weighted_tokens_served,
                                                self.usage[k].running_rows, self.waiting[k][0].stats.arrival_s))
        return self.waiting[key][0]

    def preemptible_key(self, req: Request) -> str | None:
        """The key whose newest row the join preempts to make room for `req`, or None.

        A key may hold more than `per_key_rows` rows only while no other key waits for room:
        when `req`'s key is under the cap and another key is over it, that is the key with the
        most rows (the first such key at a tie).
        """
        over = [k for k, u in self.usage.items()
                if k != req.api_key and u.running_rows > self.per_key_rows]
        if not over or self.usage[req.api_key].running_rows >= self.per_key_rows:
            return None
        return max(over, key=lambda k: self.usage[k].running_rows)

    # -- changes ------------------------------------------------------------------------------
    def enqueue(self, req: Request) -> None:
        """Queue `req` at the back of its key's queue and add its estimate to the gauge.

        A key that becomes active (nothing queued, no row running) starts level with the
        least-served other active key, so an idle key cannot bank credit and then starve everyone
        (start-time fair queueing).
        """
        usage = self.usage.setdefault(req.api_key, KeyUsage(req.api_key))
        if not self.waiting.get(req.api_key) and usage.running_rows == 0:
            active = [u.weighted_tokens_served for k, u in self.usage.items()
                      if k != req.api_key and (u.running_rows or self.waiting.get(k))]
            if active:
                usage.weighted_tokens_served = max(usage.weighted_tokens_served, min(active))
        self.waiting.setdefault(req.api_key, deque()).append(req)
        self.queued_device_ms += req.est_device_ms

    def push_front(self, req: Request) -> None:
        """Queue a preempted `req` first for its key (it keeps its place in fair order) and add
        its estimate to the gauge."""
        self.waiting.setdefault(req.api_key, deque()).appendleft(req)
        self.queued_device_ms += req.est_device_ms

    def pop_head(self, req: Request) -> None:
        """Take `req`, the head of its key's queue (`next_candidate`), off the queue to run it.

        Raises:
            IndexError: `req`'s key has nothing queued (KeyError: it never had).
        """
        self.waiting[req.api_key].popleft()
        self.queued_device_ms = max(0.0, self.queued_device_ms - req.est_device_ms)

    def remove(self, req: Request) -> bool:
        """Take `req` out of its key's queue wherever it stands. Returns False when not queued."""
        queue = self.waiting.get(req.api_key)
        if queue is None or req not in queue:
            return False
        queue.remove(req)
        self.queued_device_ms = max(0.0, self.queued_device_ms - req.est_device_ms)
        return True

    def row_started(self, api_key: str) -> None:
        """One more running row for `api_key` (admission, or a sample forked)."""
        self.usage[api_key].running_rows += 1

    def row_ended(self, api_key: str) -> None:
        """One running row less for `api_key` (finished or preempted)."""
        self.usage[api_key].running_rows -= 1

    def forget_key(self, api_key: str) -> None:
        """Drop `api_key`'s account, if any (its queue stays): after start-up warm-up and
        invariance checks, whose traffic is not a user's. Call only while the key has nothing
        queued or running."""
        self.usage.pop(api_key, None)

    def charge(self, api_key: str, weighted_tokens: float) -> None:
        """Count `weighted_tokens` served to `api_key` (a prompt piece computed, a token sampled)."""
        self.usage[api_key].weighted_tokens_served += weighted_tokens
