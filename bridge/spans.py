"""The request span's events: what a completion's OpenTelemetry span records of its stream.

Each completion is one span ("POST /v1/completions", "POST /v1/chat/completions"); the messages
of its Generate stream add `first_token` and per-sample `finished` events (`SpanNotes`), and a
failure sets the span's error status and an `error` event (`span_error`).
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from genserve.v1 import generate_pb2 as pb


class SpanNotes:
    """Span events for the messages of one stream: first_token once, finished per sample."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.first_token = True

    def on_message(self, msg: pb.GenerateResponse) -> None:
        """Add the span event `msg` makes, if any (its first token; a sample's Finished)."""
        if msg.HasField("token") and self.first_token:
            self.first_token = False
            self.span.add_event("first_token")
        elif msg.HasField("finished"):
            reason = pb.FinishReason.Name(msg.finished.reason).removeprefix("FINISH_REASON_").lower()
            self.span.add_event("finished", {"genserve.index": msg.finished.index,
                                             "genserve.finish_reason": reason,
                                             "genserve.completion_tokens": msg.finished.usage.completion_tokens})


def span_error(span: trace.Span, status_code: int, message: str) -> None:
    """Mark `span` failed with the HTTP status the client got (or would have got) and why."""
    span.set_attribute("http.response.status_code", status_code)
    span.set_status(Status(StatusCode.ERROR, message))
    span.add_event("error", {"http.response.status_code": status_code, "message": message})
