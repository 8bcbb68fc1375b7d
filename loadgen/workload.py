"""Workloads: what to send and when (open loop).

A workload is a list of `WorkItem`s: an arrival offset in seconds from the start of the run, an
API key, a prompt (text, token ids, or nothing: synthetic ids made on demand), its length in
tokens and the number of output tokens to ask for (sent as `max_tokens` with `ignore_eos`, so the
answer has exactly that length).

Arrival processes (the design's load test: fixed arrival rates, never a fixed number of users,
because users that wait for their replies hide the queue):

* ``constant``: one request every ``1 / rate`` seconds, the first at t = 0.
* ``poisson``: exponential gaps with mean ``1 / rate`` (numpy ``default_rng(seed)``), the first
  arrival one gap after t = 0.

Both stop at ``duration_s`` (arrivals at t < duration_s) or after ``num_requests``, whichever
comes first.

Synthetic length mix (`LengthMix.design`), following docs/design.md: prompts of 50..8,000 tokens
with mean ≈ 1,250, answers of 1..1,000 tokens with mean ≈ 300, long-tailed. Each length is a
clipped lognormal, ``clip(rint(exp(mu + sigma * z)), lo, hi)`` with z ~ N(0, 1):

==========  =========  =======  ===========  ===========================  ====================
length      mu         sigma    median       clip range                   clipped mean
==========  =========  =======  ===========  ===========================  ====================
prompt      6.66       1.0      780 tokens   50..8,000 (1.0 % at 8,000)    ≈ 1,248 tokens
answer      5.38       0.9      217 tokens   1..1,000 (4.5 % at 1,000)     ≈ 300 tokens
==========  =========  =======  ===========  ===========================  ====================

(`clipped_lognormal_mean` computes the clipped means exactly; p95/p99 of the prompt are ≈ 4,050
and 8,000 tokens, of the answer ≈ 950 and 1,000.) The answer is then cut so that prompt + answer
stays within the 8,192-token context (``max_total``): about 0.6 % of design-scale requests lose
some answer tokens that way, which lowers the answer mean by about 1.5 tokens (to ≈ 299.5).

``LengthMix.design(scale)`` shrinks the mix for CPU runs: both medians are multiplied by
``scale`` (mu + ln scale) and the bounds become ``max(16, round(50 s))..round(8,000 s)`` for the
prompt (16 = one KV block) and ``1..round(1,000 s)`` for the answer. ``scale = 0.064`` gives
prompts of 16..512 tokens and answers of 1..64 tokens.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

DEFAULT_API_KEY = "loadgen"
MAX_CONTEXT = 8192            # prompt + max_tokens limit (docs/design.md)
MAX_REQUESTS = 1_000_000      # hard bound on one workload's size
# Synthetic prompt ids are drawn from this range: ordinary tokens in both the design's 32,000-token
# vocabulary and SmolLM2's 49,152 (away from the special tokens at the start).
SYNTHETIC_ID_RANGE = (1000, 30000)
CHARS_PER_TOKEN = 4           # estimate for a text prompt whose trace line has no prompt_tokens


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of a workload.

    Attributes:
        index: position in the workload (stable id: request ids derive from it).
        arrival_s: arrival offset from the start of the run, seconds.
        api_key: the caller's key (fair-queueing account).
        prompt_tokens: prompt length in tokens.
        output_tokens: tokens to generate (sent as max_tokens with ignore_eos).
        prompt: the prompt text or token ids; None means `synthetic_prompt_ids(...)`.
        disconnect_after: if set, the client disconnects after receiving this many tokens.
    """

    index: int
    arrival_s: float
    api_key: str
    prompt_tokens: int
    output_tokens: int
    prompt: str | tuple[int, ...] | None = None
    disconnect_after: int | None = None

    def prompt_ids(self, seed: int = 0) -> list[int]:
        """The prompt as token ids: the trace's ids, or deterministic synthetic ones.

        Raises ValueError for a text prompt (the server tokenizes text; send it as text).
        """
        if isinstance(self.prompt, str):
            raise ValueError("a text prompt has no token ids here; send it as text")
        if self.prompt is not None:
            return list(self.prompt)
        return synthetic_prompt_ids(self.index, self.prompt_tokens, seed)


def synthetic_prompt_ids(index: int, num_tokens: int, seed: int = 0) -> list[int]:
    """`num_tokens` token ids for item `index`, reproducible from (seed, index)."""
    rng = np.random.default_rng([seed, index])
    lo, hi = SYNTHETIC_ID_RANGE
    return rng.integers(lo, hi, size=num_tokens).tolist()


