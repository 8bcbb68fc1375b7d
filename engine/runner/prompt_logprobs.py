"""Prompt logprobs: each prompt token's log-probability given the tokens before it, read from the
hidden states of the prefill piece that computes it anyway.

A prefill piece over prompt positions [start, end) produces one hidden state per position; the
state at position p predicts the token at p + 1, so the piece yields the logprobs of prompt
positions start + 1 .. min(end, num_prompt - 1). Only requests that ask
(`SamplingParams.prompt_logprobs`) pay for it: an output projection and a log-softmax over the
vocabulary per prompt token, in slices of `SLICE` rows so the fp32 [rows, vocab] block stays
small (256 × 49,152 × 4 B = 50 MB).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.outputs import PromptLogprobs
from engine.core.plan import StepPlan

SLICE = 256      # prompt positions per output-projection slice


def prompt_logprobs(plan: StepPlan, hidden: torch.Tensor,
                    project: Callable[[torch.Tensor], torch.Tensor]) -> tuple[PromptLogprobs, ...]:
    """The prompt logprobs of `plan`'s prefill pieces whose requests ask for them.

    Args:
        plan: the step's plan; segments in the order of `hidden`'s rows.
        hidden: [T, dim], the forward's output for every token of the step.
        project: the output projection, [P, dim] → fp32 [P, vocab].
    Returns:
        One `PromptLogprobs` per asking piece that covers a position >= 1 (the request has not
        sampled yet: after a preemption the prompt is computed again, its logprobs are not).
        Logprobs are floats >= -1e30 (finite), top alternatives most likely first.
    """
    out = []
    row = 0
    for seg in plan.segments:
        first = row
        row += seg.length
        req = seg.request
        k = req.sampling.prompt_logprobs
        if k is None or seg.decode or req.generated:
            continue
        # hidden row of position p predicts the prompt token at p + 1
        last = min(seg.end, req.num_prompt - 1)
        if last <= seg.start:
            continue
        positions = range(seg.start, last)
        logprobs: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        for lo in range(0, len(positions), SLICE):
            span = positions[lo:lo + SLICE]
            rows = hidden[first + lo:first + lo + len(span)]
            logits = project(rows)                                           # [S, vocab] fp32
            log_z = torch.logsumexp(logits, dim=-1)
            targets = torch.tensor([req.prompt_ids[p + 1] for p in span], dtype=torch.long,
                                   device=logits.device)
            chosen = logits.gather(1, targets[:, None])[:, 0] - log_z
            logprobs += [max(v, -1e30) for v in chosen.tolist()]
            if k:
                values, ids = torch.topk(logits, k, dim=-1)
                values = (values - log_z[:, None]).tolist()
                tops += [[(int(i), max(float(v), -1e30)) for i, v in zip(id_row, v_row)]
                         for id_row, v_row in zip(ids.tolist(), values)]
            else:
                tops += [[] for _ in span]
        out.append(PromptLogprobs(req.request_id, seg.start + 1, logprobs, tops))
    return tuple(out)
