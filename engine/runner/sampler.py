"""Per-row sampling: temperature, top-k, top-p, min-p, one seeded generator per request.

Runs on the logits' device; each request's generator must live there too (`make_generator`).
The sampled ids come back in one device-to-host copy per step (plus the logprobs, for rows that
ask, and top-p's flags); with `split` given, choosing the greedy and the drawn rows copies
nothing to the device.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from engine.core.request import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `seed`, or with 63 random bits when None.

    The same seed draws different numbers on the CPU and on CUDA (different generators: CPU's
    Mersenne Twister, CUDA's Philox); on one device a seed always repeats its stream."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def greedy_split(params: Sequence[SamplingParams]) -> tuple[list[int], list[int]]:
    """The rows of `params` sampled greedily (temperature 0) and those drawn, each in order."""
    greedy = [row for row, p in enumerate(params) if p.temperature == 0.0]
    return greedy, [row for row, p in enumerate(params) if p.temperature != 0.0]


def greedy_ids(logits: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """Each row's greedy token: the first index of its maximum, NaN counting as the maximum.

    Args:
        logits: fp32 [R, vocab].
        kernel: run genserve's CPU kernel (`torch.ops.genserve.argmax_rows`, engine/kernels/csrc/
            greedy.cpp; only once `engine.kernels.available()` returned True); else `torch.max`.
    Returns:
        int64 [R] on the logits' device; both ways give the same indices.
    """
    if kernel and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.ops.genserve.argmax_rows(logits.contiguous())
    # torch.max's indices are argmax's (the first maximum; NaN counts as the maximum) in
    # 0.4-0.7x the time on CPU, whose argmax over the last dimension is a scalar loop.
    return torch.max(logits, dim=-1).indices


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator], raw_logits: torch.Tensor | None = None,
           split: tuple[torch.Tensor, torch.Tensor] | None = None, kernel: bool = False
           ) -> tuple[list[int], list[float | None], list[list[tuple[int, float]]]]:
    """Draw one token per row.

    Args:
        logits: fp32 [R, vocab], the logits to draw from: the model's output for the rows that
            sample, after the logits processors (`engine.runner.logits_processors`).
        params: R sampling settings; temperature 0 means greedy (argmax), top_k <= 0 means off,
            top_p 1 means off.
        generators: R per-request generators on the logits' device (only consumed by rows with temperature > 0, one
            uniform draw per token each, so a request's stream of random numbers does not depend
            on its neighbours).
        raw_logits: fp32 [R, vocab], the model's output before the processors, for the
            logprobs; None when they are `logits` (no processor ran, or in place with no row
            asking for logprobs).
        split: `greedy_split(params)` as two int64 tensors on the logits' device (the caller's
            upload); None: the rows are selected with host lists, which on a GPU copies each
            list to the device first.
        kernel: greedy rows' argmax on genserve's CPU kernel (`greedy_ids`).
    Returns:
        (next_token [R] ints, logprob [R] floats or None, top [R] lists of (token id, logprob)).
        The logprobs are under the model's raw distribution, log_softmax(raw_logits), before
        the processors, temperature, top-k, top-p and min-p (vLLM's default, "raw_logprobs"); always finite; None for rows whose
        `params[r].logprobs` is False (no log-softmax is computed when no row asks, ≈ 1 ms of
        a 32-row step on 2 CPU cores). `top[r]` holds the `params[r].top_logprobs` most likely
        tokens, most likely first.

    Sampling is by inverse CDF, batched over the rows, in two levels so no full-vocabulary scan
    runs: w = softmax(logits / T) with the top-k / top-p tails set to 0 (rows that ask only),
    the vocabulary cut into chunks of `CHUNK` tokens; u ~ U[0, 1) from the row's own generator
    picks the chunk by the cumulative chunk sums, the remainder of u (as a fraction of that
    chunk's mass) picks the token by the cumulative sum inside the chunk (`torch.searchsorted`,
    right side: a zero-weight chunk or token is never drawn, no renormalising needed). Every
    operation works row by row, so a row's draw does not depend on the other rows. On 2 CPU
    cores a 32-row draw over 49,152 tokens takes ≈ 0.5 ms (≈ 7 ms with a full-vocabulary
    cumsum); with top_p 0.9 on SmolLM2's logits ≈ 3.5 ms (`keep_top_p_`; 100 ms with a sort).
    """
    tokens = [0] * len(params)
    greedy, rows = greedy_split(params)
    greedy_index, drawn_index = split if split is not None else (None, None)
    ids: list[torch.Tensor] = []           # int64 on the device: greedy rows' ids, then drawn rows'
    if greedy:
        sub = logits if len(greedy) == len(params) else _select(logits, greedy, greedy_index)
        ids.append(greedy_ids(sub, kernel))
    if rows:
        ids.append(_draw(logits, params, generators, rows, drawn_index))
    if ids:
        # the step's one copy of sampled ids back to the host
        for row, token in zip(greedy + rows, (ids[0] if len(ids) == 1 else torch.cat(ids)).tolist()):
            tokens[row] = token
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    asked = [row for row, p in enumerate(params) if p.logprobs]
    if not asked:
        return tokens, [None] * len(tokens), top
    device = logits.device
    index = torch.tensor(asked, dtype=torch.long, device=device)
    sub = (logits if raw_logits is None else raw_logits)[index]                                              # [A, vocab]
    log_z = torch.logsumexp(sub, dim=-1)                             # [A]
    chosen = torch.tensor([tokens[row] for row in asked], dtype=torch.long, device=device)
    lp = (sub[torch.arange(len(asked), device=device), chosen] - log_z).tolist()
    logprobs: list[float | None] = [None] * len(tokens)
    for row, value in zip(asked, lp):
        logprobs[row] = max(value, -1e30)
    k_max = max((params[row].top_logprobs for row in asked), default=0)
    if k_max:
        values, ids = torch.topk(sub, k_max, dim=-1)
        values = (values - log_z[:, None]).tolist()                  # one copy to the host
        ids = ids.tolist()
        for j, row in enumerate(asked):
            k = params[row].top_logprobs
            top[row] = [(int(i), max(float(v), -1e30)) for i, v in zip(ids[j][:k], values[j][:k])]
    return tokens, logprobs, top


CHUNK = 1024     # tokens per first-level chunk of the two-level inverse CDF
# Tokens the first top-p pass looks at (`keep_top_p_`); an LLM's nucleus is almost always smaller.
TOP_P_FIRST_K = 256


def keep_top_p_(w: torch.Tensor, rows: list[int], top_ps: list[float]) -> None:
    """Top-p (nucleus, Holtzman et al. 2019) in place: in each of `rows` of `w` (fp32 [S, vocab],
    probabilities), keep the most likely tokens while the mass before them is < top_p; zero the
    rest.

    The same kept set as sorting the whole row (the first token always stays), without the sort:
    a descending sort of 49,152 probabilities took ≈ 3 ms a row on 2 CPU cores — 100 ms for a
    32-row step with top_p set, the common client default. Here the rows' `TOP_P_FIRST_K` most
    likely tokens come from one batched `torch.topk` (sorted), the running mass is summed over
    them in the same order a sorted row would be, and only a row whose nucleus is larger than
    that (a nearly flat distribution) takes k 8× larger, then the full sort.
    """
    vocab = w.shape[-1]
    k = min(TOP_P_FIRST_K, vocab)
    pending = list(range(len(rows)))
    while pending:
        sub_rows = [rows[j] for j in pending]
        p = torch.tensor([top_ps[j] for j in pending], dtype=w.dtype, device=w.device)[:, None]
        values, ids = torch.topk(w[sub_rows], k, dim=-1)                      # [P, k], sorted
        before = values.cumsum(dim=-1) - values                               # mass before each
        done = (before[:, -1:] >= p)[:, 0] | (k == vocab)     # the nucleus ends inside the top k
        kept = torch.zeros(len(pending), vocab, dtype=w.dtype, device=w.device)
        kept.scatter_(1, ids, torch.where(before < p, values, 0.0))
        done_rows = done.tolist()                                             # one copy per pass
        finished = [j for j, d in enumerate(done_rows) if d]
        if finished:
            w[[sub_rows[j] for j in finished]] = kept[finished]
        pending = [pending[j] for j in range(len(pending)) if not done_rows[j]]
        k = min(8 * k, vocab)


def _select(x: torch.Tensor, rows: list[int], index: torch.Tensor | None) -> torch.Tensor:
    """x[rows] ([len(rows), ...]), read through `index` (the same rows, int64 on x's device)
    when given, so no list is copied to the device."""
    return x[rows] if index is None else x.index_select(0, index)


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams],
          generators: Sequence[torch.Generator], rows: list[int],
          index: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF draws for the sampling `rows` of `logits` [R, vocab] (see `sample`), read
    through `index` when given (`_select`). Returns the ids, int64 [len(rows)] on the device."""
    x = logits if len(rows) == logits.shape[0] else _select(logits, rows, index)   # [S, vocab]
    temps = [max(params[r].temperature, 1e-6) for r in rows]
    if any(t != 1.0 for t in temps):
        x = x / torch.tensor(temps, dtype=x.dtype, device=x.device)[:, None]
    vocab = x.shape[-1]
    by_k: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if 0 < params[r].top_k < vocab:
            by_k.setdefault(params[r].top_k, []).append(i)
    if by_k:
        x = x.clone() if x is logits else x
        for k, same_k in by_k.items():              # one batched topk per distinct k
            sub = x[same_k]
            kth = torch.topk(sub, k, dim=-1).values[:, -1:]
            x[same_k] = sub.masked_fill_(sub < kth, float("-inf"))
    w = torch.softmax(x, dim=-1)                                                # [S, vocab]
    min_p = [(i, params[r].min_p) for i, r in enumerate(rows) if params[r].min_p > 0.0]
    if min_p:
        # Min-p (Nguyen et al. 2024, "Turning Up the Heat"): drop tokens below min_p times the
        # row's most likely token's probability, after temperature (vLLM's order).
        at = [i for i, _ in min_p]
        sub = w[at]
        floor = torch.tensor([p for _, p in min_p], dtype=w.dtype, device=w.device)[:, None]
        w[at] = sub.masked_fill_(sub < floor * sub.amax(dim=-1, keepdim=True), 0.0)
    top_p = [(i, params[r].top_p) for i, r in enumerate(rows) if params[r].top_p < 1.0]
    if top_p:
        keep_top_p_(w, [i for i, _ in top_p], [p for _, p in top_p])
    pad = -vocab % CHUNK
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    chunks = w.view(w.shape[0], -1, CHUNK)                                      # [S, C, CHUNK]
    mass = chunks.sum(dim=-1)                                                   # [S, C]
    cum = mass.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=generators[r], dtype=w.dtype, device=w.device)
                   for r in rows])
    target = u * cum[:, -1]
    c = torch.searchsorted(cum, target[:, None], right=True)[:, 0].clamp_(max=cum.shape[1] - 1)
    before = torch.where(c > 0, cum.gather(1, (c - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    frac = ((target - before) / mass.gather(1, c[:, None])[:, 0]).clamp_(0.0, 1.0 - 2.0 ** -24)
    inner = chunks[torch.arange(len(rows), device=w.device), c].cumsum(dim=-1)                   # [S, CHUNK]
    j = torch.searchsorted(inner, (frac * inner[:, -1])[:, None], right=True)[:, 0]
    return c * CHUNK + j.clamp_(max=CHUNK - 1)
