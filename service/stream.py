"""One sample's stream: TokenEvents in, gRPC Token and Finished messages out."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.outputs import FinishReason, TokenEvent
from genserve.v1 import generate_pb2 as pb
from service.detokenizer import IncrementalDetokenizer
from service.stop import StopCheck, StopMatcher

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How a sample's tokens become text.

    Attributes:
        stops: stop strings (up to 4).
        include_stop: the matched stop string, or the text of the token that stopped the sample
            (EOS, a `stop_token_ids` id), stays in the output (vLLM's `include_stop_str_in_output`).
        skip_special_tokens: control tokens add no text.
        min_tokens: stop strings do not match before this many tokens (vLLM's rule: the check
            starts at the `min_tokens`-th token).
    """

    stops: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0


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
        options: stop strings and the other text settings of the request.
        want_logprobs: whether Token messages carry logprobs.

    After a stop string matched, later tokens of this sample (at most the one step the engine
    needs to see the flag) are dropped, and the Finished message says STOP with the usage
    counted up to the matching token. A sample the engine ended with STOP ended on a stop token
    (EOS or a `stop_token_ids` id): that token's text is dropped unless `include_stop`, as vLLM
    does.
    """

    def __init__(self, index: int, tokenizer, options: TextOptions, want_logprobs: bool) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.options = options
        self.detok = IncrementalDetokenizer(tokenizer, options.skip_special_tokens)
        self.matcher = StopMatcher(options.stops, options.include_stop)
        self.want_logprobs = want_logprobs
        self.num_tokens = 0
        self.stopped_by: str | None = None

    def on_event(self, ev: TokenEvent) -> StreamOutput:
        """Messages for `ev` (a token and/or the end of this sample)."""
        out = StreamOutput()
        finished = ev.finish_reason is not None
        if ev.token_id is not None and self.stopped_by is None:
            self.num_tokens += 1
            stop_token = ev.finish_reason == FinishReason.STOP and not self.options.include_stop
            piece = "" if stop_token else self.detok.add(ev.token_id)
            if finished:
                piece += self.detok.flush()
            if self.num_tokens < self.options.min_tokens:
                check = StopCheck(self.matcher.flush() + piece)
            else:
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

    def prompt_logprobs(self, ev: TokenEvent, prompt_ids: list[int]) -> pb.PromptLogprobs:
        """The PromptLogprobs message of `ev` (`TokenEvent.prompt_logprobs`): one Token per
        prompt token, each with its own text and bytes (a token holding part of a character
        shows U+FFFD in `text`; its `token_bytes` are exact)."""
        msg = pb.PromptLogprobs(index=self.index)
        for position, token_id in enumerate(prompt_ids):
            raw = self.tokenizer.token_bytes(token_id)
            token = msg.tokens.add(token_id=token_id, position=position, token_bytes=raw,
                                   text=raw.decode("utf-8", errors="replace"))
            if position == 0:
                continue
            lp, top = ev.prompt_logprobs[position - 1]
            token.logprob = lp
            for t, alt in top:
                alt_raw = self.tokenizer.token_bytes(t)
                token.top_logprobs.add(token_id=t, logprob=alt, token_bytes=alt_raw,
                                       text=alt_raw.decode("utf-8", errors="replace"))
        return msg

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
            timing=pb.Timing(queue_ms=ev.queue_ms or 0.0, ttft_ms=ev.ttft_ms, e2e_ms=ev.e2e_ms or 0.0))
