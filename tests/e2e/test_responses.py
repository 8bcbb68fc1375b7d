"""The Responses API (POST /v1/responses) against the real server, with the openai SDK's
`client.responses.create` and `responses.parse`: text and message input, streamed `response.*`
events, `text.format` JSON schemas and function tools through the same grammar machinery, and the
400s for what a stateless server cannot do (stored responses, previous_response_id, built-in
tools)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=50_000_000)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def _chat_text(server, messages, **body) -> str:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=600,
                   json={"messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_text_input_answers_as_the_chat_endpoint_does(server, client):
    reply = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer briefly.",
                                    temperature=0, max_output_tokens=12, store=False)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.status in ("completed", "incomplete")
    assert reply.output[0].type == "message" and reply.output[0].role == "assistant"
    expected = _chat_text(server, [{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": "Name a colour."}], max_tokens=12)
    assert reply.output_text == expected and expected
    assert reply.usage.output_tokens > 0 and reply.usage.input_tokens > 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 12


def test_message_input_streams_response_events(client):
    messages = [{"role": "developer", "content": "You are terse."},
                {"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                {"type": "message", "role": "user", "content": "Again, please."}]
    whole = client.responses.create(model=MODEL, input=messages, temperature=0, max_output_tokens=16)
    events = list(client.responses.create(model=MODEL, input=messages, temperature=0, max_output_tokens=16,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") \
        < kinds.index("response.output_text.delta")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == whole.output_text and deltas
    assert events[-1].response.output_text == deltas
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_text_format_json_schema_and_parse(client):
    reply = client.responses.parse(model=MODEL, input="Tell me about Paris as JSON.", text_format=City,
                                   temperature=0, max_output_tokens=120)
    assert reply.status == "completed"
    city = reply.output_parsed
    assert isinstance(city, City) and city.name and City.model_validate_json(reply.output_text) == city
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    stream = client.responses.create(model=MODEL, input="A colour and a count.", temperature=1.0, extra_body={"seed": 4},
                                     max_output_tokens=60, stream=True,
                                     text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                                                      "strict": True}})
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), schema)
    obj = client.responses.create(model=MODEL, input="Any JSON object.", temperature=0, max_output_tokens=60,
                                  text={"format": {"type": "json_object"}})
    assert obj.output_text.startswith("{")


def test_function_tools_and_a_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=80)
    call = reply.output[0]
    assert reply.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0, max_output_tokens=80, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    args = next(e for e in events if e.type == "response.function_call_arguments.done").arguments
    assert args == call.arguments
    follow = client.responses.create(model=MODEL, temperature=0, max_output_tokens=30, tools=[WEATHER],
                                     tool_choice="none", input=[
        *ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert follow.output[0].type == "message" and follow.output_text


def _plain(value):
    """An SDK object as JSON data, without the fields `responses.stream` adds when it parses the
    final response (`parsed`, `parsed_arguments`)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def test_every_streamed_items_done_event_matches_the_final_response(client):
    """`responses.stream`: each `response.output_item.done` item (and the content part's done
    event) is the final response's item, status included: "incomplete" when max_output_tokens
    cuts the message, "completed" when it ends."""
    for max_tokens, status in ((4, "incomplete"), (60, "completed")):
        with client.responses.stream(model=MODEL, input="Name a colour.", temperature=0,
                                     max_output_tokens=max_tokens) as stream:
            events = list(stream)
        final = events[-1].response
        assert events[-1].type == f"response.{status}" and final.status == status
        done = [e for e in events if e.type == "response.output_item.done"]
        assert _plain([e.item for e in done]) == _plain(final.output) and done[0].item.status == status
        part = next(e.part for e in events if e.type == "response.content_part.done")
        assert _plain(part) == _plain(final.output[0].content[0]) and part.text == final.output_text
        if status == "incomplete":
            assert final.incomplete_details.reason == "max_output_tokens"


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20)
    home: Address


def test_function_tool_with_defs_and_ref(client):
    """A function tool whose parameters are a pydantic schema with nested models ($defs/$ref)
    is called, required and streamed; its arguments validate against the schema."""
    parameters = openai.pydantic_function_tool(Person)["function"]["parameters"]
    tool = {"type": "function", "name": "Person", "parameters": parameters, "strict": True}
    ask = [{"role": "user", "content": "Record Ann, who lives in Paris, France."}]
    reply = client.responses.create(model=MODEL, input=ask, tools=[tool], tool_choice="required",
                                    temperature=0, max_output_tokens=100)
    call = reply.output[0]
    assert reply.status == "completed" and call.type == "function_call" and call.name == "Person"
    assert Person.model_validate_json(call.arguments).home.city
    with client.responses.stream(model=MODEL, input=ask, tools=[tool], tool_choice="required", temperature=0,
                                 max_output_tokens=100) as stream:
        events = list(stream)
    done = next(e for e in events if e.type == "response.output_item.done")
    assert done.item.arguments == call.arguments
    assert _plain(done.item) == _plain(events[-1].response.output[0])


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"store": True}, "store", "stateless"),
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stateless"),
    ({"conversation": "conv_1"}, "conversation", "stateless"),
    ({"background": True}, "background", "stateless"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "built-in"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frobnicate"}}}},
     "text.format.schema", "frobnicate"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]", "text parts only"),
    ({"max_output_tokens": -1}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "1000"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "arguments": "{}"}]},
     "input[1].name", "non-empty"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "output": "1"}]},
     "input[1].call_id", "call's id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/Missing"}}}}], "tool_choice": "required"}, "tools", "Missing"),
    ({"frobnicate": 1}, "frobnicate", "unknown field"),
])
def test_what_a_stateless_server_cannot_do_is_a_400_naming_the_field(server, body, param, words):
    r = httpx.post(f"{server.base_url}/v1/responses", timeout=600,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
