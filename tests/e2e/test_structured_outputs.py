"""Structured outputs against the real server (engine on the embedded model, bridge, Envoy), with
the client libraries people use for them: the openai SDK's `chat.completions.parse`, LangChain's
`with_structured_output` (json_schema and function_calling), instructor (TOOLS, JSON and
JSON_SCHEMA modes), LiteLLM's `response_format`; vLLM's `structured_outputs` and `guided_*`
on both endpoints; the gRPC `constraint` oneof. Every output is checked: JSON with `jsonschema`,
regex and choice outputs by matching."""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # no network: litellm's bundled prices

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a fictional person as JSON."}]

# Schemas of the validity test: nested objects, arrays with bounds, enums, integer ranges,
# required and optional keys, anyOf.
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 2, "maxItems": 4}},
        "required": ["scores"], "additionalProperties": False},
    "enum_range": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "nickname": {"type": "string", "maxLength": 12}},
        "required": ["colour", "age"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000},
                            {"type": "string", "maxLength": 10}, {"type": "boolean"}]},
        "ok": {"type": "boolean"}},
        "required": ["value", "ok"], "additionalProperties": False},
    "list_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "done": {"type": "boolean"}},
        "required": ["id", "done"], "additionalProperties": False}},
}


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=50_000_000)


def _chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": ASK, **body}, timeout=600)


def test_openai_sdk_parse_returns_the_pydantic_object(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=City, temperature=0, max_tokens=120)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City) and city.name and 0 <= city.population <= 50_000_000
    assert City.model_validate_json(choice.message.content) == city


def test_two_hundred_sampled_outputs_all_validate(server):
    """Temperature 1, five schemas, 5 requests of n=8 each: every one of the 200 samples is complete
    ("stop") and validates; the second request of a schema reuses its compilation."""
    def ask(name: str, seed: int) -> list[tuple[str, dict]]:
        schema = SCHEMAS[name]
        r = _chat(server, temperature=1.0, seed=seed, n=8, max_tokens=200,
                  response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                          "strict": True}})
        assert r.status_code == 200, r.text
        return [(name, c) for c in r.json()["choices"]]

    jobs = [(name, seed) for seed in range(5) for name in SCHEMAS]
    with ThreadPoolExecutor(8) as pool:
        results = [c for group in pool.map(lambda job: ask(*job), jobs) for c in group]
    assert len(results) == 200
    for name, choice in results:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])
    assert len({c["message"]["content"] for _, c in results}) > 50        # they were sampled


