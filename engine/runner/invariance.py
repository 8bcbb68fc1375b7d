"""Batch invariance at temperature 0, on whatever device the engine runs: a request's greedy
tokens alone must equal its tokens inside a batch of mixed-length requests.

`check_batch_invariance` is what the tests and the GPU check call; it needs no pytest and no
tokenizer (prompts are token ids drawn from a seeded generator), so it runs on a
random-initialised model too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams

# Prompt lengths of the batch, cycled: short chat turns to a chunked prefill (> 2 pieces of 256).
PROMPT_LENGTHS = (5, 17, 64, 100, 250, 333, 600, 31)


@dataclass(frozen=True, slots=True)
class InvarianceResult:
    """Outcome of `check_batch_invariance`.

    Attributes:
        identical: every checked request produced the same tokens alone and in the batch.
        batch: requests in the batch; checked: how many of them were also run alone.
        mismatched: indices (into the batch) of the checked requests whose tokens differ.
        first_difference: per mismatched request, the index of its first differing token.
        distinct: distinct token sequences among the checked requests alone (a model that
            emits one token for everything would pass trivially; this shows it did not).
    """

    identical: bool
    batch: int
    checked: int
    mismatched: list[int]
    first_difference: list[int]
    distinct: int


def invariance_prompts(batch: int, vocab_size: int, seed: int = 0,
                       lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """`batch` prompts of token ids in [10, vocab_size), lengths cycling through `lengths`,
    drawn from a CPU generator seeded with `seed` (the same prompts on every machine)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab_size, (n,), generator=g).tolist()
            for n in itertools.islice(itertools.cycle(lengths), batch)]


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    reqs = [Request(f"invariance-{tag}-{i}", "invariance", list(p), max_tokens,
                    SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0)
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    engine.run_until_idle()
    engine.scheduler.queue.forget_key("invariance")
    return [list(r.generated) for r in reqs]


def check_batch_invariance(engine: Engine, batch: int = 32, max_tokens: int = 16,
                           checked: int = 4, seed: int = 0,
                           prompts: list[list[int]] | None = None,
                           vocab_size: int | None = None) -> InvarianceResult:
    """Greedy tokens of `checked` requests run alone against the same requests in one batch.

    Args:
        engine: a stopped engine (stepped here with `run_until_idle`); its pool must hold the
            batch or the scheduler preempts, which still must not change tokens.
        batch: requests submitted together (mixed lengths, `invariance_prompts`).
        max_tokens: tokens generated per request (EOS ignored).
        checked: how many of the batch (evenly spread over it) are also run alone, one at a time.
        seed: prompt seed; prompts: use these instead (then `batch` is their number).
        vocab_size: prompt ids are drawn below it; None: the executor's model's vocabulary
            (`engine.runner.model_runner.model.args`), or 1,000 when the executor has no `model`.
    Returns:
        InvarianceResult.
    Raises:
        ValueError: `checked` is not in 1..batch.
    """
    if vocab_size is None:
        model = getattr(engine.executor, "model", None)
        vocab_size = model.args.vocab_size if model is not None else 1000
    prompts = prompts if prompts is not None else invariance_prompts(batch, vocab_size, seed)
    batch = len(prompts)
    if not 1 <= checked <= batch:
        raise ValueError(f"checked must be in 1..{batch}, got {checked}")
    picks = sorted({round(i * (batch - 1) / max(checked - 1, 1)) for i in range(checked)})
    together = _run(engine, prompts, max_tokens, "batch")
    alone = {i: _run(engine, [prompts[i]], max_tokens, f"alone{i}")[0] for i in picks}
    mismatched = [i for i in picks if alone[i] != together[i]]
    first = [next((j for j, (a, b) in enumerate(zip(alone[i], together[i])) if a != b),
                  min(len(alone[i]), len(together[i]))) for i in mismatched]
    return InvarianceResult(not mismatched, batch, len(picks), mismatched, first,
                            len({tuple(t) for t in alone.values()}))
