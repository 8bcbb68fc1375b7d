"""Several Generate calls read as one stream: a completion with a list of prompts.

OpenAI's /v1/completions takes several prompts in one request and answers with their choices
prompt-major, then by `n` (choice index = prompt index × samples + sample index). The bridge sends
one Generate call per prompt (each is admitted, scheduled and cancelled on its own in the engine)
and `CallGroup` reads them as if they were one call: its first `read` returns one Started for
them all (the first call's request id, the prompts' tokens summed, each prompt's count kept in
`prompt_tokens`), later reads return the calls' messages as they arrive, their sample indices
moved to the choice indices and their request id set to the group's. `cancel` cancels every call.
While the group runs, `BridgeState.groups` maps its id to the calls' ids, so
`DELETE /v1/requests/{id}` cancels them all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc

from genserve.v1 import generate_pb2 as pb


class CallGroup:
    """`calls` (one per prompt, each drawing `samples` samples) read as one stream.

    Args:
        calls: the Generate calls, in prompt order.
        samples: samples each call draws (its GenerateRequest's n).
        on_ids: called once with (group id, every call's id) when all have started.
        on_close: called once when the group ends (every call at EOF) or is cancelled.
    """

    def __init__(self, calls: list[grpc.aio.UnaryStreamCall], samples: int,
                 on_ids: Callable[[str, list[str]], None] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self._calls = calls
        self._samples = samples
        self._on_ids = on_ids
        self._on_close = on_close
        self._closed = False
        self.request_id = ""
        self.request_ids: list[str] = []
        self.prompt_tokens: list[int] = []
        self._reads: dict[asyncio.Future, int] = {}
        self._open = set(range(len(calls)))

    async def read(self):
        """The next message (see the module doc), or grpc.aio.EOF once every call has ended.
        Raises what a call's `read` raises."""
        if not self.request_ids:
            return await self._start()
        while self._open:
            if not self._reads:
                for k in sorted(self._open):
                    self._reads[asyncio.ensure_future(self._calls[k].read())] = k
            done, _ = await asyncio.wait(self._reads, return_when=asyncio.FIRST_COMPLETED)
            read = min(done, key=lambda f: self._reads[f])      # the earliest prompt first
            k = self._reads.pop(read)
            msg = read.result()
            if msg is grpc.aio.EOF:
                self._open.discard(k)
                continue
            self._reads[asyncio.ensure_future(self._calls[k].read())] = k
            return self._reindex(k, msg)
        self._close()
        return grpc.aio.EOF

    async def _start(self) -> pb.GenerateResponse:
        """Every call's Started, as one."""
        for call in self._calls:
            msg = await call.read()
            if msg is grpc.aio.EOF or not msg.HasField("started"):
                return msg
            self.request_ids.append(msg.started.request_id or msg.request_id)
            self.prompt_tokens.append(msg.started.prompt_tokens)
            lora = msg.started.lora                 # every call names the same model
        self.request_id = self.request_ids[0]
        if self._on_ids is not None:
            self._on_ids(self.request_id, self.request_ids)
        return pb.GenerateResponse(request_id=self.request_id, started=pb.Started(
            request_id=self.request_id, prompt_tokens=sum(self.prompt_tokens), lora=lora))

    def _reindex(self, k: int, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        msg.request_id = self.request_id
        kind = msg.WhichOneof("event")
        if kind == "token":
            msg.token.index += k * self._samples
        elif kind == "finished":
            msg.finished.index += k * self._samples
        elif kind == "prompt_logprobs":
            msg.prompt_logprobs.index += k * self._samples
        return msg

    def cancel(self) -> bool:
        """Cancel every call (and the reads in flight)."""
        for read in self._reads:
            read.cancel()
        self._reads.clear()
        cancelled = False
        for call in self._calls:
            cancelled = call.cancel() or cancelled
        self._close()
        return cancelled

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                with contextlib.suppress(Exception):
                    self._on_close()
