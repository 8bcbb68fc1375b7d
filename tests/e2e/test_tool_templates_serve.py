"""`genserve serve --model DIR` of tiny random checkpoints whose tokenizer_config.json carries a
published chat template that defines tool calls (tests/chat_templates/): Qwen2 with Qwen2.5's,
Llama with Llama 3.1's, Mistral with Mistral Nemo's. The engine sees that the template reads
`tools` and reports the family's parser (hermes, llama3_json, mistral); through the openai client
library, `tool_choice` "required" (and a named function, streamed) on the random model comes back
as valid `tool_calls` — the template wrote the tools, the format's grammar shaped the answer, its
parser read it — and a follow-up turn with the call and its result renders."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import start_server
from tests.engine.hf_families import build_checkpoint
from tests.tool_templates import write_tokenizer

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string", "enum": ["UTC", "CET"]}},
                                             "required": ["zone"]}}}
SCHEMAS = {f["function"]["name"]: {**f["function"]["parameters"], "additionalProperties": False}
           for f in (WEATHER, TIME)}


# (checkpoint family, template family, the parser the engine must pick)
CASES = [("qwen2", "qwen2.5", "hermes"), ("llama3", "llama3.1", "llama3_json"), ("mistral", "mistral", "mistral")]


@pytest.fixture(scope="module", params=CASES, ids=[c[2] for c in CASES])
def tool_server(request, tmp_path_factory):
    """(server, model name, parser) of a tiny checkpoint carrying a published tool template."""
    family, template_family, parser = request.param
    # A tool prompt is 1,000-2,000 tokens of this byte-level tokenizer: room past the tiny 128.
    directory = build_checkpoint(family, tmp_path_factory.mktemp(family) / f"tiny-{family}-tools",
                                 max_position_embeddings=4096)
    write_tokenizer(directory, template_family, config=False)
    gen = start_server("--model", str(directory), "--dtype", "float32", kv_pool_gib=0.05)
    server = next(gen)
    try:
        yield server, directory.name, parser
    finally:
        next(gen, None)


# One call each (parallel_tool_calls false): a random model, free to add calls, would add them
# until max_tokens cut the answer.


def _valid(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_the_engine_reports_the_familys_parser(tool_server):
    server, _, parser = tool_server
    with grpc.insecure_channel(server.grpc_target) as channel:
        info = pb_grpc.GenerateServiceStub(channel).Info(pb.InfoRequest(), timeout=30)
    assert info.tool_call_parser == parser


def test_required_tool_choice_gives_valid_tool_calls_through_the_openai_client(tool_server):
    server, model, parser = tool_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=0, max_tokens=160,
                                           parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = _valid(choice.message.tool_calls)
    assert len(calls) == 1 and calls[0][0] in SCHEMAS
    call_id = choice.message.tool_calls[0].id
    assert re.fullmatch(r"[A-Za-z0-9]{9}" if parser == "mistral" else r"call_[0-9a-f]{24}", call_id)

    # The call and its result go back; the template writes them, and a named function,
    # streamed, again answers a valid call.
    # (No new user turn after the result: Mistral's template wants the assistant to answer it.)
    follow = messages + [choice.message.model_dump(), {"role": "tool", "tool_call_id": call_id,
                                                       "content": "sunny, 21 C"}]
    stream = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            temperature=0, max_tokens=160, stream=True,
                                            parallel_tool_calls=False)
    name, arguments, finish = "", "", None
    for chunk in stream:
        for part in chunk.choices[0].delta.tool_calls or ():
            name += part.function.name or ""
            arguments += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert name == "get_time"
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_time"])
