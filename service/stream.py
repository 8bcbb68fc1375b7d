"""One sample's stream: TokenEvents in, gRPC Token and Finished messages out."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.outputs import FinishReason, TokenEvent
from genserve.v1 import generate_pb2 as pb
from service.detokenizer import IncrementalDetokenizer
from service.stop import StopMatcher

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


@dataclass(slots=True)
class StreamOutput:
    """Messages for one event, and whether the engine should stop this sample now."""

    messages: list[pb.Token | pb.Finished] = field(default_factory=list)
    stop_engine: bool = False


class SampleStream:
    """Detokenizes one sample, applies its stop strings, and builds its messages.

    Args:
        index: the sample's index (0..n-1).
        tokenizer: `token_bytes`, `is_special` (for text and top-logprob texts).
        stops: stop strings of the request.
        want_logprobs: whether Token messages carry logprobs.

    After a stop string matched, later tokens of this sample (at most the one step the engine
    needs to see the flag) are dropped, and the Finished message says STOP with the usage
    counted up to the matching token.
    """

    def __init__(self, index: int, tokenizer, stops: tuple[str, ...], want_logprobs: bool) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopMatcher(stops)
        self.want_logprobs = want_logprobs
        self.num_tokens = 0
        self.stopped_by: str | None = None

    def on_event(self, ev: TokenEvent) -> StreamOutput:
        """Messages for `ev` (a token and/or the end of this sample)."""
        out = StreamOutput()
        finished = ev.finish_reason is not None
        if ev.token_id is not None and self.stopped_by is None:
            self.num_tokens += 1
            piece = self.detok.add(ev.token_id) + (self.detok.flush() if finished else "")
            check = self.matcher.push(piece)
            text = check.text
            if check.matched is not None:
                self.stopped_by = check.matched
                out.stop_engine = not finished
            elif finished:
                text += self.matcher.flush()
            out.messages.append(self._token(ev, text))
        if finished:
            out.messages.append(self._finished(ev))
        return out

    def _token(self, ev: TokenEvent, text: str) -> pb.Token:
        token = pb.Token(index=self.index, text=text, token_id=ev.token_id, position=ev.position)
        if self.want_logprobs and ev.logprob is not None:
            token.logprob = ev.logprob
            # The token's own bytes (text above may hold back or merge a split character);
            # a control token adds no text, so no bytes either.
            if not self.tokenizer.is_special(ev.token_id):
                token.token_bytes = self.tokenizer.token_bytes(ev.token_id)
            for t, lp in ev.top_logprobs:
                raw = self.tokenizer.token_bytes(t)
                token.top_logprobs.add(token_id=t, logprob=lp, token_bytes=raw,
                                       text=raw.decode("utf-8", errors="replace"))
        return token

    def _finished(self, ev: TokenEvent) -> pb.Finished:
        reason, detail, completion = ev.finish_reason, ev.finish_detail, ev.num_completion_tokens
        if self.stopped_by is not None:
            reason, detail, completion = FinishReason.STOP, f"stop: {self.stopped_by}", self.num_tokens
        return pb.Finished(
            index=self.index, reason=FINISH_REASONS[reason], detail=detail,
            usage=pb.Usage(prompt_tokens=ev.num_prompt_tokens, completion_tokens=completion,
                           cached_tokens=ev.num_cached_tokens),
            timing=pb.Timing(queue_ms=ev.queue_ms or 0.0, ttft_ms=ev.ttft_ms or 0.0,
                             e2e_ms=ev.e2e_ms or 0.0))