# -- arrival processes --------------------------------------------------------------------------
def arrival_times(rate: float, *, process: str = "poisson", duration_s: float | None = None,
                  num_requests: int | None = None, seed: int = 0) -> np.ndarray:
    """Arrival offsets in seconds of an open-loop process at `rate` requests per second.

    Args:
        rate: mean arrivals per second (> 0).
        process: "poisson" (exponential gaps, seeded) or "constant" (equal gaps, first at 0).
        duration_s: keep arrivals at t < duration_s.
        num_requests: keep at most this many arrivals.
        seed: seed of the Poisson process.
    Returns:
        A float64 array, non-decreasing.
    Raises:
        ValueError: bad rate or process, or neither bound given, or more than MAX_REQUESTS.
    """
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    if duration_s is None and num_requests is None:
        raise ValueError("give duration_s or num_requests (a run must be bounded)")
    limit = num_requests if num_requests is not None else math.ceil(duration_s * rate * 1.5 + 50)
    if duration_s is not None and process == "constant":
        limit = min(limit, math.ceil(duration_s * rate))
    if limit > MAX_REQUESTS:
        raise ValueError(f"{limit} requests is over the {MAX_REQUESTS} bound of one workload")
    if process == "constant":
        times = np.arange(limit, dtype=np.float64) / rate
    elif process == "poisson":
        rng = np.random.default_rng(seed)
        times = np.cumsum(rng.exponential(1.0 / rate, size=limit))
        while duration_s is not None and num_requests is None and times.size and times[-1] < duration_s:
            more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=limit))
            times = np.concatenate([times, more])          # rare: the 1.5x guess fell short
            if times.size > MAX_REQUESTS:
                raise ValueError(f"over the {MAX_REQUESTS} bound of one workload")
    else:
        raise ValueError(f"arrival process must be 'poisson' or 'constant', got {process!r}")
    if duration_s is not None:
        times = times[times < duration_s]
    return times


# -- length mix ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LengthMix:
    """Clipped-lognormal prompt and answer lengths (see the module docstring for the numbers).

    Attributes:
        prompt_mu / prompt_sigma: parameters of ln(prompt tokens) before clipping.
        prompt_min / prompt_max: clip range of the prompt, tokens.
        output_mu / output_sigma: parameters of ln(answer tokens) before clipping.
        output_min / output_max: clip range of the answer, tokens.
        max_total: prompt + answer is cut to this many tokens (the context limit).
    """

    prompt_mu: float = 6.66
    prompt_sigma: float = 1.0
    prompt_min: int = 50
    prompt_max: int = 8000
    output_mu: float = 5.38
    output_sigma: float = 0.9
    output_min: int = 1
    output_max: int = 1000
    max_total: int = MAX_CONTEXT

    @classmethod
    def design(cls, scale: float = 1.0) -> "LengthMix":
        """The reference mix of docs/design.md, with lengths multiplied by `scale` (0 < scale <= 1)."""
        if not 0 < scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {scale}")
        base = cls()
        shift = math.log(scale)
        prompt_min = max(16, round(base.prompt_min * scale))
        return replace(base, prompt_mu=base.prompt_mu + shift, output_mu=base.output_mu + shift,
                       prompt_min=prompt_min, prompt_max=max(prompt_min, round(base.prompt_max * scale)),
                       output_max=max(1, round(base.output_max * scale)))

    @property
    def prompt_mean(self) -> float:
        """Expected prompt tokens (clipped lognormal, before the max_total cut)."""
        return clipped_lognormal_mean(self.prompt_mu, self.prompt_sigma, self.prompt_min, self.prompt_max)

    @property
    def output_mean(self) -> float:
        """Expected answer tokens (clipped lognormal, before the max_total cut)."""
        return clipped_lognormal_mean(self.output_mu, self.output_sigma, self.output_min, self.output_max)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """`n` (prompt_tokens, output_tokens) pairs as two int64 arrays."""
        prompt = np.clip(np.rint(np.exp(self.prompt_mu + self.prompt_sigma * rng.standard_normal(n))),
                         self.prompt_min, self.prompt_max).astype(np.int64)
        output = np.clip(np.rint(np.exp(self.output_mu + self.output_sigma * rng.standard_normal(n))),
                         self.output_min, self.output_max).astype(np.int64)
        output = np.maximum(1, np.minimum(output, self.max_total - prompt))
        return prompt, output


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for ln X ~ N(mu, sigma²) (continuous; rounding to integers is ignored).

    = lo·P(X < lo) + hi·P(X > hi) + e^(mu + sigma²/2)·[Φ(b − sigma) − Φ(a − sigma)],
    with a = (ln lo − mu)/sigma and b = (ln hi − mu)/sigma.
    """
    phi = lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))  # noqa: E731
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    inner = math.exp(mu + sigma * sigma / 2.0) * (phi(b - sigma) - phi(a - sigma))
    return lo * phi(a) + hi * (1.0 - phi(b)) + inner


# -- building workloads -------------------------------------------------------------------------
def synthetic_workload(arrivals: Sequence[float], mix: LengthMix | None = None,
                       api_keys: Sequence[str] = (DEFAULT_API_KEY,), seed: int = 0) -> list[WorkItem]:
    """One item per arrival with lengths from `mix`; keys assigned round-robin."""
    if not api_keys:
        raise ValueError("at least one API key is needed")
    mix = mix or LengthMix.design()
    prompt, output = mix.sample(len(arrivals), np.random.default_rng([seed, 1]))
    return [WorkItem(i, float(t), api_keys[i % len(api_keys)], int(p), int(o))
            for i, (t, p, o) in enumerate(zip(arrivals, prompt, output))]


def retime(items: Sequence[WorkItem], arrivals: Sequence[float]) -> list[WorkItem]:
    """The trace's prompts and lengths at new arrival times (the trace is cycled if short)."""
    if not items:
        raise ValueError("the trace is empty")
    return [replace(items[i % len(items)], index=i, arrival_s=float(t)) for i, t in enumerate(arrivals)]