def test_json_object_mode_regex_and_choice_on_both_endpoints(server):
    """json_object mode on a request whose answer is a short object, so that samples close it
    ("Describe a fictional person" rambles: at seed 1 one sample in four closed its object within
    120 tokens with `paged_prefill` and none with torch's flash kernel for prefill). Greedy, the
    answer is the object asked for (every token's margin >= 0.875 nats under the exact bf16
    products, Q4_1 x Q8_1, `paged_prefill` and the flash kernel); sampled, every sample is an
    object or, cut at max_tokens, starts one."""
    ann = [{"role": "user", "content": 'Reply with a JSON object with the keys "name" and "age" '
                                       'for a person called Ann who is 30.'}]
    r = _chat(server, messages=ann, temperature=0, max_tokens=120, response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    [c] = r.json()["choices"]
    assert c["finish_reason"] == "stop" and json.loads(c["message"]["content"]) == {"name": "Ann", "age": 30}, c
    r = _chat(server, messages=ann, temperature=1.0, seed=1, n=4, max_tokens=120,
              response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for c in choices:          # an object without a schema may run to max_tokens ("length")
        text = c["message"]["content"]
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert c["finish_reason"] == "length" and text.startswith("{")
    assert any(c["finish_reason"] == "stop" for c in choices)
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=600, json={
            "prompt": "A name and an age:", "max_tokens": 20, "temperature": 1.0, "n": 4, "seed": 3, **body})
        assert r.status_code == 200, r.text
        assert all(re.fullmatch(pattern, c["text"]) for c in r.json()["choices"]), r.json()
    options = ["positive", "negative", "neutral"]
    for body in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
        r = _chat(server, temperature=1.0, n=4, max_tokens=10, **body)
        assert r.status_code == 200, r.text
        assert all(c["message"]["content"] in options for c in r.json()["choices"])
    r = _chat(server, temperature=0, max_tokens=10,
              structured_outputs={"grammar": 'start: "yes" | "no" | "maybe"'})
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no", "maybe")


def test_streamed_constrained_answer_is_the_same_json(server):
    body = {"messages": ASK, "temperature": 0, "max_tokens": 150,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}}
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600).json()
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=600) as r:
        text = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                       for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line
                       and json.loads(line[5:])["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


def test_a_bad_schema_is_a_400_naming_the_field_and_the_server_stays_healthy(server):
    r = _chat(server, max_tokens=5, response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"x": {"type": "frobnicate"}}}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema", error
    assert error["message"].startswith("response_format.json_schema.schema:") and "frobnicate" in error["message"]
    r = _chat(server, max_tokens=5, structured_outputs={"regex": "[a-"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"
    r = _chat(server, max_tokens=5, response_format={"type": "json_schema"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema"
    r = _chat(server, max_tokens=5, response_format={"type": "json_object"}, guided_regex="a+")
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    ok = _chat(server, max_tokens=3, temperature=0)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_grpc_constraint_oneof(server):
    schema = SCHEMAS["enum_range"]
    request = pb.GenerateRequest(prompt="A person as JSON:", max_tokens=80, n=2, json_schema=json.dumps(schema),
                                 sampling=pb.SamplingParams(temperature=1.0, seed=5))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        texts = {0: "", 1: ""}
        reasons = {}
        for msg in stub.Generate(request, timeout=600):
            if msg.WhichOneof("event") == "token":
                texts[msg.token.index] += msg.token.text
            elif msg.WhichOneof("event") == "finished":
                reasons[msg.finished.index] = msg.finished.reason
        bad = pb.GenerateRequest(prompt="x", max_tokens=5, regex="(unclosed")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=60))
    assert reasons == {0: pb.FINISH_REASON_STOP, 1: pb.FINISH_REASON_STOP}
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("invalid-field", "regex") in tuple(err.value.trailing_metadata())


def test_langchain_with_structured_output_json_schema(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL,
                                       max_tokens=120, temperature=0)
    city = chat.with_structured_output(City, method="json_schema").invoke("Tell me about Paris.")
    assert isinstance(city, City) and city.name


def test_litellm_response_format(server):
    litellm = pytest.importorskip("litellm")
    reply = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.base_url}/v1", api_key="unused",
                               messages=[{"role": "user", "content": "Tell me about Rome."}], max_tokens=120,
                               temperature=0, response_format=City)
    assert City.model_validate_json(reply.choices[0].message.content).name


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_openai_sdk_tools_required_named_and_streamed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice=choice,
                                               temperature=0, max_tokens=80)
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        call = c.message.tool_calls[0]
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                            temperature=0, max_tokens=80, stream=True)
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    parts = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert parts[0].id.startswith("call_") and parts[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls"
    # A round trip: the call and its result go back, and the model answers in text.
    follow = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=30, tools=[WEATHER],
                                            tool_choice="none", messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.content


def test_langchain_bind_tools_round_trip(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    chat = langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL,
                                       max_tokens=80, temperature=0)
    bound = chat.bind_tools([WEATHER], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Rome?")
    ai = bound.invoke([question])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(ai.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    answer = chat.invoke([question, ai, ToolMessage("21 degrees", tool_call_id=ai.tool_calls[0]["id"])])
    assert isinstance(answer.content, str) and answer.content


def test_langchain_with_structured_output_function_calling(server):
    """LangChain's default structured-output method: a forced call of a tool named after the model
    (`tool_choice` naming it, `parallel_tool_calls` false), parsed back into the pydantic object."""
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL,
                                       max_tokens=120, temperature=0)
    city = chat.with_structured_output(City, method="function_calling").invoke("Tell me about Paris.")
    assert isinstance(city, City) and city.name and 0 <= city.population <= 50_000_000
    raw = chat.with_structured_output(City, method="function_calling", include_raw=True).invoke("Tell me about Paris.")
    assert raw["parsing_error"] is None and raw["parsed"] == city
    assert raw["raw"].tool_calls[0]["name"] == "City"


def test_instructor_tools_and_json_modes(server):
    """instructor, in the mode that forces a tool call (TOOLS) and in its JSON mode that sends the
    schema (JSON_SCHEMA: `response_format` json_schema), returns the pydantic object without a
    retry. (Its plain JSON mode asks for `json_object`, any object, with the schema only in the
    prompt; that guarantees an object, not the schema's, and SmolLM2 answers with one shaped like
    the schema text itself.)"""
    instructor = pytest.importorskip("instructor")
    openai = pytest.importorskip("openai")
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused"),
                                        mode=mode)
        city, completion = client.chat.completions.create_with_completion(
            model=MODEL, response_model=City, max_retries=0, temperature=0, max_tokens=150,
            messages=[{"role": "user", "content": "Tell me about Paris."}])
        assert isinstance(city, City) and city.name and 0 <= city.population <= 50_000_000, mode
        choice = completion.choices[0]
        if mode is instructor.Mode.TOOLS:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "City"
        else:
            assert choice.finish_reason == "stop"
            assert City.model_validate_json(choice.message.content).model_dump() == city.model_dump()


def _big_schema(tag: int) -> dict:
    """A schema of ≈ 60 KiB (under the 64 KiB limit) whose grammar takes llguidance a good fraction of a
    second to compile: 900 integer properties with distinct wide ranges (the compiler builds a
    regular expression for each range); `tag` makes each one distinct, so none is cached."""
    props = {f"p{tag}_{k}": {"type": "integer", "minimum": -123456789 + k + tag, "maximum": 987654321 - k}
             for k in range(900)}
    return {"type": "object", "properties": props, "required": [next(iter(props))]}


def test_a_slow_compile_does_not_delay_other_streams(server):
    """Compiling happens on the service's compile workers before a request is queued, so while
    big schemas compile, a running stream keeps its pace: its inter-token gaps while eight distinct
    slow schemas compile stay within a generous factor of its own gaps just before (the CPU is
    shared, so some slowdown is expected; a compile in the step loop would stop the stream for
    the whole compilation)."""
    base = server.base_url
    arrivals: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"messages": [{"role": "user", "content": "Count slowly to one thousand."}],
                "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"content":"' in line:
                    arrivals.append(time.perf_counter())
                if done.is_set():
                    break

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        while len(arrivals) < 40:                       # the stream's own pace first
            assert reader.is_alive(), "the stream ended early"
            time.sleep(0.05)
        t0 = time.perf_counter()

        def big(tag: int) -> float:
            r = _chat(server, max_tokens=1, temperature=0,
                      response_format={"type": "json_schema", "json_schema": {"name": f"big{tag}",
                                                                              "schema": _big_schema(tag)}})
            assert r.status_code == 200, r.text
            return time.perf_counter()

        with ThreadPoolExecutor(8) as pool:
            ends = list(pool.map(big, range(8)))
        t1 = min(ends)            # until the first big request is answered, all eight were compiling
        time.sleep(0.5)
    finally:
        done.set()
        reader.join(600)
    before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b <= t0][10:]    # past the prefill
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= t0 and b <= t1]
    assert len(before) >= 20 and len(during) >= 5, (len(before), len(during), t1 - t0)
    pace = statistics.median(before)
    assert statistics.median(during) < 4 * pace, (pace, during)
    # A compile on the step loop would stop the stream for whole compilations (seconds): here it
    # keeps at least a third of its own pace over the compile window. (Single gaps of 0.3–1.3 s
    # were seen in some runs on 2 shared cores; their cause is not found, see
    # docs/structured-outputs.md, so the longest gap is not held to the step time.)
    assert len(during) >= (t1 - t0) / pace / 3, (len(during), t1 - t0, pace)
