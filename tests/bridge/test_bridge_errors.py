"""Errors: gRPC status -> HTTP code + JSON body, validation -> 400 naming the field, Cancel."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.bridge.sse import parse_sse

STATUS_CASES = [
    ("INVALID_ARGUMENT", 400, "invalid_request_error"),
    ("UNAUTHENTICATED", 401, "authentication_error"),
    ("NOT_FOUND", 404, "not_found_error"),
    ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
    ("UNAVAILABLE", 503, "service_unavailable_error"),
    ("INTERNAL", 500, "internal_error"),
    ("DEADLINE_EXCEEDED", 500, "internal_error"),
    ("UNIMPLEMENTED", 500, "internal_error"),
]


def assert_error_body(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert {"message", "type", "code"} <= set(error)
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("grpc_code, http_status, error_type", STATUS_CASES)
async def test_grpc_status_maps_to_http(client, grpc_code, http_status, error_type, stream):
    body = {"prompt": f"error:{grpc_code}", "stream": stream}
    resp = await client.post("/v1/completions", json=body)
    error = assert_error_body(resp, http_status, grpc_code.lower())
    assert error["type"] == error_type
    assert error["message"] == f"fake {grpc_code}"
    if http_status in (429, 503):
        assert resp.headers["retry-after"] == "1"  # no retry-after metadata: 1 s
    else:
        assert "retry-after" not in resp.headers


@pytest.mark.parametrize("metadata_value, header", [("2.5", "3"), ("7", "7"), ("0.2", "1"), ("soon", "1")])
async def test_429_retry_after_from_trailing_metadata(client, metadata_value, header):
    resp = await client.post("/v1/completions", json={"prompt": f"error:RESOURCE_EXHAUSTED:{metadata_value}"})
    assert_error_body(resp, 429, "resource_exhausted")
    assert resp.headers["retry-after"] == header


@pytest.mark.parametrize("stream", [False, True])
async def test_a_cancel_from_the_service_is_a_503_to_retry(client, stream):
    """The service's server cancels calls in flight as it stops; the bridge never answers its own
    cancels (its client is gone), so a CANCELLED it reads means "retry", not an internal error."""
    resp = await client.post("/v1/completions", json={"prompt": "error:CANCELLED", "stream": stream})
    error = assert_error_body(resp, 503, "unavailable")
    assert error["type"] == "service_unavailable_error" and "retry" in error["message"]
    assert resp.headers["retry-after"] == "1"


async def test_invalid_argument_names_the_field_in_param(client):
    resp = await client.post("/v1/completions", json={"prompt": "error:INVALID_ARGUMENT:invalid-field=top_p"})
    assert assert_error_body(resp, 400, "invalid_argument")["param"] == "top_p"
    resp = await client.post("/v1/completions", json={"prompt": "error:INVALID_ARGUMENT"})
    assert assert_error_body(resp, 400, "invalid_argument")["param"] is None
    resp = await client.post("/v1/completions", json={"prompt": "error:NOT_FOUND:invalid-field=top_p"})
    assert assert_error_body(resp, 404, "not_found")["param"] is None      # only for a 400


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
        # best_of and a list of prompts are honoured now (tests/bridge/test_openai_parity.py);
        # a wrong type for either is still a 400 naming it.
        ({"prompt": "x", "best_of": "2"}, "best_of"),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_k": 0.5}, "top_k"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream": 1}, "stream"),
        ({"prompt": "x", "seed": -3}, "seed"),
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "stop": ["a", 1]}, "stop"),
        ({"prompt": "x", "logprobs": "5"}, "logprobs"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [["a"]]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
        ({"prompt": "x", "model": 3}, "model"),
    ],
)
async def test_bad_body_is_400_naming_the_field(client, fake, body, field):
    resp = await client.post("/v1/completions", json=body)
    error = assert_error_body(resp, 400, "invalid_argument")
    assert f"'{field}" in error["message"] or f"'{field}'" in error["message"], error["message"]
    assert error["param"] == field
    assert error["type"] == "invalid_request_error"
    assert fake.service.requests == []  # never reached the service


@pytest.mark.parametrize("body", [{}, {"prompt": "x", "prompt_token_ids": [1]}, {"max_tokens": 3}])
async def test_exactly_one_prompt(client, body):
    error = assert_error_body(await client.post("/v1/completions", json=body), 400, "invalid_argument")
    assert "prompt" in error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"prompt"'])
async def test_malformed_json_is_400(client, raw):
    resp = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error_body(resp, 400, "invalid_argument")


async def test_unknown_route_uses_the_error_shape(client):
    assert_error_body(await client.get("/v1/nothing"), 404, "not_found")
    assert_error_body(await client.get("/v1/completions"), 405, "method_not_allowed")


async def test_cancel_unknown_request_is_404(client, fake):
    resp = await client.delete("/v1/requests/nope", headers={"Authorization": "Bearer k1"})
    assert_error_body(resp, 404, "not_found")
    assert fake.service.cancel_calls == [("nope", fake.service.cancel_calls[0][1])]
    assert fake.service.cancel_calls[0][1]["authorization"] == "Bearer k1"


async def test_cancel_running_request(client, fake):
    stream = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": "hang", "stream": True}, headers={"X-Request-Id": "r-9"})
    )
    await asyncio.wait_for(fake.service.hanging.wait(), 5)
    resp = await client.delete("/v1/requests/r-9", headers={"Authorization": "Bearer k2"})
    assert resp.status_code == 200 and resp.json() == {"request_id": "r-9", "cancelled": True}
    assert fake.service.cancel_calls[0][1]["authorization"] == "Bearer k2"
    body = (await asyncio.wait_for(stream, 5)).text
    events = [json.loads(d) for _, d in parse_sse(body)[:-1]]
    assert events[-1]["finish_reason"] == "cancelled" and events[-1]["detail"] == "cancel"
    assert parse_sse(body)[-1] == (None, "[DONE]")


def test_an_engine_field_becomes_the_field_the_client_sent():
    """`client_field`: the longest engine field that is the error's field or starts it (followed
    by `[` or `.`) is replaced by the client's; `rename_param` renames the message's field too."""
    from bridge.errors import ApiError, client_field, rename_param

    names = {"choice": "guided_choice", "messages": "input", "messages[1]": "input[3]",
             "max_tokens": "max_output_tokens"}
    assert client_field("choice", names) == "guided_choice"
    assert client_field("choice[0]", names) == "guided_choice[0]"
    assert client_field("choices", names) == "choices"                  # not a path below `choice`
    assert client_field("messages[1].content", names) == "input[3].content"
    assert client_field("messages[2].content", names) == "input[2].content"
    assert client_field("max_tokens", names) == "max_output_tokens"
    assert client_field("temperature", names) == "temperature"
    error = ApiError(400, "choice[0]: must be a string of 1 to 1024 characters", code="invalid_argument",
                     param="choice[0]")
    rename_param(error, {"choice": "structured_outputs.choice"})
    assert error.param == "structured_outputs.choice[0]"
    assert error.message == "structured_outputs.choice[0]: must be a string of 1 to 1024 characters"
