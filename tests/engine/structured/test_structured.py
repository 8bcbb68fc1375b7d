"""Constrained decoding in the engine (engine/structured): compile once, masks per row, and every
guarantee of the sampler kept for constrained rows — batch invariance at temperature 0, seeded
repeatability, identical tokens after preemption, one matcher per sample, max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.core.outputs import FinishReason
from engine.runner.builder import engine_from_weights
from engine.structured import masks
from engine.structured.compiler import GrammarCompiler
from engine.structured.masks import RowMatcher
from engine.structured.spec import ConstraintError, ConstraintSpec
from tests.engine.conftest import new_request

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "address", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(gguf_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(gguf_tokenizer)


@pytest.fixture(scope="module")
def prompt(gguf_tokenizer) -> list[int]:
    return gguf_tokenizer.encode("<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n"
                                 "<|im_start|>assistant\n")


def test_a_schema_compiles_once_whatever_its_formatting(compiler):
    first = compiler.compile(ConstraintSpec.json_schema(PERSON))
    misses = compiler.stats.misses
    again = compiler.compile(ConstraintSpec.json_schema(json.dumps(PERSON, indent=4)))
    assert again is first and compiler.stats.misses == misses and compiler.stats.hits >= 1
    assert compiler.cached(ConstraintSpec.json_schema(PERSON))


@pytest.mark.parametrize(("spec", "reason"), [
    (ConstraintSpec.json_schema({"type": "frobnicate"}, field="response_format.json_schema.schema"),
     "frobnicate"),
    (ConstraintSpec("regex", "[a-", field="regex"), "unclosed character class"),
    (ConstraintSpec("grammar", "start: nothing_defined", field="grammar"), "nothing_defined"),
])
def test_a_constraint_that_does_not_compile_names_its_field_and_why(compiler, spec, reason):
    with pytest.raises(ConstraintError) as err:
        compiler.compile(spec)
    assert err.value.field == spec.field and reason in err.value.reason
    assert not compiler.cached(spec)


def test_the_cache_is_bounded(gguf_tokenizer):
    small = GrammarCompiler(gguf_tokenizer, capacity=2)
    specs = [ConstraintSpec.choices([f"option {i}"]) for i in range(3)]
    for spec in specs:
        small.compile(spec)
    assert [small.cached(s) for s in specs] == [False, True, True]


def _run(engine, requests):
    for r in requests:
        engine.submit(r)
    engine.run_until_idle()
    engine.pool.check_all_free()
    return [list(r.generated) for r in requests]


def _constrained(prompt, grammar, max_tokens=80, **sampling):
    return new_request(prompt, max_tokens, constraint=grammar, **sampling)


@pytest.mark.slow
def test_constrained_rows_are_valid_and_batch_invariant_beside_31_others(bf16_engine, compiler, prompt,
                                                                         gguf_tokenizer):
    grammar = compiler.compile(ConstraintSpec.json_schema(PERSON))
    settings = [dict(temperature=0.0), dict(temperature=1.0, seed=7)]
    alone = [_run(bf16_engine, [_constrained(prompt, grammar, **s)])[0] for s in settings]
    batch = []
    for i in range(32):
        s = settings[i % 2] if i % 2 == 0 or i < 16 else dict(temperature=1.0, seed=1000 + i)
        batch.append(_constrained(prompt, grammar, **s) if i < 16 else new_request(prompt, 40, **s))
    out = _run(bf16_engine, batch)
    for i in range(16):
        assert out[i] == alone[i % 2], i
        assert batch[i].finish_reason is FinishReason.STOP
        text = gguf_tokenizer.decode(out[i][:-1])           # the last token is end-of-sequence
        jsonschema.validate(json.loads(text), PERSON)
        assert out[i][-1] == gguf_tokenizer.eos_token_id


def test_preemption_and_samples_keep_their_tokens(bf16_engine, gguf_weights, compiler, prompt,
                                                  gguf_tokenizer, monkeypatch):
    grammar = compiler.compile(ConstraintSpec.json_schema(PERSON))
    settings = [dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=0.8, seed=5)] * 2
    full = _run(bf16_engine, [_constrained(prompt, grammar, **s) for s in settings])
    args, state = gguf_weights
    small = engine_from_weights(EngineConfig(num_blocks=18, free_margin=0.0, dtype="bfloat16"), args, state)
    shrunk = _run(small, [_constrained(prompt, grammar, **s) for s in settings])
    assert small.scheduler.num_preemptions > 0
    assert shrunk == full
    parent = _constrained(prompt, grammar, temperature=1.0, seed=11)
    parent.fork(4, [11, 12, 13, 14])
    matchers = []
    monkeypatch.setattr(masks, "RowMatcher", lambda compiled: matchers.append(RowMatcher(compiled)) or matchers[-1])
    _run(bf16_engine, [parent])
    samples = [parent, *parent.children]
    texts = {gguf_tokenizer.decode(r.generated[:-1]) for r in samples}
    assert len(texts) > 1                                   # each sample drew on its own
    assert len(matchers) == 4                                        # one matcher per sample
    for r in samples:
        jsonschema.validate(json.loads(gguf_tokenizer.decode(r.generated[:-1])), PERSON)


def test_max_tokens_cuts_the_grammar_with_length(bf16_engine, compiler, prompt, gguf_tokenizer):
    grammar = compiler.compile(ConstraintSpec.json_schema(PERSON))
    req = _constrained(prompt, grammar, max_tokens=5, temperature=0.0)
    _run(bf16_engine, [req])
    assert req.finish_reason is FinishReason.LENGTH and len(req.generated) == 5
    assert gguf_tokenizer.decode(req.generated).startswith('{"name":"')


def test_regex_and_choice(bf16_engine, compiler, prompt, gguf_tokenizer):
    regex = compiler.compile(ConstraintSpec("regex", r"[0-9]{3}-[a-z]{2,4}"))
    choice = compiler.compile(ConstraintSpec.choices(["sunny", "rainy day", "snow"]))
    reqs = [_constrained(prompt, regex, temperature=1.0, seed=i) for i in range(4)]
    reqs += [_constrained(prompt, choice, temperature=1.0, seed=i) for i in range(4)]
    out = _run(bf16_engine, reqs)
    assert all(r.finish_reason is FinishReason.STOP for r in reqs)
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", gguf_tokenizer.decode(ids[:-1])) for ids in out[:4])
    assert all(gguf_tokenizer.decode(ids[:-1]) in ("sunny", "rainy day", "snow") for ids in out[4:])
    assert bf16_engine.executor.grammar.stats.rows > 0


def test_the_bitmask_unpacks_to_token_order():
    """Bit b of word w is token 32 w + b, the sign bit included (unpack_bitmask against shifts)."""
    import torch

    from engine.structured.masks import unpack_bitmask

    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    words[0, 0] = -2**31                          # only token 31 of the first word
    reference = ((words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(3, 160).bool()
    got = unpack_bitmask(words)
    assert got.dtype == torch.bool and got.shape == (3, 160)
    assert torch.equal(got, reference)
    assert got[0, :32].nonzero().flatten().tolist() == [31]
