"""The sampling controls on the real model: each changes what it should and only that, and keeps
the sampler's guarantees (batch invariance, seeds, preemption, no NaN, no leaked blocks)."""

from __future__ import annotations

import math

import pytest

from tests.engine.conftest import check_preemption_keeps_tokens, generate, new_request
from tests.engine.model.test_model import mixed_prompts

REPETITIVE = "one two three one two three one two three one two three one two three one"


def repeats(tokens: list[int]) -> int:
    """Tokens that already appeared earlier in the list."""
    return len(tokens) - len(set(tokens))


@pytest.mark.slow
def test_presence_and_frequency_penalties_cut_repetition_and_zero_is_the_baseline(bf16_engine,
                                                                                  gguf_tokenizer):
    prompt = gguf_tokenizer.encode(REPETITIVE)
    base = generate(bf16_engine, [prompt], 24, temperature=0.0, ignore_eos=True)[0]
    zero = generate(bf16_engine, [prompt], 24, temperature=0.0, ignore_eos=True,
                    presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)[0]
    presence = generate(bf16_engine, [prompt], 24, temperature=0.0, ignore_eos=True,
                        presence_penalty=2.0)[0]
    frequency = generate(bf16_engine, [prompt], 24, temperature=0.0, ignore_eos=True,
                         frequency_penalty=2.0)[0]
    repetition = generate(bf16_engine, [prompt], 24, temperature=0.0, ignore_eos=True,
                          repetition_penalty=1.5)[0]
    assert zero == base
    assert repeats(base) >= 15, gguf_tokenizer.decode(base)       # the greedy loop repeats
    for penalized in (presence, frequency, repetition):
        assert repeats(penalized) < repeats(base) / 2, gguf_tokenizer.decode(penalized)
    # The repetition penalty also covers the prompt: its first token is not one of the prompt's
    # words (a presence penalty, over generated tokens only, cannot say that).
    assert repetition[0] not in set(prompt)


def test_logit_bias_removes_the_greedy_token_and_forces_another(bf16_engine, gguf_tokenizer):
    prompt = gguf_tokenizer.encode("The capital of France is")
    base = generate(bf16_engine, [prompt], 6, temperature=0.0, ignore_eos=True)[0]
    banned = generate(bf16_engine, [prompt], 6, temperature=0.0, ignore_eos=True,
                      logit_bias=((base[0], -100.0),))[0]
    assert base[0] not in banned and banned[0] != base[0]
    forced = gguf_tokenizer.encode(" zebra")[0]
    got = generate(bf16_engine, [prompt], 6, temperature=1.0, seed=3, ignore_eos=True,
                   logit_bias=((forced, 100.0),))[0]
    assert got == [forced] * 6


def test_min_tokens_holds_back_eos_and_stop_token_ids_end_a_sample(bf16_engine, gguf_tokenizer):
    prompt = gguf_tokenizer.encode("Once upon a time,")
    base = generate(bf16_engine, [prompt], 12, temperature=0.0, ignore_eos=True)[0]
    eos = base[2]                                 # make the third greedy token the model's EOS
    first_eos = base.index(eos)

    def run(**sampling) -> tuple[list[int], str]:
        events: list = []
        req = new_request(prompt, 12, events, eos_token_id=eos, temperature=0.0, **sampling)
        bf16_engine.submit(req)
        bf16_engine.run_until_idle()
        bf16_engine.pool.check_all_free()
        return req.generated, req.finish_reason.value

    assert run() == (base[:first_eos + 1], "stop")
    held, reason = run(min_tokens=8)
    assert len(held) >= 8 and eos not in held[:8], held
    assert held[:first_eos] == base[:first_eos]
    # stop_token_ids: the first greedy token that is not EOS ends the sample, unless min_tokens.
    stop_id = base[0]
    assert run(stop_token_ids=(stop_id,), ignore_eos=True) == ([stop_id], "stop")
    held, _ = run(stop_token_ids=(stop_id,), ignore_eos=True, min_tokens=5)
    assert len(held) >= 5 and stop_id not in held[:5]


def test_min_p_at_one_is_greedy_and_small_min_p_keeps_the_seeded_draw(bf16_engine, gguf_tokenizer):
    prompt = gguf_tokenizer.encode("List three colours:\n1.")
    greedy = generate(bf16_engine, [prompt], 10, temperature=0.0, ignore_eos=True)[0]
    # min_p 1 keeps only the most likely token (ties aside): a sampled row becomes greedy.
    assert generate(bf16_engine, [prompt], 10, temperature=1.0, seed=5, ignore_eos=True,
                    min_p=1.0)[0] == greedy
    a = generate(bf16_engine, [prompt], 10, temperature=1.0, seed=5, ignore_eos=True, min_p=0.1)[0]
    assert generate(bf16_engine, [prompt], 10, temperature=1.0, seed=5, ignore_eos=True,
                    min_p=0.1)[0] == a


