"""Every 400 names the field the client sent (docs/api.md: "`param` the field"), including the errors
the engine finds after the bridge has translated the body into gRPC fields of other names:
vLLM's choice constraints (`guided_choice[0]`, not the engine's `choice[0]`), chat's
`max_completion_tokens` and `top_logprobs`, completions' `best_of` and token-id `prompt`, the
Responses API's `max_output_tokens`. Against the real server, through the openai SDK where it
sends the request."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
LONG = "x" * 1025        # one character over the engine's 1,024-character choice limit


@pytest.mark.parametrize(("route", "body", "param", "limit"), [
    ("/v1/chat/completions", {**CHAT, "guided_choice": []}, "guided_choice", "non-empty"),
    ("/v1/chat/completions", {**CHAT, "guided_choice": ["yes", LONG]}, "guided_choice[1]", "1024"),
    ("/v1/chat/completions", {**CHAT, "guided_choice": [""]}, "guided_choice[0]", "1024"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "non-empty"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": [LONG]}}, "structured_outputs.choice[0]",
     "1024"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "guided_choice": [LONG]}, "guided_choice[0]", "1024"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "structured_outputs": {"choice": ["a", ""]}},
     "structured_outputs.choice[1]", "1024"),
    ("/v1/chat/completions", {"messages": CHAT["messages"], "max_completion_tokens": 5000},
     "max_completion_tokens", "1000"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 7}, "top_logprobs", "5"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "best_of": 9}, "best_of", "8"),
    ("/v1/completions", {"prompt": [1, 2, 10**6], "max_tokens": 3}, "prompt", "49151"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "prompt_logprobs": 6}, "prompt_logprobs", "5"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "echo": True, "logprobs": 6}, "logprobs", "5"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 5000}, "max_output_tokens", "1000"),
])
def test_an_engine_error_names_the_clients_field(server, route, body, param, limit):
    r = httpx.post(f"{server.base_url}{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and limit in error["message"], error
    assert error["code"] == "invalid_argument", error         # a bad value, not an unsupported field


def test_the_openai_sdk_sees_its_own_field_named(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_completion_tokens=5000)
    assert err.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3,
                                       extra_body={"guided_choice": ["yes", LONG]})
    assert err.value.param == "guided_choice[1]"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=5000)
    assert err.value.param == "max_output_tokens"
