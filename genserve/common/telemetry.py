"""Traces and logs shared by the engine process and the bridge (no torch here).

Tracing (OpenTelemetry): one span per request in the bridge and one in the engine, joined into
one trace by the W3C trace context (`traceparent`) the bridge puts into the gRPC metadata. The
exporter is chosen by `GENSERVE_OTEL_EXPORTER`:

* `off` (default): no SDK is set up; the API's no-op tracer costs next to nothing.
* `console`: spans are printed as JSON to stdout.
* `otlp`: OTLP over HTTP (`pip install 'genserve[otlp]'`); the endpoint and headers come from the
  standard `OTEL_EXPORTER_OTLP_*` variables.

Logs are JSON lines (`GENSERVE_LOG_FORMAT=json`, the default; `text` for a terminal): time,
level, logger, message, and the `request_id` (and `trace_id`) of the request being served.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import os
import sys
from collections.abc import Iterable

from opentelemetry import propagate, trace
from opentelemetry.context import Context

log = logging.getLogger(__name__)

# The id of the request the current task serves (set by the servicer and the bridge).
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("genserve_request_id", default=None)

EXPORTERS = ("off", "console", "otlp")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_STANDARD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, trace_id, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            out["request_id"] = request_id
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            out["trace_id"] = format(span_context.trace_id, "032x")
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in out and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: int | str = logging.INFO, fmt: str | None = None) -> None:
    """Root logging to stderr as JSON lines (or text with fmt="text" / GENSERVE_LOG_FORMAT=text)."""
    fmt = (fmt or os.environ.get("GENSERVE_LOG_FORMAT") or "json").lower()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)


def setup_tracing(service_name: str, exporter: str | None = None):
    """Install an SDK tracer provider with the configured exporter; None when tracing is off.

    Args:
        service_name: the `service.name` resource ("genserve-engine", "genserve-bridge").
        exporter: "off", "console" or "otlp"; default: GENSERVE_OTEL_EXPORTER, else "off".
    """
    kind = (exporter or os.environ.get("GENSERVE_OTEL_EXPORTER") or "off").strip().lower()
    if kind not in EXPORTERS:
        raise ValueError(f"GENSERVE_OTEL_EXPORTER must be one of {', '.join(EXPORTERS)}, got {kind!r}")
    if kind == "off":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if kind == "console":
        span_exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("GENSERVE_OTEL_EXPORTER=otlp but opentelemetry-exporter-otlp-proto-http is not "
                        "installed (pip install 'genserve[otlp]'); tracing is off")
            return None
        span_exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing on: %s exporter", kind)
    return provider


def inject_metadata(metadata: Iterable[tuple[str, str]], span: trace.Span) -> tuple[tuple[str, str], ...]:
    """`metadata` plus the W3C trace context (`traceparent`, `tracestate`) of `span`."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(metadata) + tuple(carrier.items())


def extract_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context carried in gRPC metadata (an empty context when there is none)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
