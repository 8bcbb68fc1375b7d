"""Batch formation (`EngineConfig.batching`): when queued requests may join, and whether prompts
are cut into pieces.

"continuous" is the served policy; the others exist for the design's scheduler comparison
(`loadgen.report`):

| mode | join | prefill |
|---|---|---|
| continuous | between any two steps | chunked: pieces within the step's prefill budget |
| continuous_unchunked | between any two steps | whole prompts in one step |
| static | a batch forms only when none runs and `max_rows` requests wait | whole prompts |
| dynamic | as static, or once the oldest waiting request has waited `dynamic_window_s` | whole prompts |

`join_wait_s(now, num_running, queue)` is seconds until the mode lets queued requests join (rows
and blocks permitting): 0.0 now, `math.inf` not before the running batch ends or more arrive. A
virtual-time driver jumps its clock by it when a step ran nothing.
"""

from __future__ import annotations

import math
from typing import Protocol

from engine.config import EngineConfig
from engine.core.sched.fair_queue import FairQueue

__all__ = ["Batching", "ContinuousBatching", "DynamicBatching", "StaticBatching", "batching_for"]


class Batching(Protocol):
    """A batch-formation mode.

    Attributes:
        joins_between_steps: requests may join a running batch between any two steps.
        chunked_prefill: prompts run as `prefill_piece` pieces within the step's prefill budget
            (False: a prompt runs whole in one step).
    """

    joins_between_steps: bool
    chunked_prefill: bool

    def join_wait_s(self, now: float, num_running: int, queue: FairQueue) -> float:
        """Seconds from `now` until queued requests may join (0.0: now; `math.inf`: not before
        the running batch ends or more requests arrive)."""
        ...


class ContinuousBatching:
    """Continuous batching: requests join between any two steps.

    Args:
        chunked_prefill: cut prompts into pieces ("continuous") or run them whole
            ("continuous_unchunked").
    """

    joins_between_steps = True

    def __init__(self, chunked_prefill: bool) -> None:
        self.chunked_prefill = chunked_prefill

    def join_wait_s(self, now: float, num_running: int, queue: FairQueue) -> float:
        """Always 0.0: a request joins as soon as rows and blocks allow."""
        return 0.0


class StaticBatching:
    """Static batching: a new batch forms only when none runs and `max_rows` requests wait.

    Args:
        config: the engine's dials (`max_rows`: the batch size).
    """

    joins_between_steps = False
    chunked_prefill = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def join_wait_s(self, now: float, num_running: int, queue: FairQueue) -> float:
        """0.0 when nothing runs and a full batch waits, else `math.inf`."""
        if num_running or queue.depth < self.config.max_rows:
            return math.inf
        return 0.0


class DynamicBatching:
    """Dynamic batching: as static, but a batch also fires once the oldest waiting request has
    waited `dynamic_window_s`.

    Args:
        config: the engine's dials (`max_rows`: the batch that fires at once;
            `dynamic_window_s`: the longest a request waits for a batch to fill, seconds).
    """

    joins_between_steps = False
    chunked_prefill = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def join_wait_s(self, now: float, num_running: int, queue: FairQueue) -> float:
        """`math.inf` while a batch runs or nothing waits; 0.0 with a full batch waiting or the
        window passed; else the seconds until the oldest waiting request's window closes."""
        if num_running or not queue.depth:
            return math.inf
        if queue.depth >= self.config.max_rows:
            return 0.0
        oldest = min(r.stats.arrival_s for r in queue.requests())
        wait = oldest + self.config.dynamic_window_s - now
        return 0.0 if wait <= 1e-9 else wait


def batching_for(config: EngineConfig) -> Batching:
    """The mode `config.batching` names (one of `engine.config.BATCHING_MODES`).

    Raises:
        ValueError: an unknown mode (`EngineConfig` validates it first).
    """
    mode = config.batching
    if mode == "continuous":
        return ContinuousBatching(chunked_prefill=True)
    if mode == "continuous_unchunked":
        return ContinuousBatching(chunked_prefill=False)
    if mode == "static":
        return StaticBatching(config)
    if mode == "dynamic":
        return DynamicBatching(config)
    raise ValueError(f"unknown batching mode {mode!r}")