MIXED = [dict(temperature=0.0), dict(temperature=0.0, presence_penalty=1.5),
         dict(temperature=0.0, frequency_penalty=0.8, logit_bias=((13, 5.0), (198, -100.0))),
         dict(temperature=0.0, repetition_penalty=1.3),
         dict(temperature=0.9, seed=11, presence_penalty=0.5, frequency_penalty=0.5),
         dict(temperature=0.7, seed=12, min_p=0.05, repetition_penalty=1.1),
         dict(temperature=1.0, seed=13, top_k=40, logit_bias=((30, 3.0),), min_tokens=6),
         dict(temperature=0.8, seed=14, top_p=0.9)]


@pytest.mark.slow
def test_a_batch_of_32_with_mixed_controls_gives_each_row_its_tokens_alone(bf16_engine,
                                                                            gguf_tokenizer):
    prompts = mixed_prompts(gguf_tokenizer)[:6]
    cases = [(prompts[i % len(prompts)], MIXED[i % len(MIXED)]) for i in range(32)]
    alone = [generate(bf16_engine, [p], 10, ignore_eos=True, **s)[0] for p, s in cases[:8]]
    reqs = [new_request(p, 10, ignore_eos=True, logprobs=True, **s) for p, s in cases]
    for r in reqs:
        bf16_engine.submit(r)
    bf16_engine.run_until_idle()
    bf16_engine.pool.check_all_free()
    assert [r.generated for r in reqs[:8]] == alone
    # Rows with equal prompt and settings agree wherever they sit in the batch (i and i + 24
    # share both: 24 is a multiple of the 6 prompts and the 8 settings).
    for i in range(8):
        assert reqs[i].generated == reqs[i + 24].generated
    assert len({tuple(r.generated) for r in reqs}) >= 8


@pytest.mark.slow
def test_penalized_rows_keep_their_tokens_through_preemption(bf16_engine, gguf_weights, gguf_tokenizer):
    settings = [dict(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5),
                dict(temperature=0.8, seed=5, repetition_penalty=1.2, logit_bias=((13, 2.0),)),
                dict(temperature=0.0, repetition_penalty=1.4, min_p=0.1)] * 2
    check_preemption_keeps_tokens(bf16_engine, gguf_weights, mixed_prompts(gguf_tokenizer)[:6],
                                  settings=settings)


def test_logprobs_stay_the_models_and_finite_under_every_control(bf16_engine, gguf_tokenizer):
    prompt = gguf_tokenizer.encode(REPETITIVE)
    events: list = []
    plain_events: list = []
    req = new_request(prompt, 8, events, temperature=0.0, logprobs=True, top_logprobs=3,
                      ignore_eos=True)
    penalized = new_request(prompt, 8, plain_events, temperature=0.0, logprobs=True, top_logprobs=3,
                            ignore_eos=True, repetition_penalty=3.0, presence_penalty=2.0,
                            logit_bias=((5, 100.0),))
    for r in (req, penalized):
        bf16_engine.submit(r)
    bf16_engine.run_until_idle()
    # The first token: both rows saw the same logits; the reported logprobs are the raw model's,
    # so the penalized row reports the same alternatives though it drew token 5.
    assert penalized.generated[0] == 5
    assert events[0].top_logprobs == plain_events[0].top_logprobs
    assert all(math.isfinite(e.logprob) for e in events + plain_events if e.logprob is not None)


def test_prompt_logprobs_match_the_logprobs_the_tokens_were_sampled_with(bf16_engine, gguf_tokenizer):
    """Greedy tokens G sampled after prompt P report logprobs; the prompt P + G with
    prompt_logprobs reports the same for G's positions (computed in its prefill), one entry per
    position from 1, over a prompt long enough to be prefilled in several pieces, and a cached
    prefix does not cut it short."""
    prompt = mixed_prompts(gguf_tokenizer)[-1][:700]
    events: list = []
    first = new_request(prompt, 6, events, temperature=0.0, logprobs=True, ignore_eos=True)
    bf16_engine.submit(first)
    bf16_engine.run_until_idle()
    sampled = [e.logprob for e in events if e.token_id is not None]
    full = prompt + first.generated
    events = []
    req = new_request(full, 1, events, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    bf16_engine.submit(req)
    bf16_engine.run_until_idle()
    bf16_engine.pool.check_all_free()
    prompt_events = [e for e in events if e.prompt_logprobs is not None]
    assert len(prompt_events) == 1 and events.index(prompt_events[0]) == 0
    entries = prompt_events[0].prompt_logprobs
    assert len(entries) == len(full) - 1
    bad = [(i, lp, len(top)) for i, (lp, top) in enumerate(entries)
           if not (math.isfinite(lp) and lp <= 0 and len(top) == 2)]
    assert not bad, (bad[:5], len(bad))
    tail = [lp for lp, _ in entries[len(prompt) - 1:]]
    assert tail == pytest.approx(sampled, abs=0.05)
    # the greedy token is the top alternative where the continuation was greedy
    assert [top[0][0] for _, top in entries[len(prompt) - 1:]] == first.generated
