"""The adapters a server serves and those resident where the products run.

`LoraRegistry`: adapters by served name, loaded and checked (`engine.model.lora.load_adapter`),
host copies; it makes each new request's `LoraRequest` (name, load id, the adapter), and unloading
a name stops new requests only: a request holding the adapter finishes on it.

`LoraSlots`: the model runner's resident adapters (device copies, packed where the CPU kernels
run them), at most `max_loras` between steps, least recently used evicted first.
"""

from __future__ import annotations

import pathlib
import threading
from collections import OrderedDict

import torch

from engine.core.plan import StepPlan
from engine.core.request import LoraRequest
from engine.model.config import ModelArgs
from engine.model.lora import MAX_LORA_RANK, LoraAdapter, LoraBatch, ResidentLora, load_adapter, make_resident


class LoraSlots:
    """The adapters resident where the products run: at most `max_loras`, evicted least recently
    used first (their host copies stay with the adapter); an unloaded adapter leaves as soon as
    a step no longer uses it.

    Args:
        device, dtype: the model's.
        max_loras: resident adapters kept between steps (`EngineConfig.max_loras`; the scheduler
            gives no step more adapters than that, `engine.core.sched.lora_cap`, so none is
            evicted while its step runs). Handed a step of more, `acquire` keeps them all for it.
        int8: store the pairs in `lora_delta_`'s 8-bit format where its kernel runs them
            (`EngineConfig.lora_dtype`; `engine.model.lora.make_resident`).

    Attributes:
        loads: adapters made resident so far; evictions: adapters dropped to make room or
            because they were unloaded.

    Thread-safety: the model runner's thread only.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, max_loras: int = 8,
                 int8: bool = False) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.device, self.dtype, self.max_loras, self.int8 = device, dtype, max_loras, int8
        self._resident: OrderedDict[int, ResidentLora] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    @property
    def resident_ids(self) -> list[int]:
        """The resident adapters' load ids, least recently used first."""
        return list(self._resident)

    def acquire(self, loras: list[LoraRequest]) -> dict[int, ResidentLora]:
        """Make every adapter of `loras` resident (the step's), most recently used now; then drop
        unloaded adapters the step does not use and the least recently used beyond
        `max_loras`. Returns load id -> `ResidentLora` for the step's adapters."""
        used = {}
        for lora in loras:
            if lora.lora_id in used:
                continue
            res = self._resident.pop(lora.lora_id, None)
            if res is None:
                res = make_resident(lora.adapter, self.device, self.dtype, self.int8)
                self.loads += 1
            self._resident[lora.lora_id] = res
            used[lora.lora_id] = res
        self.trim(set(used))
        return used

    def trim(self, keep: set[int] = frozenset()) -> None:
        """Drop resident adapters that were unloaded, then the least recently used beyond
        `max_loras`, except those in `keep`."""
        for lid in [lid for lid, r in self._resident.items() if r.adapter.unloaded and lid not in keep]:
            del self._resident[lid]
            self.evictions += 1
        for lid in list(self._resident):
            if len(self._resident) <= self.max_loras:
                break
            if lid not in keep:
                del self._resident[lid]
                self.evictions += 1


def lora_batch(plan: StepPlan, slots: LoraSlots, device: torch.device) -> LoraBatch | None:
    """The step's row → adapter mapping: every token of a segment runs on its request's adapter
    (`Request.lora`), made resident in `slots`; rows grouped by adapter (`LoraBatch`). None when
    no row has an adapter (then unloaded adapters still resident are dropped)."""
    loras = [s.request.lora for s in plan.segments if s.request.lora is not None]
    if not loras:
        slots.trim()
        return None
    resident = slots.acquire(loras)
    rows: list[ResidentLora | None] = []
    for seg in plan.segments:
        lora = seg.request.lora
        rows.extend([None if lora is None else resident[lora.lora_id]] * seg.length)
    return LoraBatch.from_rows(rows, device)


class LoraRegistry:
    """The adapters a server serves, by name: loaded, checked and held in host memory.

    Args:
        args, dtype: the base model's (adapters are checked against it and kept in its dtype).
        max_rank: the largest rank accepted (at most `MAX_LORA_RANK`).

    Attributes:
        loads / unloads: adapters loaded / unloaded so far.

    Thread-safety: every method takes the registry's lock (the service loads and unloads from
    its threads while the scheduler thread reads the adapters through requests).
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype, max_rank: int = MAX_LORA_RANK) -> None:
        self.args, self.dtype, self.max_rank = args, dtype, min(max_rank, MAX_LORA_RANK)
        self._by_name: dict[str, LoraAdapter] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        self.loads = 0
        self.unloads = 0

    def load(self, name: str, path: str | pathlib.Path) -> LoraAdapter:
        """Load the adapter at `path` as `name` and serve it to new requests.

        Raises:
            ValueError: an empty name or one already loaded; a bad adapter (`load_adapter`), or
                a rank above `max_rank`.
        """
        if not name or not isinstance(name, str):
            raise ValueError("lora_name must be a non-empty string")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            lora_id, self._next_id = self._next_id, self._next_id + 1
        adapter = load_adapter(path, self.args, self.dtype, name, lora_id)
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {path}: rank {adapter.rank} is above --max-lora-rank {self.max_rank}")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            self._by_name[name] = adapter
            self.loads += 1
        return adapter

    def unload(self, name: str) -> LoraAdapter:
        """Stop serving `name` to new requests (requests already holding it finish on it; its
        memory is freed when the last of them does). Raises KeyError if it is not loaded."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise KeyError(name)
            adapter.unloaded = True
            self.unloads += 1
            return adapter

    def request(self, name: str) -> LoraRequest:
        """The `LoraRequest` of adapter `name` for a new request. Raises KeyError if not loaded."""
        with self._lock:
            adapter = self._by_name[name]
        return LoraRequest(adapter.name, adapter.lora_id, adapter)

    def adapters(self) -> list[LoraAdapter]:
        """The loaded adapters, in load order."""
        with self._lock:
            return list(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._by_name
