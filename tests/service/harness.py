"""An in-process engine server for service tests: the real servicer and life cycle over a
simulated engine (SimExecutor paced in real time, a byte tokenizer), on a free localhost port.

No model is loaded, so these tests take milliseconds per request. The engine is the real
`engine.core.engine.Engine` with the real scheduler and block pool; only the forward pass is a cost
model (`SimExecutor`), slept for `step_s` so streams stay open long enough to interact with.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.sim_executor import SimExecutor
from engine.runner.builder import LoadedEngine
from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from engine.tokenizer import ByteTokenizer
from service.server import EngineServer

VOCAB = 32000


class PacedExecutor:
    """SimExecutor that really takes `step_s` seconds per step."""

    def __init__(self, step_s: float) -> None:
        self.sim = SimExecutor(vocab_size=VOCAB)
        self.step_s = step_s

    def execute(self, plan):
        time.sleep(self.step_s)
        return self.sim.execute(plan)


def sim_builder(step_s: float = 0.005, gate: threading.Event | None = None) -> Callable:
    """A `build` for EngineServer: a simulated engine; waits for `gate` first (a slow load)."""
    def build(config: EngineConfig, model_path=None) -> LoadedEngine:
        if gate is not None:
            gate.wait(30)
        engine = Engine(config, PacedExecutor(step_s))
        return LoadedEngine(engine, ByteTokenizer(VOCAB), SimpleNamespace(vocab_size=VOCAB), "sim")
    return build


@dataclass
class Running:
    """A running EngineServer: its target, the stop event, and the task returning the exit code."""

    server: EngineServer
    target: str
    stop: asyncio.Event
    task: asyncio.Task
    channel: grpc.aio.Channel

    @property
    def stub(self) -> pb_grpc.GenerateServiceStub:
        return pb_grpc.GenerateServiceStub(self.channel)

    async def health(self) -> int:
        reply = await health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service="genserve.v1.GenerateService"), timeout=2)
        return reply.status

    async def wait_serving(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while await self.health() != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "engine server not SERVING"
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running_server(num_blocks: int = 256, step_s: float = 0.005, gate: threading.Event | None = None,
                         wait: bool = True, build: Callable | None = None, **options):
    """Start an EngineServer over a simulated engine (or what `build` returns); yields `Running`;
    stops it afterwards."""
    config = EngineConfig(num_blocks=num_blocks, queue_budget_s=600.0)
    server = EngineServer(config, "127.0.0.1", 0, build=build or sim_builder(step_s, gate), **options)
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    while not server.port:
        assert not task.done(), task
        await asyncio.sleep(0.005)
    target = f"127.0.0.1:{server.port}"
    channel = grpc.aio.insecure_channel(target)
    running = Running(server, target, stop, task, channel)
    try:
        if wait:
            await running.wait_serving()
        yield running
    finally:
        stop.set()
        if gate is not None:
            gate.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        await channel.close()


def request(prompt: str = "hello", max_tokens: int = 8, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens,
                              sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True), **kw)


async def collect(call) -> tuple[list[pb.GenerateResponse], grpc.aio.AioRpcError | None]:
    """Every message of a Generate call, and the error it ended with (None if it ended OK)."""
    msgs = []
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            msgs.append(msg)
    except grpc.aio.AioRpcError as err:
        return msgs, err
    return msgs, None
