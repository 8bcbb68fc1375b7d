"""Traces and logs: one trace per request from the bridge through the engine (W3C trace context in
the gRPC metadata), with the request's events, checked with the SDK's in-memory exporter; JSON log
lines carry the request id."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bridge.app import create_app
from genserve.common import telemetry
from genserve.common.telemetry import JsonFormatter, REQUEST_ID, extract_metadata, inject_metadata
from service.servicer import GENERATE_SPAN
from tests.service.harness import collect, request, running_server


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


async def _post(srv, tracer, body: dict) -> httpx.Response:
    app = create_app(srv.target, tracer=tracer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bridge",
                                     timeout=30) as client:
            return await client.post("/v1/completions", json=body)


def _events(span) -> list[str]:
    return [e.name for e in span.events]


@pytest.mark.parametrize("stream", [True, False])
async def test_one_trace_per_request_from_the_bridge_through_the_engine(spans, stream):
    tracer, exporter = spans
    async with running_server(tracer=tracer) as srv:
        resp = await _post(srv, tracer, {"prompt": "hello", "max_tokens": 5, "stream": stream})
        assert resp.status_code == 200
    finished = exporter.get_finished_spans()
    bridge = [s for s in finished if s.name == "POST /v1/completions"]
    engine = [s for s in finished if s.name == GENERATE_SPAN]
    assert len(bridge) == 1 and len(engine) == 1
    bridge, engine = bridge[0], engine[0]
    assert engine.context.trace_id == bridge.context.trace_id
    assert engine.parent is not None and engine.parent.span_id == bridge.context.span_id
    assert engine.kind == trace.SpanKind.SERVER and bridge.kind == trace.SpanKind.SERVER
    assert engine.attributes["genserve.request_id"] == bridge.attributes["genserve.request_id"]
    assert _events(engine) == ["queued", "admitted", "first_token", "finished"]
    assert _events(bridge) == ["started", "first_token", "finished"]
    finish = engine.events[-1].attributes
    assert finish["genserve.finish_reason"] == "length" and finish["genserve.completion_tokens"] == 5
    assert bridge.events[-1].attributes["genserve.finish_reason"] == "length"
    assert bridge.end_time >= engine.end_time


async def test_preemption_shows_as_span_events(spans):
    tracer, exporter = spans
    # 12 blocks of 16 tokens: three 40-token prompts fit, their answers do not: the newest is
    # preempted, re-admitted later, and finishes.
    async with running_server(num_blocks=12, tracer=tracer) as srv:
        calls = [srv.stub.Generate(request("x" * 40 + str(i), max_tokens=100)) for i in range(3)]
        for call in calls:
            msgs, err = await collect(call)
            assert err is None and msgs[-1].finished.usage.completion_tokens == 100
        engine = srv.server.engine
        assert engine.stats().num_preemptions > 0
    events = [_events(s) for s in exporter.get_finished_spans() if s.name == GENERATE_SPAN]
    assert len(events) == 3
    preempted = [e for e in events if "preempted" in e]
    assert preempted, events
    for e in preempted:
        assert e.index("admitted") < e.index("preempted") < e.index("readmitted") < e.index("finished")


async def test_errors_mark_both_spans(spans):
    tracer, exporter = spans
    async with running_server(tracer=tracer) as srv:
        resp = await _post(srv, tracer, {"prompt": "hello", "max_tokens": 5000})
        assert resp.status_code == 400
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert by_name[GENERATE_SPAN].status.status_code == trace.StatusCode.ERROR
    assert "max_tokens" in by_name[GENERATE_SPAN].status.description
    bridge = by_name["POST /v1/completions"]
    assert bridge.status.status_code == trace.StatusCode.ERROR
    assert bridge.attributes["http.response.status_code"] == 400


def test_trace_context_round_trips_through_grpc_metadata(spans):
    tracer, _ = spans
    span = tracer.start_span("parent")
    metadata = inject_metadata((("authorization", "Bearer k"),), span)
    keys = dict(metadata)
    assert keys["authorization"] == "Bearer k" and keys["traceparent"].startswith("00-")
    ctx = extract_metadata(metadata + (("binary-bin", b"\x00"),))
    assert trace.get_current_span(ctx).get_span_context().trace_id == span.get_span_context().trace_id
    assert not trace.get_current_span(extract_metadata(())).get_span_context().is_valid
    span.end()


def test_json_log_lines_carry_the_request_id(spans):
    tracer, _ = spans
    formatter = JsonFormatter()
    record = logging.LogRecord("genserve.x", logging.INFO, __file__, 1, "done %s", ("ok",), None)
    record.finish_reason = "length"
    token = REQUEST_ID.set("cmpl-123")
    try:
        with trace.use_span(tracer.start_span("s"), end_on_exit=True):
            line = json.loads(formatter.format(record))
    finally:
        REQUEST_ID.reset(token)
    assert line["message"] == "done ok" and line["level"] == "INFO" and line["logger"] == "genserve.x"
    assert line["request_id"] == "cmpl-123" and line["finish_reason"] == "length"
    assert len(line["trace_id"]) == 32
    explicit = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom", (), None)
    explicit.request_id = "cmpl-9"
    try:
        raise ValueError("bad")
    except ValueError:
        import sys
        explicit.exc_info = sys.exc_info()
    line = json.loads(formatter.format(explicit))
    assert line["request_id"] == "cmpl-9" and "ValueError: bad" in line["exc"]


async def test_the_servicer_logs_one_line_per_finished_request(caplog):
    caplog.set_level(logging.INFO, logger="service.servicer")
    async with running_server() as srv:
        msgs, err = await collect(srv.stub.Generate(request("hi", max_tokens=3, request_id="cmpl-log-test")))
        assert err is None
    lines = [r for r in caplog.records if r.getMessage() == "request finished"]
    assert len(lines) == 1 and lines[0].request_id == "cmpl-log-test"
    assert lines[0].finish_reason == "length" and lines[0].completion_tokens == 3
    assert json.loads(JsonFormatter().format(lines[0]))["request_id"] == "cmpl-log-test"


def test_tracing_is_off_by_default_and_the_exporter_is_checked(monkeypatch):
    monkeypatch.delenv("GENSERVE_OTEL_EXPORTER", raising=False)
    assert telemetry.setup_tracing("t") is None
    assert telemetry.setup_tracing("t", "off") is None
    with pytest.raises(ValueError, match="GENSERVE_OTEL_EXPORTER"):
        telemetry.setup_tracing("t", "jaeger")
    installed = []
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", installed.append)
    provider = telemetry.setup_tracing("genserve-test", "console")
    assert installed == [provider] and provider.resource.attributes["service.name"] == "genserve-test"
    provider.shutdown()
