"""Against a real uvicorn bridge: client disconnects cancel the gRPC call; the openai SDK streams."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.bridge.fake_generate_service import FULL_TEXT, TOKENS


async def _wait_cancelled(fake) -> None:
    await asyncio.wait_for(fake.service.call_cancelled.wait(), 5)


@pytest.mark.parametrize("prompt", ["hang", "hang-before-token"])
async def test_disconnect_mid_stream_cancels_the_grpc_call(live_bridge, fake, prompt):
    async with httpx.AsyncClient(base_url=live_bridge, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True}) as resp:
            assert resp.status_code == 200
            if prompt == "hang":  # read the first token event, then leave
                lines = resp.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
            await asyncio.wait_for(fake.service.hanging.wait(), 5)
    # Leaving the block closed the connection: the fake must see its context cancelled.
    await _wait_cancelled(fake)
    assert len(fake.service.cancelled_calls) == 1


async def test_disconnect_during_non_stream_request_cancels_the_grpc_call(live_bridge, fake):
    async with httpx.AsyncClient(base_url=live_bridge, timeout=10) as client:
        request = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hang"}))
        await asyncio.wait_for(fake.service.hanging.wait(), 5)
        request.cancel()  # the client gives up: httpx closes the connection
        with pytest.raises(asyncio.CancelledError):
            await request
    await _wait_cancelled(fake)


def _sdk_stream(base_url: str) -> tuple[list, list[str]]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-sdk", max_retries=0)
    chunks = list(client.completions.create(model="test-model", prompt="Say hi", max_tokens=8, stream=True))
    return chunks, [c.choices[0].text for c in chunks]


async def test_openai_sdk_streams_from_the_bridge(live_bridge, fake):
    chunks, texts = await asyncio.to_thread(_sdk_stream, live_bridge)
    assert "".join(texts) == FULL_TEXT
    assert len(chunks) == len(TOKENS) + 1
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + len(TOKENS)
    assert {c.id for c in chunks} == {fake.service.requests[0].request_id or chunks[0].id}
    assert fake.service.metadata[0]["authorization"] == "Bearer sk-sdk"


def _sdk_complete(base_url: str):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-sdk", max_retries=0)
    return client.completions.create(model="test-model", prompt="Say hi", max_tokens=2, n=2, logprobs=1)


async def test_openai_sdk_non_stream(live_bridge):
    completion = await asyncio.to_thread(_sdk_complete, live_bridge)
    assert [c.text for c in completion.choices] == ["Hello,", "Hello,"]
    assert completion.choices[0].logprobs.tokens == ["Hello", ","]
    assert completion.usage.completion_tokens == 4


def _sdk_error(base_url: str, prompt: str, stream: bool) -> Exception:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-sdk", max_retries=0)
    try:
        result = client.completions.create(model="m", prompt=prompt, stream=stream)
        if stream:
            list(result)
    except openai.OpenAIError as err:
        return err
    raise AssertionError("expected an error")


@pytest.mark.parametrize(
    "prompt, stream, error_type",
    [
        ("error:RESOURCE_EXHAUSTED:4", True, openai.RateLimitError),
        ("error:UNAUTHENTICATED", False, openai.AuthenticationError),
        ("error:INVALID_ARGUMENT", True, openai.BadRequestError),
        ("midstream-error:UNAVAILABLE", True, openai.APIError),
    ],
)
async def test_openai_sdk_sees_errors(live_bridge, prompt, stream, error_type):
    err = await asyncio.to_thread(_sdk_error, live_bridge, prompt, stream)
    assert isinstance(err, error_type), repr(err)
    if isinstance(err, openai.RateLimitError):
        assert err.response.headers["retry-after"] == "4"
