"""The batched inverse-CDF sampler: the distribution it draws from, and row independence."""

from __future__ import annotations

import math

import torch

from engine.request import SamplingParams
from engine.sampler import make_generator, sample


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
