"""The batched inverse-CDF sampler: the distribution it draws from, and row independence."""

from __future__ import annotations

import math

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.core.request import SamplingParams
from engine.runner.sampler import greedy_ids, keep_top_p_, make_generator, sample


def draws(logits: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    g = make_generator(seed)
    out = [sample(logits[None], [p], [g])[0][0] for _ in range(n)]
    return torch.bincount(torch.tensor(out), minlength=logits.shape[-1]).float() / n


def test_frequencies_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    for temperature in (1.0, 0.5):
        want = torch.softmax(logits / temperature, -1)
        got = draws(logits, SamplingParams(temperature=temperature), 20_000)
        # 4.5 standard deviations of a binomial frequency
        tol = 4.5 * torch.sqrt(want * (1 - want) / 20_000) + 1e-9
        assert ((got - want).abs() <= tol).all(), (temperature, got, want)


def test_top_k_and_top_p_never_draw_outside_the_kept_set():
    logits = torch.tensor([3.0, 2.9, 1.0, 0.5, 0.0, -1.0])
    got = draws(logits, SamplingParams(temperature=1.0, top_k=2), 3_000)
    assert got[2:].sum() == 0 and got[0] > 0.3 and got[1] > 0.3
    probs = torch.softmax(logits, -1)             # top_p 0.5 keeps {0, 1}: 0.43 < 0.5 <= 0.84
    assert probs[0] < 0.5 < probs[0] + probs[1]
    got = draws(logits, SamplingParams(temperature=1.0, top_p=0.5), 3_000)
    assert got[2:].sum() == 0
    kept = probs[:2] / probs[:2].sum()
    assert math.isclose(got[0].item(), kept[0].item(), abs_tol=0.05)


def test_a_rows_draw_does_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    logits = torch.randn(8, 49152) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)
              for t, k, p in [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9),
                              (1.0, 0, 1.0), (0.2, 0, 1.0), (1.0, 5, 0.8), (2.0, 0, 1.0)]]
    together = sample(logits, params, [make_generator(100 + i) for i in range(8)])[0]
    alone = [sample(logits[i:i + 1], [params[i]], [make_generator(100 + i)])[0][0] for i in range(8)]
    assert together == alone
    assert together[1] == int(logits[1].argmax())


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_greedy_rows_pick_argmax_first_maximum_even_with_ties_nan_and_inf(kernel):
    """Greedy is torch.argmax's choice: the first of tied maxima, the first NaN, the first +inf,
    on torch's path and on genserve's kernel (`argmax_rows`) alike."""
    if kernel and not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here")
    logits = torch.randn(7, 49152)
    logits[0, [70, 9000, 40000]] = 50.0
    logits[1, [123, 456]] = float("nan")
    logits[2, [8, 30000]] = float("inf")
    logits[3] = logits[3].round()             # many ties at the maximum
    logits[4] = float("-inf")                 # nothing allowed (a grammar mask gone wrong): index 0
    logits[5, 49151] = 99.0                   # the last index
    logits[6, [0, 17]] = float("nan")         # NaN at the first index
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 7, [make_generator(i) for i in range(7)],
                    kernel=kernel)[0]
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    assert tokens == [70, 123, 8, tokens[3], 0, 49151, 0]
    assert logits[3, tokens[3]] == logits[3].max() and (logits[3, :tokens[3]] < logits[3].max()).all()
    assert greedy_ids(logits[5:6], kernel).tolist() == [49151]          # one row
    assert greedy_ids(logits[:0], kernel).shape == (0,)                 # no rows


def test_logprobs_only_for_rows_that_ask_and_they_are_log_softmax():
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
              SamplingParams(temperature=1.0)]
    tokens, logprobs, top = sample(logits, params, [make_generator(i) for i in range(3)])
    assert logprobs[0] is None and logprobs[2] is None and top[0] == [] and top[2] == []
    ref = torch.log_softmax(logits[1], -1)
    assert math.isclose(logprobs[1], ref[tokens[1]].item(), abs_tol=1e-5)
    assert [t for t, _ in top[1]] == ref.topk(2).indices.tolist()


def test_draws_across_chunks_follow_the_distribution():
    # mass spread over four tokens in three different 1,024-token chunks, the vocabulary not a
    # multiple of the chunk, the rest of the tokens nearly impossible
    logits = torch.full((3000,), -40.0)
    hot = torch.tensor([5, 1023, 1024, 2999])
    logits[hot] = torch.tensor([1.0, 0.0, 0.5, -0.5])
    want = torch.softmax(logits, -1)[hot]
    got = draws(logits, SamplingParams(temperature=1.0), 20_000, seed=7)[hot]
    tol = 4.5 * torch.sqrt(want * (1 - want) / 20_000)
    assert ((got - want).abs() <= tol).all(), (got, want)


def sorted_top_p(w: torch.Tensor, p: float) -> torch.Tensor:
    """The reference: sort the whole row, keep tokens while the mass before them is < p."""
    sorted_p, order = torch.sort(w, descending=True)
    out = w.clone()
    out[order[(torch.cumsum(sorted_p, dim=-1) - sorted_p) >= p]] = 0.0
    return out


def test_top_p_keeps_what_a_full_sort_keeps_for_peaked_and_flat_rows():
    """`keep_top_p_` looks at the top 256 tokens first and widens only when the nucleus is larger:
    rows from one token to ~20,000 tokens of nucleus, 1.5k-token rows and the whole 49k row."""
    torch.manual_seed(3)
    scales = [40.0, 8.0, 3.0, 1.0, 0.3, 0.05, 8.0, 0.0]      # 0.0: exactly flat (ties everywhere)
    w = torch.softmax(torch.randn(len(scales), 49152) * torch.tensor(scales)[:, None], dim=-1)
    ps = [0.9, 0.95, 0.5, 0.99, 0.9, 0.7, 0.0001, 0.9]
    rows = [0, 1, 2, 3, 4, 5, 6]                               # the flat row 7 is checked below
    got = w.clone()
    keep_top_p_(got, rows, [ps[r] for r in rows])
    sizes = []
    for r in rows:
        want = sorted_top_p(w[r], ps[r])
        assert torch.equal(got[r], want), r
        sizes.append(int((want > 0).sum()))
    assert sizes[0] == 1 and sizes[6] == 1 and max(sizes) > 2048   # both fast path and widening
    assert torch.equal(got[7], w[7])                                 # untouched rows stay
    flat = w[7:8].clone()
    keep_top_p_(flat, [0], [0.9])
    assert int((flat > 0).sum()) == int((sorted_top_p(w[7], 0.9) > 0).sum())   # ties: same count


def test_top_k_rows_with_different_k_in_one_step():
    torch.manual_seed(4)
    logits = torch.randn(4, 1000)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (1, 5, 5, 0)]
    for seed in range(20):
        tokens = sample(logits, params, [make_generator(seed * 10 + i) for i in range(4)])[0]
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] in logits[1].topk(5).indices.tolist()
        assert tokens[2] in logits[2].topk(5).indices.tolist()


def test_argmax_kernel_refuses_what_it_cannot_read():
    if not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here")
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        torch.ops.genserve.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        torch.ops.genserve.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="V must be positive"):
        torch.ops.genserve.argmax_rows(torch.zeros(2, 0))


def test_step_stages_are_profiler_ranges_only_while_a_profiler_runs():
    import contextlib

    from engine.runner.model_runner import stage
    assert isinstance(stage("genserve.sample"), contextlib.nullcontext)
    with torch.profiler.profile() as prof:
        with stage("genserve.sample"):
            torch.ones(4).sum()
    assert "genserve.sample" in {e.name for e in prof.events()}
