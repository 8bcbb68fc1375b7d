"""Each constrained row's token mask, computed while the step's forward pass runs.

A step's masks depend only on the tokens its rows generated before the step, so they are known
when the step starts. `GrammarMasks.start` hands the step's constrained draws to a worker thread
as the model runner begins the step; the worker advances each row's matcher by the tokens it has
not seen yet, fills one bit per vocabulary token (llguidance's `LLExecutor`, which releases
the GIL) and unpacks the bits to one bool per token (numpy); `PendingMasks.apply`, just before sampling, waits for it (normally done long before the
forward ends) and sets the logits of disallowed tokens to -inf, row by row. Rows without a
constraint are never touched, and a step without constrained rows does no grammar work at all.

A row's matcher lives with the model runner's state of its request (`CachedRequestState.grammar`),
created from the compiled grammar on the row's first draw, so each of n samples has its own, and it survives preemption:
after a preemption the request replays its generated tokens as rows that do not sample, and the
matcher, which already consumed those tokens, goes on from where it was. A matcher consumes
tokens lazily, by the count of `Request.generated` it has seen, so a token is never consumed
twice and the state never depends on which step a token was sampled in.

The end-of-sequence token is allowed exactly where the grammar may end (llguidance marks it in
the mask then); a matcher in an error state (which a token chosen from its own mask cannot
cause) allows only the end-of-sequence token, so the row ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BITS = 32      # tokens per int32 word of an llguidance bitmask (bit b of word w: token 32 w + b)


def unpack_bitmask(bitmask: torch.Tensor) -> torch.Tensor:
    """llguidance's token bitmask as one bool per token.

    Args:
        bitmask: int32 [K, W], bit b of word w set when token 32 w + b is allowed (on the CPU).
    Returns:
        bool [K, 32 W] on the CPU, True where allowed (ids past the vocabulary are never set).
    """
    # Written as little-endian words, bit b of word w is bit b % 8 of byte 4 w + b // 8, which
    # unpackbits(bitorder="little") puts at index 32 w + b.
    raw = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)
    return torch.from_numpy(np.unpackbits(raw, axis=1, bitorder="little").view(np.bool_))


class RowMatcher:
    """One sample's position in its grammar.

    Args:
        compiled: the request's `engine.structured.compiler.CompiledGrammar`.

    Attributes:
        matcher: the row's own `llguidance.LLMatcher`.
        consumed: tokens of the sample's `generated` list the matcher has consumed.
    """

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.matcher = compiled.new_matcher()
        self.consumed = 0

    def advance(self, generated: Sequence[int]) -> None:
        """Consume the tokens of `generated` not consumed yet (a token outside the grammar puts
        the matcher in its error state; the next mask then allows only end-of-sequence)."""
        for token in generated[self.consumed:]:
            if not self.matcher.is_error():
                self.matcher.consume_token(token)
        self.consumed = len(generated)


@dataclass(slots=True)
class MaskStats:
    """What the grammar work cost, over the runner's life.

    Attributes:
        steps: steps that had constrained rows.
        rows: constrained draws masked.
        compute_s: seconds the worker spent advancing matchers and filling masks.
        wait_s: seconds sampling waited for the worker (the part on the step's critical path).
        apply_s: seconds spent applying masks to logits (on the critical path).
    """

    steps: int = 0
    rows: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0


class PendingMasks:
    """The masks of one step's constrained draws, being computed (see `GrammarMasks.start`)."""

    def __init__(self, owner: "GrammarMasks", draws: list[int], future: Future) -> None:
        self._owner = owner
        self.draws = draws
        self._future = future

    def apply(self, logits: torch.Tensor) -> None:
        """Set the disallowed tokens of each constrained draw's row of `logits` to -inf, in place.

        Args:
            logits: fp32 [D, vocab], one row per draw of the step, in `plan.draws` order.
        Raises:
            whatever the worker raised (a bug: the engine loop fails the step).
        """
        t0 = time.perf_counter()
        allowed = self._future.result()                                     # bool [K, words * 32]
        t1 = time.perf_counter()
        device = logits.device
        allowed = allowed.to(device, non_blocking=True)
        vocab = logits.shape[1]
        if allowed.shape[1] >= vocab:
            allowed = allowed[:, :vocab]
        else:              # logits wider than the tokenizer's vocabulary: padding ids never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        rows = torch.tensor(self.draws, dtype=torch.long, device=device)
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
        stats = self._owner.stats
        stats.wait_s += t1 - t0
        stats.apply_s += time.perf_counter() - t1


class GrammarMasks:
    """The model runner's grammar worker: one thread, one llguidance executor.

    Args:
        threads: llguidance's threads for filling masks in parallel (None: its default, 80% of
            the cores up to 32).

    Attributes:
        stats: `MaskStats`.
    """

    def __init__(self, threads: int | None = None) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None
        self._lock = threading.Lock()
        self.stats = MaskStats()

    def start(self, draws: Sequence[tuple[int, Any]], state_of: Callable[[Any], Any]) -> PendingMasks | None:
        """Begin the masks of a step's draws (`StepPlan.draws`: (logits row, request) pairs).

        `state_of(request)` gives the holder of the request's matcher (an object with a `grammar`
        attribute, None until the first draw: the model runner's `CachedRequestState`), so the
        matcher lives with the runner's other per-request state, not on the request.
        Returns None when no draw is constrained (`request.constraint` is None for all): the step
        does no grammar work. Call before the forward pass; `PendingMasks.apply` before sampling.
        """
        rows = [(j, req, state_of(req)) for j, (_, req) in enumerate(draws) if req.constraint is not None]
        if not rows:
            return None
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="genserve-grammar")
        return PendingMasks(self, [j for j, _, _ in rows], self._pool.submit(self._compute, rows))

    def _compute(self, rows: list[tuple[int, Any, Any]]) -> torch.Tensor:
        """On the worker: advance each row's matcher, fill its mask and unpack it to one bool per
        token (bool [K, words * 32], True: allowed), so that only the fill of the logits is left
        on the step's critical path."""
        import llguidance

        t0 = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._threads)
        vocab = rows[0][1].constraint.vocab_size
        bitmask = torch.zeros(len(rows), (vocab + BITS - 1) // BITS, dtype=torch.int32)
        matchers = []
        broken = []
        for k, (_, req, holder) in enumerate(rows):
            state = holder.grammar
            if state is None:
                state = holder.grammar = RowMatcher(req.constraint)
            state.advance(req.generated)
            if state.matcher.is_error():
                broken.append((k, state.compiled.eos_token_id))
            else:
                matchers.append((state.matcher, k))
        if matchers:            # fills row k of the contiguous bitmask, GIL released
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), bitmask.shape[1] * 4,
                                                   bitmask.shape[0])
        for k, eos in broken:                               # only end-of-sequence: the row ends
            bitmask[k].zero_()
            bitmask[k, eos // BITS] = 1 << (eos % BITS) if eos % BITS != 31 else -(2**31)
        allowed = unpack_bitmask(bitmask)
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.compute_s += time.perf_counter() - t0
        return allowed

    def close(self) -> None:
        """Stop the worker thread (pending masks finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
