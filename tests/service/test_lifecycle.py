"""The engine process's life cycle in-process (simulated engine): loading, engine failure,
SIGTERM drain, the drain grace period, and the bounded per-request output buffer."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine.core.outputs import TokenEvent
from genserve.v1 import generate_pb2 as pb
from service.faults import FailingExecutor, InjectedFault, fault_settings
from service.servicer import EventBuffer
from tests.service.harness import collect, request, running_server, sim_builder

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def trailing(err: grpc.aio.AioRpcError) -> dict:
    return dict(err.trailing_metadata() or ())


async def test_generate_is_unavailable_with_retry_after_while_the_engine_loads():
    gate = threading.Event()
    async with running_server(gate=gate, wait=False) as srv:
        assert await srv.health() == NOT_SERVING
        msgs, err = await collect(srv.stub.Generate(request()))
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
        assert "loading" in err.details() and trailing(err)["retry-after"] == "1"
        gate.set()
        await srv.wait_serving()
        msgs, err = await collect(srv.stub.Generate(request(max_tokens=4)))
        assert err is None and msgs[-1].finished.reason == pb.FINISH_REASON_LENGTH


async def test_the_model_loads_on_a_thread_that_ends_before_the_engine_steps():
    # One OpenMP worker pool per thread that ran a parallel region: the loading thread must be
    # gone, and the steps run on the engine's own thread (Engine.start's docstring says why).
    loaded_on, stepped_on = [], set()

    def build(config, model_path=None):
        loaded_on.append(threading.current_thread())
        loaded = sim_builder()(config, model_path)
        loaded.engine.step_listeners.append(lambda *_: stepped_on.add(threading.current_thread()))
        return loaded

    async with running_server(build=build) as srv:
        msgs, err = await collect(srv.stub.Generate(request(max_tokens=4)))
        assert err is None
        await asyncio.to_thread(loaded_on[0].join, 5.0)
        assert not loaded_on[0].is_alive()
        assert loaded_on[0] is not threading.main_thread()
        assert [t.name for t in stepped_on] == ["genserve-scheduler"]


async def test_engine_failure_ends_every_open_stream_with_unavailable_and_exits_1():
    async with running_server(fail_at_step=40) as srv:
        calls = [srv.stub.Generate(request(f"stream {i}", max_tokens=1000)) for i in range(6)]
        results = await asyncio.wait_for(asyncio.gather(*(collect(c) for c in calls)), 30)
        for msgs, err in results:
            assert msgs and msgs[0].HasField("started")
            assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert "injected fault at step 40" in err.details()
            assert trailing(err)["retry-after"] == "1"
        assert sum(m.HasField("token") for msgs, _ in results for m in msgs) > 0
        # After the failure nothing is admitted; the process then exits non-zero.
        _, err = await collect(srv.stub.Generate(request()))
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.wait_for(srv.task, 10) == 1
        assert isinstance(srv.server.engine.error, InjectedFault)
        assert srv.server.engine.pool.num_free == srv.server.engine.pool.num_blocks


async def test_sigterm_drains_open_streams_to_their_end_and_refuses_new_ones():
    async with running_server(drain_grace_s=30) as srv:
        calls = [srv.stub.Generate(request(f"drain {i}", max_tokens=60)) for i in range(4)]
        firsts = [await c.read() for c in calls]
        assert all(m.HasField("started") for m in firsts)
        srv.stop.set()                                       # what SIGTERM does
        await asyncio.sleep(0.05)
        assert await srv.health() == NOT_SERVING
        _, err = await collect(srv.stub.Generate(request()))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
        for call in calls:
            msgs, err = await collect(call)
            assert err is None
            assert msgs[-1].finished.reason == pb.FINISH_REASON_LENGTH
            assert msgs[-1].finished.usage.completion_tokens == 60
        assert await asyncio.wait_for(srv.task, 10) == 0


async def test_streams_still_open_after_the_drain_grace_end_with_unavailable():
    async with running_server(drain_grace_s=0.3) as srv:
        call = srv.stub.Generate(request("long", max_tokens=1000))
        assert (await call.read()).HasField("started")
        srv.stop.set()
        msgs, err = await collect(call)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "grace period" in err.details()
        assert await asyncio.wait_for(srv.task, 10) == 0
        engine = srv.server.engine
        assert engine.stats().running_rows == 0 and engine.pool.num_free == engine.pool.num_blocks


class _Aborted(Exception):
    pass


class FakeContext:
    """Just enough of grpc.aio.ServicerContext to drive `Generate` without a network."""

    def __init__(self) -> None:
        self.code = None
        self.details = ""
        self.trailing = ()

    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = metadata

    def trailing_metadata(self):
        return self.trailing

    async def abort(self, code, details="", trailing_metadata=()):
        self.code, self.details = code, details
        raise _Aborted(details)


async def test_a_reader_that_falls_behind_the_bounded_buffer_is_cancelled():
    async with running_server(max_buffered_events=8, step_s=0.001) as srv:
        servicer = srv.server.servicer
        engine = srv.server.engine
        before = srv.server.metrics.buffer_overflows._value.get()
        ctx = FakeContext()
        stream = servicer.Generate(request("slow reader", max_tokens=500), ctx)
        assert (await stream.__anext__()).HasField("started")
        # The reader waits while the engine fills the 8-event buffer (counted on this event loop
        # as it overflows): a condition, not a fixed time, so a busy machine cannot outrun it.
        deadline = time.monotonic() + 60
        while srv.server.metrics.buffer_overflows._value.get() == before:
            assert time.monotonic() < deadline, "the engine never filled the reader's buffer"
            await asyncio.sleep(0.01)
        received = 0
        with pytest.raises(_Aborted):
            async for msg in stream:
                received += msg.HasField("token")
        assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "output buffer full" in ctx.details
        assert received <= 8
        for _ in range(200):                  # the engine drops the row at its next step
            if engine.pool.num_free == engine.pool.num_blocks:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().running_rows == 0 and engine.pool.num_free == engine.pool.num_blocks
        assert srv.server.metrics.buffer_overflows._value.get() == before + 1


async def test_event_buffer_refuses_past_its_limit_and_failure_comes_first():
    buf = EventBuffer(limit=2)
    assert buf.put(TokenEvent("r", token_id=1)) and buf.put(TokenEvent("r", token_id=2))
    assert not buf.put(TokenEvent("r", token_id=3))
    assert (await buf.get()).token_id == 1
    buf.fail(grpc.StatusCode.UNAVAILABLE, "gone")
    buf.fail(grpc.StatusCode.INTERNAL, "second failure is ignored")
    with pytest.raises(Exception) as info:
        await buf.get()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_failing_executor_fires_once_per_once_file(tmp_path):
    class Inner:
        model = "inner model"

        def execute(self, plan):
            return "ok"

    once = tmp_path / "fired"
    ex = FailingExecutor(Inner(), 2, once)
    assert ex.model == "inner model" and ex.execute(None) == "ok"
    with pytest.raises(InjectedFault):
        ex.execute(None)
    assert once.exists() and ex.execute(None) == "ok"
    again = FailingExecutor(Inner(), 1, once)          # the restarted engine: not armed
    assert again.execute(None) == "ok"
    assert fault_settings(None, None, {"GENSERVE_FAIL_AT_STEP": "7", "GENSERVE_FAIL_ONCE_FILE": "/x"}) == (7, "/x")
    assert fault_settings(3, None, {}) == (3, None)
