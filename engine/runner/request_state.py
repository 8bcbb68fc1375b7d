"""The model runner's own per-request state (vLLM's `CachedRequestState`): what the runner keeps
between a request's steps and nobody else reads or writes. The request record
(`engine.core.request.Request`) stays the scheduler's and the client's.

Per request: its random generator (seeded from `SamplingParams.seed`, made on the device where it
samples, kept across preemption so a resumed request draws what it would have drawn), the logits
processors' state (`engine.runner.logits_processors.RowState`: the token history the penalties
read, the bias as arrays) and its grammar matcher (`engine.structured.masks.RowMatcher`). An entry
is made on a request's first use and dropped at the first step after the request finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.core.request import Request


@dataclass(slots=True)
class CachedRequestState:
    """One request's runner state; each field None until the runner first needs it.

    Attributes:
        generator: the request's own generator, on the sampling device.
        sampler: the logits processors' `RowState`.
        grammar: the request's `RowMatcher` in its compiled grammar (written on the grammar
            worker thread while the forward pass runs; read nowhere else).
    """

    generator: torch.Generator | None = None
    sampler: Any = None
    grammar: Any = None


class RequestStates:
    """Request id → its `CachedRequestState`, owned by one model runner (one thread, the engine
    loop's, makes and drops entries)."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[Request, CachedRequestState]] = {}

    def of(self, req: Request) -> CachedRequestState:
        """`req`'s state, made empty on first use (a new request reusing a finished one's id gets
        a fresh one)."""
        entry = self._by_id.get(req.request_id)
        if entry is None or entry[0] is not req:
            entry = self._by_id[req.request_id] = (req, CachedRequestState())
        return entry[1]

    def get(self, request_id: str) -> CachedRequestState | None:
        """The state of a request the runner has seen and not yet dropped, else None."""
        entry = self._by_id.get(request_id)
        return None if entry is None else entry[1]

    def prune(self) -> None:
        """Drop the entries of requests that finished (done or cancelled)."""
        for request_id in [i for i, (req, _) in self._by_id.items() if req.finished]:
            del self._by_id[request_id]

    def __len__(self) -> int:
        return len(self._by_id)