def with_disconnects(items: Sequence[WorkItem], fraction: float, seed: int = 0,
                     after_tokens: int | None = None) -> list[WorkItem]:
    """Mark a seeded random `fraction` of the items to disconnect mid-stream.

    A marked item disconnects after `after_tokens` tokens, or, when None, after half its answer
    (at least 1). Items whose answer is not longer than that are left alone (nothing to cut).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"disconnect fraction must be in [0, 1], got {fraction}")
    rng = np.random.default_rng([seed, 2])
    marks = rng.random(len(items)) < fraction
    out = []
    for item, mark in zip(items, marks):
        k = after_tokens if after_tokens is not None else max(1, item.output_tokens // 2)
        out.append(replace(item, disconnect_after=k if mark and k < item.output_tokens else None))
    return out


def load_trace(path: str | pathlib.Path, default_api_key: str = DEFAULT_API_KEY) -> list[WorkItem]:
    """Read a JSONL trace: one JSON object per line (blank lines and `#` comments skipped).

    Fields per line:
        arrival_s (float, optional, default 0): arrival offset from the start, seconds.
        api_key (str, optional): default `default_api_key`.
        prompt (str) or prompt_token_ids (list[int]) (optional): without either, synthetic ids.
        prompt_tokens (int): prompt length; optional with prompt_token_ids (their count) or with
            a text prompt (estimated as ceil(characters / 4)).
        output_tokens (int; `max_tokens` is accepted too): tokens to generate.
    Items are returned sorted by arrival time (stable).

    Raises:
        ValueError: naming the file and line of a malformed entry.
    """
    path = pathlib.Path(path)
    items: list[WorkItem] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            items.append(_parse_trace_line(json.loads(line), len(items), default_api_key))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from None
    items.sort(key=lambda it: it.arrival_s)
    return [replace(it, index=i) for i, it in enumerate(items)]


def _parse_trace_line(obj: dict, index: int, default_api_key: str) -> WorkItem:
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    prompt: str | tuple[int, ...] | None = None
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("prompt_token_ids must be a list of non-negative integers")
        prompt = tuple(ids)
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError("prompt must be a string (use prompt_token_ids for ids)")
        prompt = obj["prompt"]
    if "prompt_tokens" in obj:
        prompt_tokens = int(obj["prompt_tokens"])
    elif isinstance(prompt, tuple):
        prompt_tokens = len(prompt)
    elif isinstance(prompt, str):
        prompt_tokens = max(1, math.ceil(len(prompt) / CHARS_PER_TOKEN))
    else:
        raise ValueError("prompt_tokens is required when the line has no prompt")
    if "output_tokens" in obj:
        output_tokens = int(obj["output_tokens"])
    elif "max_tokens" in obj:
        output_tokens = int(obj["max_tokens"])
    else:
        raise ValueError("output_tokens (or max_tokens) is required")
    arrival_s = float(obj.get("arrival_s", 0.0))
    if prompt_tokens < 1 or output_tokens < 1 or not math.isfinite(arrival_s) or arrival_s < 0:
        raise ValueError("prompt_tokens and output_tokens must be >= 1 and arrival_s >= 0")
    return WorkItem(index, arrival_s, str(obj.get("api_key", default_api_key)), prompt_tokens,
                    output_tokens, prompt)


def save_trace(items: Iterable[WorkItem], path: str | pathlib.Path) -> None:
    """Write items as a JSONL trace that `load_trace` reads back (synthetic prompts stay lengths)."""
    with open(path, "w") as f:
        for it in items:
            row = {k: v for k, v in asdict(it).items() if k not in ("index", "prompt", "disconnect_after")}
            if isinstance(it.prompt, str):
                row["prompt"] = it.prompt
            elif it.prompt is not None:
                row["prompt_token_ids"] = list(it.prompt)
            f.write(json.dumps(row) + "\n")
