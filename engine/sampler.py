"""Per-row sampling: temperature, top-k, top-p, one seeded generator per request."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from engine.request import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU `torch.Generator` seeded with `seed`, or with 63 random bits when None."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator]
           ) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Draw one token per row.

    Args:
        logits: fp32 [R, vocab], the model's raw output for the rows that sample.
        params: R sampling settings; temperature 0 means greedy (argmax), top_k <= 0 means off,
            top_p 1 means off.
        generators: R per-request generators (only consumed by rows with temperature > 0, one
            draw of `vocab` exponentials each, so a request's stream of random numbers does not
            depend on its neighbours).
    Returns:
        (next_token [R] ints, logprob [R] floats, top [R] lists of (token id, logprob)). The
        logprobs are under the model's raw distribution, log_softmax(logits), before
        temperature, top-k and top-p (vLLM's default); always finite. `top[r]` holds the
        `params[r].top_logprobs` most likely tokens, most likely first.

    Sampling uses the exponential-race form of the categorical draw, argmax(p / E) with
    E ~ Exp(1) i.i.d. (equivalent to sampling from p; used by vLLM's sampler).
    """
    greedy = torch.argmax(logits, dim=-1).tolist()                   # [R], one batched call
    tokens: list[int] = []
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.temperature == 0.0:
            tokens.append(greedy[row])
            continue
        scaled = logits[row] / max(p.temperature, 1e-6)
        if 0 < p.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= p.top_p   # keeps the first
            probs = probs.index_put((order[drop],), torch.zeros(()))
        noise = torch.empty_like(probs).exponential_(generator=g)
        tokens.append(int(torch.argmax(probs / noise)))
    log_z = torch.logsumexp(logits, dim=-1)                          # [R]
    lp = logits[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] - log_z
    k_max = max((p.top_logprobs for p in params), default=0)
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    if k_max:
        values, ids = torch.topk(logits, k_max, dim=-1)
        values = values - log_z[:, None]
        for row, p in enumerate(params):
            top[row] = [(int(i), max(float(v), -1e30))
                        for i, v in zip(ids[row, :p.top_logprobs], values[row, :p.top_logprobs])]
    return tokens, [max(float(x), -1e30) for x in lp], top
