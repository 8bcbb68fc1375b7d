"""Tool calling against the real server (engine on the embedded model, bridge, Envoy), with the
clients that send tools: the openai SDK (`pydantic_function_tool`, `chat.completions.parse`),
LangChain's `bind_tools` and instructor, each with nested pydantic models, whose schemas carry
`$defs` / `$ref`; `tool_choice: "none"` answering in text, streamed as it is made, even when the
text looks like a call; functions without parameters; and /tokenize counting a tool round trip
exactly as chat does."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import sse_events

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
# A reply that looks exactly like a call in bridge/tools.py's format.
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    """A person and where they live and work."""

    name: str = Field(max_length=20)
    home: Address
    work: Address


ASK_PERSON = [{"role": "user", "content": "Record Ann, who lives in Paris, France and works in Rome, Italy."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def _compact(arguments: str) -> bool:
    return json.dumps(json.loads(arguments), separators=(",", ":"), ensure_ascii=False) == arguments


def test_tool_choice_none_answers_in_text_even_when_it_looks_like_a_call(server, client):
    """Under "none" the answer is text: a reply that is, character for character, a call block
    (forced with a regex constraint, which "none" allows) stays `content` with finish "stop", and
    streams as it is made (one delta per token, not one held-back delta at the end)."""
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                tool_choice="none", temperature=0, max_tokens=60,
                extra_body={"structured_outputs": {"regex": CALL_TEXT.replace("{", "\\{").replace("}", "\\}")}})
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == CALL_TEXT
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    deltas = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(deltas) == CALL_TEXT
    assert len(deltas) >= 10                  # as made: before, one held-back delta at the end
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_choice_none_streams_a_reply_starting_with_a_tag(server):
    """A free reply that starts with "<" under "none" streams token by token too."""
    body = {"messages": [{"role": "user", "content": "Write an HTML paragraph: <p>"}], "tools": [WEATHER],
            "tool_choice": "none", "temperature": 0, "max_tokens": 12, "stream": True,
            "structured_outputs": {"regex": "<p>[a-zA-Z ]{1,40}"}}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=600) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    deltas = [d for d in deltas if d]
    assert "".join(deltas).startswith("<p>") and len(deltas) >= 5, deltas
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_sdk_pydantic_function_tool_with_nested_models(client):
    """`openai.pydantic_function_tool` writes nested models as $defs/$ref (strict): required,
    named and streamed calls compile and `parse` gives back the pydantic object."""
    tool = openai.pydantic_function_tool(Person)
    assert "$defs" in tool["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "Person"}}):
        reply = client.chat.completions.parse(model=MODEL, messages=ASK_PERSON, tools=[tool], tool_choice=choice,
                                              temperature=0, max_tokens=120)
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls", c
        call = c.message.tool_calls[0]
        assert call.function.name == "Person" and isinstance(call.function.parsed_arguments, Person)
        assert _compact(call.function.arguments)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    stream = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, tools=[tool], tool_choice="required",
                                            temperature=0, max_tokens=120, stream=True)
    parts = [c.choices[0].delta.tool_calls[0] for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments


def test_langchain_bind_tools_with_a_nested_model(server):
    """LangChain's `bind_tools` with a nested pydantic model (LangChain inlines the definitions),
    and with the openai SDK's tool dict of it (kept as sent: $defs/$ref)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL,
                                       max_tokens=120, temperature=0)
    for tool in (Person, openai.pydantic_function_tool(Person)):
        ai = chat.bind_tools([tool], tool_choice="Person").invoke(ASK_PERSON[0]["content"])
        assert ai.tool_calls and ai.tool_calls[0]["name"] == "Person", ai
        person = Person.model_validate(ai.tool_calls[0]["args"])
        assert person.home.city and person.work.city


def test_instructor_with_nested_models(server):
    """instructor's TOOLS mode sends the model's schema with $defs (nested models) as a forced
    call and gets the nested object back without a retry."""
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused"),
                                    mode=instructor.Mode.TOOLS)
    person, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=150, messages=ASK_PERSON)
    assert isinstance(person, Person) and isinstance(person.home, Address) and person.work.country
    assert completion.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parameters", [None, {"type": "object", "properties": {}}],
                         ids=["omitted", "empty-properties"])
