"""The logits processors: what a row's sampling settings do to its logits before the draw.

In the order vLLM applies them (`SamplingParams` documents each): the repetition penalty (over
the prompt and the generated tokens), the frequency and presence penalties (over the generated
tokens), `logit_bias`, and the `min_tokens` ban on the end-of-sequence token and
`stop_token_ids`. Temperature, top-k, top-p and min-p come after, in `engine.runner.sampler`.

Every operation touches only the (row, token id) entries a row names — the tokens it has seen,
its bias, its banned ids — never a dense [rows, vocab] pass, so a 32-row step pays for a few
thousand gathers and scatters rather than 1.5 million elements. Each entry is computed from its
own row's settings and history alone, so a row's logits do not depend on its neighbours (the
sampler's batch invariance holds), and nothing here draws random numbers (seeds repeat).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.request import Request
from engine.runner.request_state import CachedRequestState


@dataclass(slots=True)
class RowState:
    """One request's inputs to the processors, kept in its runner state
    (`CachedRequestState.sampler`) between steps.

    Attributes:
        history: int64 [num_prompt + max_tokens], host memory: prompt ids then generated ids;
            the first `filled` are set. Appended as tokens arrive (usually one per step), so a
            step never converts a whole token list.
        filled: entries of `history` that hold tokens.
        num_prompt: prompt length in tokens.
        bias_ids / bias_values: `logit_bias` as int64 / fp32 arrays [B].
        ban_ids: int64 [K] ids the `min_tokens` rule bans: EOS (unless `ignore_eos`) and
            `stop_token_ids`.
    """

    history: np.ndarray
    filled: int
    num_prompt: int
    bias_ids: np.ndarray
    bias_values: np.ndarray
    ban_ids: np.ndarray

    @classmethod
    def of(cls, req: Request, vocab: int, holder: CachedRequestState) -> "RowState":
        """The request's state, built on first use (prompt copied once) and brought up to date
        with the tokens generated since the last call.

        Raises:
            IndexError: a `logit_bias` or `stop_token_ids` id outside 0..vocab-1 (an entry there
                would land in another row's logits).
        """
        state = holder.sampler
        if not isinstance(state, RowState):
            s = req.sampling
            history = np.empty(req.num_prompt + req.max_tokens, dtype=np.int64)
            history[:req.num_prompt] = req.prompt_ids
            bias = np.array(s.logit_bias, dtype=np.float64).reshape(-1, 2)
            ban = [] if req.eos_token_id is None or s.ignore_eos else [req.eos_token_id]
            state = cls(history, req.num_prompt, req.num_prompt, bias[:, 0].astype(np.int64),
                        bias[:, 1].astype(np.float32),
                        np.array(ban + list(s.stop_token_ids), dtype=np.int64))
            for ids in (state.bias_ids, state.ban_ids):
                if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
                    raise IndexError(f"request {req.request_id}: token id outside the vocabulary "
                                     f"(0..{vocab - 1})")
            holder.sampler = state
        new = req.num_tokens - state.filled
        if new == 1:
            state.history[state.filled] = req.generated[-1]
        elif new > 0:
            state.history[state.filled:req.num_tokens] = req.generated[len(req.generated) - new:]
        state.filled = req.num_tokens
        return state

    @property
    def seen(self) -> np.ndarray:
        """int64 [prompt + generated] ids so far."""
        return self.history[:self.filled]

    @property
    def generated(self) -> np.ndarray:
        """int64 [generated] ids so far."""
        return self.history[self.num_prompt:self.filled]


def process_logits(logits: torch.Tensor, requests: Sequence[Request], copy: bool,
                   states: Sequence[CachedRequestState] | None = None) -> torch.Tensor:
    """Apply each row's penalties, bias and `min_tokens` ban.

    Args:
        logits: fp32 [R, vocab], row r belonging to `requests[r]`.
        requests: the R requests (a request may own several rows: n > 1 forks).
        copy: leave `logits` untouched and return a processed copy (the caller still needs the
            raw logits, for logprobs); otherwise rows are processed in place.
        states: each request's runner state (`CachedRequestState`, row r's at r), where the
            processors' `RowState` is kept between steps; None: fresh ones (built from the
            request's tokens, the same values, nothing kept).
    Returns:
        fp32 [R, vocab]: `logits` itself when no row has a processor on (or in-place), else the
        copy. Banned entries are -inf; nothing becomes NaN (a penalty scales or shifts finite
        values; -inf stays -inf).
    Raises:
        IndexError: a bias or banned id outside the vocabulary (the service checks ids first).
    """
    rows = [r for r, req in enumerate(requests) if req.sampling.processes_logits]
    if not rows:
        return logits
    out = logits.clone() if copy else logits
    flat = out.view(-1)
    vocab = out.shape[1]
    holders = states if states is not None else [CachedRequestState() for _ in requests]
    row_states = {r: RowState.of(requests[r], vocab, holders[r]) for r in rows}
    device = out.device

    def keys(arrays: list[np.ndarray], owners: list[int]) -> torch.Tensor:
        """Flat indices row * vocab + id of every id of `arrays[i]` in row `owners[i]`."""
        lengths = [len(a) for a in arrays]
        ids = np.concatenate(arrays) + np.repeat(np.asarray(owners, dtype=np.int64) * vocab, lengths)
        return torch.from_numpy(ids).to(device, non_blocking=True)

    def per_entry(values: list[float], arrays: list[np.ndarray]) -> torch.Tensor:
        """fp32 [sum of lengths]: values[i] repeated for each id of arrays[i]."""
        return torch.from_numpy(np.repeat(np.asarray(values, dtype=np.float32),
                                          [len(a) for a in arrays])).to(device, non_blocking=True)

    rep = [r for r in rows if requests[r].sampling.repetition_penalty != 1.0]
    if rep:
        # Duplicate indices write the same value (each is a function of the entry's own old
        # value), so the result does not depend on which write lands last.
        arrays = [row_states[r].seen for r in rep]
        index = keys(arrays, rep)
        penalty = per_entry([requests[r].sampling.repetition_penalty for r in rep], arrays)
        old = flat[index]
        flat[index] = torch.where(old > 0, old / penalty, old * penalty)
    freq = [r for r in rows if requests[r].sampling.frequency_penalty != 0.0
            or requests[r].sampling.presence_penalty != 0.0]
    freq = [r for r in freq if len(row_states[r].generated)]
    if freq:
        index, counts = torch.unique(keys([row_states[r].generated for r in freq], freq),
                                     return_counts=True)
        owner = torch.div(index, vocab, rounding_mode="floor")
        table = torch.zeros(out.shape[0], 2, dtype=out.dtype, device=device)
        table[freq] = torch.tensor([[requests[r].sampling.frequency_penalty,
                                     requests[r].sampling.presence_penalty] for r in freq],
                                   dtype=out.dtype, device=device)
        flat[index] -= table[owner, 0] * counts.to(out.dtype) + table[owner, 1]
    bias = [r for r in rows if len(row_states[r].bias_ids)]
    if bias:
        arrays = [row_states[r].bias_ids for r in bias]
        values = torch.from_numpy(np.concatenate([row_states[r].bias_values for r in bias]))
        flat[keys(arrays, bias)] += values.to(device)
    ban = [r for r in rows if len(requests[r].generated) < requests[r].sampling.min_tokens
           and len(row_states[r].ban_ids)]
    if ban:
        flat[keys([row_states[r].ban_ids for r in ban], ban)] = float("-inf")
    return out
