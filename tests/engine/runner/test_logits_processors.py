"""The logits processors against a dense reference written from the definitions, row by row."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from engine.core.request import Request, SamplingParams
from engine.runner.logits_processors import process_logits
from engine.runner.sampler import make_generator, sample

VOCAB = 1000
EOS = 2


def request(prompt: list[int], generated: list[int], **sampling) -> Request:
    req = Request(f"r{id(prompt)}", "", prompt, 64, SamplingParams(**sampling), 0.0, 0.0,
                  eos_token_id=EOS)
    req.generated = list(generated)
    return req


def reference(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The definitions, one token at a time (Hugging Face's repetition penalty, OpenAI's
    frequency/presence penalties, additive bias, the min_tokens ban)."""
    x = logits.clone()
    s = req.sampling
    for t in set(req.prompt_ids) | set(req.generated):
        x[t] = x[t] / s.repetition_penalty if x[t] > 0 else x[t] * s.repetition_penalty
    for t, c in collections.Counter(req.generated).items():
        x[t] -= c * s.frequency_penalty + (s.presence_penalty if c else 0.0)
    for t, b in s.logit_bias:
        x[t] += b
    if len(req.generated) < s.min_tokens:
        for t in ([] if s.ignore_eos else [EOS]) + list(s.stop_token_ids):
            x[t] = float("-inf")
    return x


def test_each_processor_matches_its_definition_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB) * 4
    prompt = [5, 6, 7, 5, 900]
    reqs = [
        request(prompt, [7, 7, 8], repetition_penalty=1.3),
        request(prompt, [7, 7, 8, 8, 8, 11], frequency_penalty=0.7),
        request(prompt, [7, 7, 8], presence_penalty=-1.5),
        request(prompt, [9], logit_bias=((3, -100.0), (40, 5.5), (999, 100.0))),
        request(prompt, [9], min_tokens=3, stop_token_ids=(17,)),
        request(prompt, [7, 7, 8, 3], repetition_penalty=0.8, frequency_penalty=0.5,
                presence_penalty=0.25, logit_bias=((7, 2.0),), min_tokens=9, stop_token_ids=(4,)),
    ]
    got = process_logits(logits, reqs, copy=True)
    for r, req in enumerate(reqs):
        torch.testing.assert_close(got[r], reference(logits[r], req), rtol=0, atol=1e-5)
    assert got is not logits and not torch.isnan(got).any()


def test_neutral_settings_leave_the_logits_untouched():
    logits = torch.randn(3, VOCAB)
    reqs = [request([1, 2], [3, 3]) for _ in range(3)]
    assert process_logits(logits, reqs, copy=False) is logits
    # min_tokens reached: nothing is banned any more
    done = request([1, 2], [3, 4, 5], min_tokens=3)
    before = logits.clone()
    process_logits(logits[:1], [done], copy=False)
    assert torch.equal(logits, before)


def test_a_rows_processed_logits_do_not_depend_on_its_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(32, 49152) * 3
    reqs = [request(list(range(i, i + 40)), [i % 7] * (i % 5) + [i + 100],
                    repetition_penalty=1.0 + i / 40, frequency_penalty=(i % 3) / 2,
                    presence_penalty=(i % 4) / 3, logit_bias=((i, 10.0),), min_tokens=i % 3)
            for i in range(32)]
    together = process_logits(logits, reqs, copy=True)
    for r in range(32):
        alone = process_logits(logits[r:r + 1], [request(reqs[r].prompt_ids, reqs[r].generated,
                                                         **_settings(reqs[r].sampling))], copy=True)
        assert torch.equal(together[r], alone[0]), r


def _settings(s: SamplingParams) -> dict:
    return {k: getattr(s, k) for k in ("repetition_penalty", "frequency_penalty", "presence_penalty",
                                       "logit_bias", "min_tokens")}


def test_the_history_follows_generated_tokens_across_steps():
    logits = torch.zeros(1, VOCAB)
    req = request([1], [], frequency_penalty=1.0)
    for step, token in enumerate([5, 5, 6]):
        out = process_logits(logits, [req], copy=True)
        assert out[0, 5].item() == -float([5, 5, 6][:step].count(5))
        req.generated.append(token)
    req.generated += [6, 6, 6]          # several at once (a preempted request resumes)
    assert process_logits(logits, [req], copy=True)[0, 6].item() == -4.0


def test_an_id_outside_the_vocabulary_is_refused_not_written_into_another_row():
    with pytest.raises(IndexError, match="vocabulary"):
        process_logits(torch.zeros(2, VOCAB), [request([1], [], logit_bias=((VOCAB, 1.0),)),
                                               request([1], [])], copy=False)


def test_min_p_drops_tokens_below_its_share_of_the_top_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = SamplingParams(temperature=1.0, min_p=0.2)       # floor 0.1: token 3 goes
    g = make_generator(0)
    seen = collections.Counter(sample(logits, [p], [g])[0][0] for _ in range(3000))
    assert seen[3] == 0 and set(seen) == {0, 1, 2}
    assert math.isclose(seen[2] / 3000, 0.12 / 0.92, abs_tol=0.03)


def test_logprobs_are_of_the_raw_logits_when_processors_ran():
    logits = torch.log_softmax(torch.randn(2, VOCAB), -1)
    reqs = [request([1], [], temperature=0.0, logprobs=True, logit_bias=((10, 100.0),)),
            request([1], [], temperature=0.0, logprobs=True)]
    processed = process_logits(logits, reqs, copy=True)
    tokens, lps, _ = sample(processed, [r.sampling for r in reqs],
                            [make_generator(0), make_generator(1)], raw_logits=logits)
    assert tokens[0] == 10
    assert math.isclose(lps[0], logits[0, 10].item(), rel_tol=1e-5)
    assert tokens[1] == int(logits[1].argmax())
