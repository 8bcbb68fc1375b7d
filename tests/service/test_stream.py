"""Detokenization, stop strings and per-sample streams with the real tokenizer."""

from __future__ import annotations

import pytest

from engine.core.outputs import FinishReason, TokenEvent
from genserve.v1 import generate_pb2 as pb
from service.detokenizer import IncrementalDetokenizer
from service.stop import StopMatcher
from service.stream import SampleStream, TextOptions


def test_multibyte_characters_split_across_tokens_never_stream_replacement(gguf_tokenizer):
    text = "Emoji 😀🎉 and 日本語のテキスト, ünïcödé ✓"
    ids = gguf_tokenizer.encode(text)
    detok = IncrementalDetokenizer(gguf_tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # At least one character really was split across tokens (so the hold-back was exercised).
    assert any(len(gguf_tokenizer.token_bytes(t).decode("utf-8", errors="replace")) !=
               len(gguf_tokenizer.token_bytes(t).decode("utf-8", errors="ignore")) for t in ids)


@pytest.mark.parametrize("pieces, stops, streamed, matched", [
    (["Hello", " wor", "ld", "!"], ["world"], "Hello ", "world"),       # spans tokens
    (["a", "b", "STOP", "c"], ["STOP"], "ab", "STOP"),                  # one whole token
    (["one", " two", " three"], ["never"], "one two three", None),      # never occurs
    (["x<", "/", "y"], ["</s>"], "x</y", None),                         # partial, then released
    (["ab", "cd"], ["bcx", "cd"], "ab", "cd"),                          # earliest full match
])
def test_stop_matcher(pieces, stops, streamed, matched):
    m = StopMatcher(stops)
    out, hit = [], None
    for p in pieces:
        check = m.push(p)
        out.append(check.text)
        if check.matched:
            hit = check.matched
            break
    if hit is None:
        out.append(m.flush())
    assert "".join(out) == streamed
    assert hit == matched


def test_sample_stream_stops_and_drops_the_token_after_the_match(gguf_tokenizer):
    ids = gguf_tokenizer.encode("The answer is 42. Done")
    stream = SampleStream(0, gguf_tokenizer, TextOptions((" 4",)), want_logprobs=False)
    texts, stop_asked = [], False
    for pos, t in enumerate(ids):
        out = stream.on_event(TokenEvent("r", token_id=t, position=pos))
        texts += [m.text for m in out.messages]
        stop_asked |= out.stop_engine
    final = stream.on_event(TokenEvent("r", finish_reason=FinishReason.STOP, finish_detail="stop string",
                                       num_prompt_tokens=3, num_completion_tokens=len(ids)))
    assert "".join(texts) == "The answer is"
    assert stop_asked
    [finished] = final.messages
    assert finished.reason == pb.FINISH_REASON_STOP and finished.detail == "stop:  4"
    through_match = next(k for k in range(1, len(ids) + 1) if " 4" in gguf_tokenizer.decode(ids[:k]))
    assert through_match < len(ids)
    assert finished.usage.completion_tokens == through_match


def test_finished_carries_ttft_only_when_the_sample_had_a_first_token(gguf_tokenizer):
    """`Timing.ttft_ms` is set from the engine's first-token time, and left unset (not 0) for a
    sample that ended before its first token, so clients can tell the two apart."""
    def finished(**timing) -> pb.Finished:
        stream = SampleStream(0, gguf_tokenizer, TextOptions(()), want_logprobs=False)
        [msg] = stream.on_event(TokenEvent("r", finish_reason=FinishReason.CANCELLED, num_prompt_tokens=3,
                                           num_completion_tokens=0, **timing)).messages
        return msg

    cancelled_early = finished(queue_ms=4.0, e2e_ms=9.5)
    assert not cancelled_early.timing.HasField("ttft_ms")
    assert (cancelled_early.timing.queue_ms, cancelled_early.timing.e2e_ms) == (4.0, 9.5)
    answered = finished(queue_ms=4.0, ttft_ms=21.25, e2e_ms=60.0)
    assert answered.timing.HasField("ttft_ms") and answered.timing.ttft_ms == 21.25
