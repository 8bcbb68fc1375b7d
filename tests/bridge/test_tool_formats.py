"""The tool-call formats (bridge/tools.py `ToolFormat`): vLLM's hermes, llama3_json and mistral,
and the bridge's generic prompt. Each round-trips (the answer a model writes -> parse -> OpenAI
`tool_calls`, whole and streamed through `ChatCompletionBuilder`); each format's grammar accepts
exactly its own answers, and answers drawn at random from the grammar (token by token, as a
constrained sample is) parse to calls whose arguments validate; over the bridge app, a model whose
engine reports a parser gets its tools and tool turns as structured ChatMessages and its own
grammar, and its answer comes back as `tool_calls`."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from bridge.chat import ChatCompletionBuilder
from bridge.tools import GENERIC, TOOL_FORMATS, tool_format, tool_setup
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import ConstraintSpec
from genserve.v1 import generate_pb2 as pb
from tests.bridge.sse import MODEL_NAME

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}   # no parameters
TOOLS = [WEATHER, NOW]
CALLS = [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}, {"name": "now", "arguments": {}}]
# What each format's model writes for CALLS (as the published templates write earlier calls).
WRITTEN = {
    "generic": '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}</tool_call>'
               '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}; '
                   '{"name": "now", "parameters": {}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}, '
               '{"name": "now", "arguments": {}}]',
}
FORMATS = sorted(TOOL_FORMATS)


def _expected(fmt_name: str) -> list[tuple[str, str]]:
    return [("get_weather", '{"city":"Zürich","days":2}'), ("now", "{}")]


def _builder(fmt, stream_text: str) -> ChatCompletionBuilder:
    """A builder fed `stream_text` in tokens of 3 characters and a stop; returns it (its chunks in
    `.chunks`)."""
    builder = ChatCompletionBuilder(model=MODEL_NAME, created=0, num_samples=1, logprobs=False, tools=fmt)
    chunks = builder.events_for(pb.GenerateResponse(request_id="r", started=pb.Started(request_id="r")))
    for k in range(0, len(stream_text), 3):
        chunks += builder.events_for(pb.GenerateResponse(token=pb.Token(index=0, text=stream_text[k:k + 3])))
    chunks += builder.events_for(pb.GenerateResponse(finished=pb.Finished(index=0, reason=pb.FINISH_REASON_STOP)))
    builder.chunks = chunks
    return builder


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_round_trips_to_openai_tool_calls(name):
    fmt = TOOL_FORMATS[name]
    for text in (WRITTEN[name], fmt.write(CALLS)):
        calls = fmt.parse(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == _expected(name)
        assert all(c["type"] == "function" for c in calls)
        if name == "mistral":           # its template takes back only nine letters and digits
            assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
        else:
            assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    assert fmt.write(CALLS) == {"generic": WRITTEN["generic"].replace(", ", ",").replace(": ", ":"),
                                "hermes": WRITTEN["hermes"].replace(", ", ",").replace(": ", ":"),
                                "llama3_json": '{"name":"get_weather","parameters":{"city":"Zürich","days":2}}; '
                                               '{"name":"now","parameters":{}}',
                                "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Zürich","days":2}}, '
                                           '{"name":"now","arguments":{}}]'}[name]


@pytest.mark.parametrize("name", FORMATS)
def test_text_and_broken_calls_are_not_calls(name):
    fmt = TOOL_FORMATS[name]
    broken = WRITTEN[name][:-3]
    for text in ("It is sunny.", broken, "", WRITTEN[name] + " and more text"):
        assert fmt.parse(text) is None, text
    others = [WRITTEN[o] for o in FORMATS if o != name and not (  # generic and hermes read each other
        {o, name} <= {"generic", "hermes"})]
    for text in others:
        assert fmt.parse(text) is None, (name, text)


@pytest.mark.parametrize("name", FORMATS)
def test_the_answer_streams_as_tool_calls_and_completes_as_tool_calls(name):
    fmt = TOOL_FORMATS[name]
    builder = _builder(fmt, WRITTEN[name])
    message = builder.completion()["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] is None
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message["message"]["tool_calls"]]
    assert whole == _expected(name)
    # Streamed: no content delta (held back), then per call its id and name, then its arguments.
    deltas = [c["choices"][0]["delta"] for c in builder.chunks if c["choices"]]
    assert not any(d.get("content") for d in deltas)
    streamed: dict[int, dict] = {}
    for d in deltas:
        for part in d.get("tool_calls", ()):
            call = streamed.setdefault(part["index"], {"name": "", "arguments": "", "id": None})
            call["id"] = part.get("id", call["id"])
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part["function"].get("arguments", "")
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == whole
    assert [c["id"] for c in streamed.values()] == [c["id"] for c in message["message"]["tool_calls"]]
    assert [c["choices"][0]["finish_reason"] for c in builder.chunks if c["choices"]][-1] == "tool_calls"


@pytest.mark.parametrize("name", FORMATS)
def test_text_that_does_not_start_as_calls_streams_as_it_is_made(name):
    builder = _builder(TOOL_FORMATS[name], "It is 21 degrees.")
    deltas = [c["choices"][0]["delta"].get("content") for c in builder.chunks if c["choices"]]
    assert "".join(d for d in deltas if d) == "It is 21 degrees."
    assert len([d for d in deltas if d]) == 6                       # token by token, not held back
    assert builder.completion()["choices"][0]["finish_reason"] == "stop"


def test_unknown_parser_names_are_refused_and_empty_is_generic():
    assert tool_format("") is GENERIC
    assert tool_format("hermes") is TOOL_FORMATS["hermes"]
    for bad in ("generic", "pythonic"):
        with pytest.raises(ValueError):
            tool_format(bad)


@pytest.fixture(scope="module")
def compiler(gguf_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(gguf_tokenizer)


def _accepts(compiler, tokenizer, grammar: str, text: str) -> bool:
    matcher = compiler.compile(ConstraintSpec("grammar", grammar, "tools")).new_matcher()
    for token in tokenizer.encode_text(text):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize("name", FORMATS)
def test_the_grammar_admits_its_formats_answers_and_no_others(compiler, gguf_tokenizer, name):
    fmt = TOOL_FORMATS[name]
    parallel = tool_setup(TOOLS, "required", True, fmt).grammar()
    single = tool_setup(TOOLS, "required", False, fmt).grammar()
    named = tool_setup(TOOLS, {"type": "function", "function": {"name": "now"}}, False, fmt).grammar()
    auto = tool_setup(TOOLS, "auto", True, fmt).grammar()
    both, first, second = fmt.write(CALLS), fmt.write(CALLS[:1]), fmt.write(CALLS[1:])
    assert _accepts(compiler, gguf_tokenizer, parallel, both)
    assert _accepts(compiler, gguf_tokenizer, auto, both)
    assert not _accepts(compiler, gguf_tokenizer, single, both)
    assert _accepts(compiler, gguf_tokenizer, single, first)
    assert _accepts(compiler, gguf_tokenizer, named, second)
    assert not _accepts(compiler, gguf_tokenizer, named, first)
    bad_args = fmt.write([{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}])
    assert not _accepts(compiler, gguf_tokenizer, parallel, bad_args)
    assert _accepts(compiler, gguf_tokenizer, auto, "It is sunny.")
    assert not _accepts(compiler, gguf_tokenizer, single, "It is sunny.")
    for other in FORMATS:
        if other != name and not {other, name} <= {"generic"}:
            assert not _accepts(compiler, gguf_tokenizer, parallel, TOOL_FORMATS[other].write(CALLS)), other


def _sample(compiler, tokenizer, grammar: str, rng: random.Random, limit: int = 400) -> str:
    """An answer drawn from the grammar token by token (uniformly among the allowed tokens, the
    end-of-sequence token taken as soon as it is allowed), as a constrained sample is drawn."""
    import llguidance
    import numpy as np

    compiled = compiler.compile(ConstraintSpec("grammar", grammar, "tools"))
    matcher = compiled.new_matcher()
    words = (compiled.vocab_size + 31) // 32
    tokens = []
    for _ in range(limit):
        mask = np.zeros(words, dtype=np.int32)
        llguidance.LLExecutor(1).unsafe_compute_mask_ptr([(matcher, 0)], mask.ctypes.data, words * 4, 1)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:compiled.vocab_size]
        allowed = np.flatnonzero(bits)
        if compiled.eos_token_id in allowed:
            break
        token = int(rng.choice(list(allowed)))
        assert matcher.consume_token(token)
        tokens.append(token)
    else:
        raise AssertionError("the grammar did not end")
    return tokenizer.decode(tokens)


@pytest.mark.parametrize("name", FORMATS)
def test_answers_drawn_from_the_grammar_parse_and_validate(compiler, gguf_tokenizer, name):
    fmt = TOOL_FORMATS[name]
    rng = random.Random(7)
    schemas = {"get_weather": {**WEATHER["function"]["parameters"], "additionalProperties": False},
               "now": {"type": "object", "maxProperties": 0}}
    for choice, parallel in (("required", True), ("required", False),
                             ({"type": "function", "function": {"name": "get_weather"}}, False)):
        grammar = tool_setup(TOOLS, choice, parallel, fmt).grammar()
        for _ in range(3):
            text = _sample(compiler, gguf_tokenizer, grammar, rng)
            calls = fmt.parse(text)
            assert calls, (name, text)
            if not parallel:
                assert len(calls) == 1
            if isinstance(choice, dict):
                assert calls[0]["function"]["name"] == "get_weather"
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


async def test_a_model_with_a_tool_template_gets_structured_turns_and_its_own_format(fake, client):
    """The engine reports hermes: the bridge asks Info once, sends the tools as tools_json and
    earlier calls / results as structured messages (not the generic prompt), constrains with the
    hermes grammar and answers the hermes reply as tool_calls."""
    fake.service.info.tool_call_parser = "hermes"
    reply = WRITTEN["hermes"]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": f"reply:{reply}"},
    ]
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": messages, "tools": TOOLS, "tool_choice": "required", "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert [(c["function"]["name"], c["function"]["arguments"])
                    for c in choice["message"]["tool_calls"]] == _expected("hermes")
        else:
            assert '"finish_reason":"tool_calls"' in r.text.replace(" ", "")
    assert fake.service.info_calls == 1                     # asked once, kept
    sent = fake.service.requests[-1]
    assert json.loads(sent.chat.tools_json) == TOOLS
    assert [m.role for m in sent.chat.messages] == ["user", "assistant", "tool", "user"]
    call = sent.chat.messages[1].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("call_1", "get_weather", {"city": "Paris", "days": 1})
    assert sent.chat.messages[2].tool_call_id == "call_1"
    assert sent.grammar.startswith("start: calls\ncalls: call (\"\\n\" call)*\ncall: \"<tool_call>\\n\" args")


async def test_a_model_without_a_tool_template_keeps_the_generic_prompt(fake, client):
    reply = WRITTEN["generic"]
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": f"reply:{reply}"}], "tools": TOOLS,
        "tool_choice": "required"})
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    sent = fake.service.requests[-1]
    assert sent.chat.tools_json == ""
    assert sent.chat.messages[0].role == "system" and "You can call these functions" in sent.chat.messages[0].content


async def test_a_malformed_tool_call_is_a_400_naming_its_field_in_either_format(fake, client):
    for parser in ("", "mistral"):
        fake.service.info.tool_call_parser = parser
        fake.service.info_calls = 0
        r = await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "tools": TOOLS, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": ""}}]}]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.name"


def test_answers_are_drawn_over_a_tokenizer_that_adds_a_bos_and_a_space(tmp_path):
    """A Llama-2-style SentencePiece tokenizer (its `encode` puts <s> first, its normalizer a
    "▁" before the text): the grammar still draws whole calls (llguidance tokenizes the text a
    grammar forces with the vocabulary's own bytes, engine/structured/vocab.py); before, the
    forced "<tool_call>" allowed only <s> and a constrained sample ended at once."""
    from engine.tokenizer import Tokenizer
    from tests.tool_templates import write_tokenizer

    directory = write_tokenizer(tmp_path / "tok", "qwen2.5")
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tokenizer = Tokenizer.from_hf_dir(directory, vocab_size=320)
    assert tokenizer.encode("<")[0] == 1                              # the BOS comes first
    compiler = GrammarCompiler(tokenizer)
    rng = random.Random(3)
    for name in FORMATS:
        fmt = TOOL_FORMATS[name]
        text = _sample(compiler, tokenizer, tool_setup(TOOLS, "required", True, fmt).grammar(), rng)
        assert fmt.parse(text), (name, text)


async def test_tokenize_counts_the_conversation_as_chat_sends_it_in_the_models_format(fake, client):
    """/tokenize with messages and tools sends what chat sends: with a hermes engine, the tools as
    tools_json and the tool turns structured (no generic prompt)."""
    fake.service.info.tool_call_parser = "hermes"
    r = await client.post("/tokenize", json={"model": MODEL_NAME, "tools": TOOLS, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len("hi\n\nnoon")     # the fake counts the contents' bytes


@pytest.mark.parametrize("name", ["llama3_json", "mistral"])
def test_text_starting_with_a_tag_streams_where_calls_do_not_start_so(name):
    builder = _builder(TOOL_FORMATS[name], "<p>It is warm</p>")
    deltas = [c["choices"][0]["delta"].get("content") for c in builder.chunks if c["choices"]]
    assert [d for d in deltas if d][:2] == ["<p>", "It "]             # not held back to the end
    assert builder.completion()["choices"][0]["message"]["content"] == "<p>It is warm</p>"
