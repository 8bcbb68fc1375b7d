"""Tokenize and Detokenize over the real servicer (simulated engine, byte tokenizer), each token's
own bytes on Token messages (real tokenizer), and the chat default of max_tokens."""

from __future__ import annotations

import grpc
import pytest

from engine.core.outputs import FinishReason, TokenEvent
from genserve.v1 import generate_pb2 as pb
from service.stream import SampleStream, TextOptions
from tests.service.harness import VOCAB, running_server


async def test_tokenize_counts_as_generate_and_detokenize_inverts_it():
    async with running_server() as srv:
        reply = await srv.stub.Tokenize(pb.TokenizeRequest(prompt="héllo"))
        assert list(reply.tokens) == list("héllo".encode())
        assert reply.max_context == 256 * 16          # the longest request the harness's pool holds
        call = srv.stub.Generate(pb.GenerateRequest(prompt="héllo", max_tokens=1))
        started = await call.read()
        assert started.started.prompt_tokens == len(reply.tokens)
        call.cancel()
        back = await srv.stub.Detokenize(pb.DetokenizeRequest(tokens=reply.tokens))
        assert back.text == "héllo"
        half = await srv.stub.Detokenize(pb.DetokenizeRequest(tokens=list("é".encode())[:1]))
        assert half.text == "\ufffd"


@pytest.mark.parametrize("rpc, request_, field", [
    ("Detokenize", pb.DetokenizeRequest(tokens=[1, VOCAB]), "tokens"),
    ("Tokenize", pb.TokenizeRequest(), "prompt"),
    ("Tokenize", pb.TokenizeRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")])),
     "messages"),   # the simulated engine's tokenizer has no chat template
    ("Tokenize", pb.TokenizeRequest(prompt="x" * 200_001), "prompt"),
])
async def test_bad_input_is_invalid_argument_naming_the_field(rpc, request_, field):
    async with running_server() as srv:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(srv.stub, rpc)(request_)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(err.value.trailing_metadata())["invalid-field"] == field


async def test_tokenize_needs_a_key_when_keys_are_configured(monkeypatch):
    from service.auth import Authenticator
    async with running_server(auth=Authenticator({"k1": "alice"})) as srv:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await srv.stub.Tokenize(pb.TokenizeRequest(prompt="x"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await srv.stub.Detokenize(pb.DetokenizeRequest(tokens=[104]),
                                          metadata=(("authorization", "Bearer k1"),))
        assert reply.text == "h"


def test_each_token_carries_its_own_bytes(gguf_tokenizer):
    """A character split over tokens: the text arrives whole on the completing token, while each
    Token's `token_bytes` is its own; joined they are the text's bytes. Alternatives keep their
    exact bytes while their text shows U+FFFD."""
    text = "ok 😀 ✓"
    ids = gguf_tokenizer.encode(text)
    stream = SampleStream(0, gguf_tokenizer, TextOptions(), want_logprobs=True)
    tokens = []
    for position, t in enumerate(ids):
        last = position == len(ids) - 1
        ev = TokenEvent("r", token_id=t, logprob=-0.1, top_logprobs=((t, -0.1), (ids[0], -3.0)),
                        position=position, finish_reason=FinishReason.LENGTH if last else None,
                        num_prompt_tokens=1, num_completion_tokens=len(ids))
        tokens += [m for m in stream.on_event(ev).messages if isinstance(m, pb.Token)]
    assert "".join(t.text for t in tokens) == text
    assert b"".join(t.token_bytes for t in tokens) == text.encode()
    assert [t.token_bytes for t in tokens] == [gguf_tokenizer.token_bytes(i) for i in ids]
    split = [t for t in tokens if t.text == ""]
    assert split and all(t.token_bytes for t in split)      # a partial character's own bytes
    assert any("\ufffd" in t.top_logprobs[0].text for t in tokens)
    assert b"".join(t.top_logprobs[0].token_bytes for t in tokens) == text.encode()


def test_control_tokens_carry_no_bytes(gguf_tokenizer):
    stream = SampleStream(0, gguf_tokenizer, TextOptions(), want_logprobs=True)
    [token, _] = stream.on_event(TokenEvent("r", token_id=2, logprob=-0.1, position=0,
                                            finish_reason=FinishReason.STOP, num_prompt_tokens=1,
                                            num_completion_tokens=1)).messages
    assert token.text == "" and token.token_bytes == b""


def test_chat_without_max_tokens_may_use_the_whole_context(gguf_tokenizer):
    from engine.config import EngineConfig
    from service.chat import template_for
    from service.validation import DEFAULT_MAX_TOKENS, ValidationError, Validator

    def chat(content: str, **fields) -> pb.GenerateRequest:
        req = pb.GenerateRequest(**fields)
        req.chat.messages.add(role="user", content=content)
        return req

    config = EngineConfig(max_context=2048, max_new_tokens=1000)
    v = Validator(config, gguf_tokenizer, template_for(gguf_tokenizer))
    assert v.validate(chat("Hi")).max_tokens == 1000                 # the server's largest
    long = v.validate(chat("word " * 1500))
    assert long.max_tokens == 2048 - len(long.prompt_ids) < 1000      # what the context leaves
    assert v.validate(chat("Hi", max_tokens=7)).max_tokens == 7
    assert v.validate(pb.GenerateRequest(prompt="Hi")).max_tokens == DEFAULT_MAX_TOKENS
    with pytest.raises(ValidationError) as e:
        v.validate(chat("word " * 2100))
    assert e.value.field == "messages"
