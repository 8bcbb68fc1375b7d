"""The field policy (bridge/fields.py), walked field by field.

"OpenAI's fields" are the openai SDK's own request types (the TypedDicts of
`openai.types.CompletionCreateParams` and `openai.types.chat.CompletionCreateParams`, streaming and
not): every key must be classified in the policy table, so a field OpenAI adds fails here until it
is. Each field is sent with its probe value, and must be accepted (and, where the field travels
over gRPC, arrive there); with null, which means absent; and, where the policy refuses values,
with one of them, which must be a 400 saying "not supported" and naming it, before any engine
call. The schemas have exactly the table's fields, and docs/api.md's table is the table.
"""

from __future__ import annotations

import typing
from pathlib import Path

import httpx
import openai.types
import openai.types.chat
import pytest

from bridge import fields
from bridge.app import create_app
from bridge.protocol import ChatCompletionRequest, CompletionRequest
from tests.service.harness import running_server

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
SDK_TYPES = {"/v1/completions": openai.types.CompletionCreateParams,
             "/v1/chat/completions": openai.types.chat.CompletionCreateParams}
SCHEMAS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
BASE = {"/v1/completions": {"prompt": "Say hi", "max_tokens": 3},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}}
# Probes that need a companion field.
COMPANIONS = {"top_logprobs": {"logprobs": True}}
ROUTES = list(SDK_TYPES)
# Output constraints: compiled against a real vocabulary (tests/e2e/test_structured_outputs.py).
CONSTRAINT_FIELDS = {"structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "response_format"}


def sdk_fields(union) -> set[str]:
    """Every key of the SDK's request TypedDicts (the union's members: streaming and not)."""
    keys: set[str] = set()
    for typed_dict in typing.get_args(union) or (union,):
        keys |= set(typed_dict.__annotations__) | typed_dict.__required_keys__ | typed_dict.__optional_keys__
    return keys


def probe_body(route: str, name: str, value) -> dict:
    body = {**BASE[route], **COMPANIONS.get(name, {}), name: value}
    if name == "prompt_token_ids":
        del body["prompt"]
    if name == "max_completion_tokens":
        del body["max_tokens"]
    return body


def grpc_value(request, path: str):
    obj = request
    for part in path.split("."):
        obj = getattr(obj, part)
    if hasattr(obj, "items"):                 # a proto map (logit_bias): JSON's string keys
        return {str(k): v for k, v in obj.items()}
    return list(obj) if hasattr(obj, "__len__") and not isinstance(obj, str | bytes) else obj


@pytest.mark.parametrize("route", ROUTES)
def test_every_openai_field_is_classified_and_nothing_else_claims_to_be(route):
    table = fields.TABLES[route]
    openai_keys = sdk_fields(SDK_TYPES[route])
    unclassified = sorted(openai_keys - set(table))
    assert not unclassified, f"OpenAI fields with no policy in bridge/fields.py: {unclassified}"
    claimed = {name for name, rule in table.items() if rule.origin == fields.OPENAI}
    assert claimed == openai_keys, sorted(claimed ^ openai_keys)


@pytest.mark.parametrize("route", ROUTES)
def test_the_schema_has_exactly_the_policys_fields(route):
    assert set(SCHEMAS[route].model_fields) == set(fields.TABLES[route])


def test_readme_holds_the_policy_table():
    assert fields.markdown_table() in API_DOC.read_text(), \
        "docs/api.md's field table is stale: run `python scripts/api_fields.py`"


@pytest.mark.parametrize("route", ROUTES)
async def test_field_walk(route, client, fake, capsys):
    """Every field with its probe (accepted, and on the gRPC request where it travels), with null
    (absent), and with a refused value where the policy refuses some (a 400 before the engine)."""
    table = fields.TABLES[route]
    seen: dict[str, int] = dict.fromkeys(fields.STATUSES, 0)
    for name, rule in table.items():
        r = await client.post(route, json=probe_body(route, name, rule.probe))
        assert r.status_code == 200, (name, r.text)
        if rule.grpc:
            sent = fake.service.requests[-1]
            expected = rule.probe
            if name == "logprobs" and route == "/v1/chat/completions":
                expected = 0                          # true, with no top_logprobs: 0 alternatives
            value = grpc_value(sent, rule.grpc)
            assert value == pytest.approx(expected), (name, value)
        if name not in ("prompt", "messages"):
            r = await client.post(route, json={**BASE[route], name: None})
            assert r.status_code == 200, (name, "null", r.text)
        if rule.has_refused_example:
            before = len(fake.service.requests)
            r = await client.post(route, json=probe_body(route, name, rule.refused))
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error["param"] == name and f"'{name}' is not supported" in error["message"], error
            assert len(fake.service.requests) == before
        if rule.origin == fields.OPENAI:
            seen[rule.status] += 1
    assert seen == fields.counts(table)
    with capsys.disabled():
        print(f"\n{route} field walk, OpenAI's fields: {seen}")


@pytest.mark.parametrize("route", ROUTES)
async def test_a_field_nobody_defines_is_a_400_naming_it(route, client, fake):
    for typo in ("max_token", "temprature", "frobnicate"):
        r = await client.post(route, json={**BASE[route], typo: 1})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == typo and f"unknown field '{typo}'" in error["message"]
    assert fake.service.requests == []


async def test_field_walk_on_the_real_servicer():
    """/v1/completions' walk with the real servicer's validation behind the bridge (a simulated
    engine, byte tokenizer: chat needs the model's template and is walked end to end in
    tests/e2e/test_openai_clients.py)."""
    async with running_server(num_blocks=1024, step_s=0.0) as srv:
        app = create_app(srv.target)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bridge",
                                         timeout=30) as c:
                for name, rule in fields.COMPLETIONS.items():
                    if name in CONSTRAINT_FIELDS:
                        continue      # the byte tokenizer has no end-of-sequence token to end a grammar
                    body = probe_body("/v1/completions", name, rule.probe)
                    r = await c.post("/v1/completions", json=body)
                    assert r.status_code == 200, (name, r.text)


def test_a_responses_chat_error_names_the_input_item_it_came_from():
    from bridge.responses import ResponsesRequest, input_field

    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "1"}]})
    messages, sources = body.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert sources == ["instructions", "input[0]", "input[1]", "input[3]"]    # the two calls: one turn
    assert input_field("messages[1].content[0]", sources) == "input[0].content[0]"
    assert input_field("messages[3].content", sources) == "input[3].content"
    assert input_field("messages", sources) == "input"
    assert input_field("temperature", sources) == "temperature"


def test_every_field_of_the_openai_sdks_responses_request_is_classified():
    """A field the openai SDK sends on /v1/responses is never an 'unknown field' 400: it is
    honoured, accepted, or refused by name (ResponsesRequest.refusal)."""
    from openai.types.responses.response_create_params import ResponseCreateParamsBase

    from bridge.responses import ResponsesRequest

    assert set(ResponseCreateParamsBase.__annotations__) <= set(ResponsesRequest.model_fields)
    body = ResponsesRequest.model_validate({"input": "hi", "moderation": {"input": {"mode": "block"}}})
    refused = body.refusal()
    assert refused is not None and refused.field == "moderation" and "not supported" in refused.message
    assert ResponsesRequest.model_validate({"input": "hi", "prompt_cache_retention": "24h",
                                            "moderation": None}).refusal() is None