def test_a_function_without_parameters_is_called_with_none(client, parameters):
    """A function whose `parameters` is omitted takes none, and one with no properties takes
    none either: the call is `{}` and ends well before max_tokens (no invented keys, no
    whitespace)."""
    function = {"name": "get_time", "description": "The current time."}
    if parameters is not None:
        function["parameters"] = parameters
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What time is it?"}],
                                           tools=[{"type": "function", "function": function}],
                                           tool_choice="required", temperature=0, max_tokens=100)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.arguments == "{}"
    assert reply.usage.completion_tokens < 40


ROUND_TRIP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]


def test_tokenize_counts_a_tool_round_trip_as_chat_does(server):
    """/tokenize takes every conversation chat takes, tool turns included, and counts exactly
    chat's prompt tokens: with the tools (vLLM's `tools` field: the tool prompt), and without
    (as chat with tool_choice none)."""
    base = server.base_url
    for extra_chat, extra_tokenize in (({"tools": [WEATHER]}, {"tools": [WEATHER]}),
                                       ({"tools": [WEATHER], "tool_choice": "none"}, {}),
                                       ({}, {})):
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=600,
                          json={"messages": ROUND_TRIP, "max_tokens": 1, **extra_chat})
        assert chat.status_code == 200, chat.text
        tokens = httpx.post(f"{base}/tokenize", timeout=60, json={"messages": ROUND_TRIP, **extra_tokenize})
        assert tokens.status_code == 200, tokens.text
        assert tokens.json()["count"] == chat.json()["usage"]["prompt_tokens"], extra_chat
    with_tools = httpx.post(f"{base}/tokenize", json={"messages": ROUND_TRIP, "tools": [WEATHER]}, timeout=60).json()
    without = httpx.post(f"{base}/tokenize", json={"messages": ROUND_TRIP}, timeout=60).json()
    assert with_tools["count"] > without["count"] + 20           # the tool prompt lists the function


@pytest.mark.parametrize(("route", "extra"), [("/v1/chat/completions", {"max_tokens": 1, "tools": [WEATHER]}),
                                              ("/tokenize", {"tools": [WEATHER]})])
def test_a_malformed_tool_turn_is_a_400_naming_the_clients_field(server, route, extra):
    """Errors in a conversation name the client's message (the tool prompt the bridge puts first
    does not shift the index): a call without a name, a tool message without its call id, a
    bad role after tool turns, and a malformed tool."""
    bad_call = [ROUND_TRIP[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                      "function": {"arguments": "{}"}}]}]
    cases = [(bad_call, {}, "messages[1].tool_calls[0].function.name"),
             ([*ROUND_TRIP[:2], {"role": "tool", "content": "18"}], {}, "messages[2].tool_call_id"),
             ([*ROUND_TRIP, {"role": "wizard", "content": "hi"}], {}, "messages[3].role"),
             (ROUND_TRIP, {"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]")]
    for messages, override, param in cases:
        r = httpx.post(f"{server.base_url}{route}", timeout=60, json={"messages": messages, **extra, **override})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(param), error


def test_an_sdk_message_sent_back_as_model_dump_is_accepted(server, client):
    """A reply's message sent back with `model_dump()` (its null refusal, audio, annotations,
    function_call and tool_calls fields included, as applications do) continues the
    conversation, a tool-call reply included; /tokenize counts it as chat does."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    text = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=8)
    call = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                          temperature=0, max_tokens=60)
    dumped = call.choices[0].message.model_dump()
    assert dumped["refusal"] is None and dumped["tool_calls"]
    for messages in ([*ask, text.choices[0].message.model_dump(), {"role": "user", "content": "And Rome?"}],
                     [*ask, dumped, {"role": "tool", "tool_call_id": dumped["tool_calls"][0]["id"],
                                     "content": "18 degrees"}]):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                               max_tokens=1)
        tokens = httpx.post(f"{server.base_url}/tokenize", timeout=60,
                            json={"messages": messages, "tools": [WEATHER]}).json()
        assert tokens["count"] == reply.usage.prompt_tokens
