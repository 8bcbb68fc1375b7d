"""The soak: the design's request mix through Envoy at ~70 % of measured capacity, for a long time.

`python -m loadgen.soak --duration-s 3600 --out DIR` (`make soak`) starts `genserve serve` (or
drives one given by `--base-url`/`--grpc-target`/`--supervisor-pid`), measures its capacity with
a short closed-loop probe (`--probe-s`; or takes `--capacity-rps`), then sends open-loop Poisson
arrivals at `--load` (0.7) of it for `--duration-s`: prompts and answers from the design's length
mix (`LengthMix.design(--scale)`, exact lengths via `ignore_eos`), keys round-robin, some n = 2,
some over gRPC, a fifth of the clients disconnecting mid-stream and some cancelling with
DELETE /v1/requests/{id} (gRPC: Cancel). Every `--sample-s` it records the engine's and the
bridge's resident memory and the free KV blocks.

Given LoRA adapters (`--adapter NAME=PATH`, PEFT directories for the served model), a third of the
way into the load it loads and unloads each in turn through the admin endpoints
(`--admin-key`): POST /v1/load_lora_adapter, `ADAPTER_STREAMS` streams on it (REST, `model` the
adapter), POST /v1/unload_lora_adapter once each has its first token, then
`AFTER_UNLOAD_REQUESTS` requests naming it, each to be a 404 model_not_found, while the streams
run on to their last token.

At the end it checks (`SoakResult.checks`, all must hold):

* free KV blocks are the whole pool again, and no request runs or waits;
* the engine's and the bridge's RSS are flat after the warm-up (`--warmup-s`, 600 s for an hour):
  the median of the last tenth of the samples is within `--rss-tolerance` (5 %) of the median of
  the first minute after the warm-up;
* no 5xx (HTTP) and no UNAVAILABLE/INTERNAL/UNKNOWN (gRPC);
* no transport error other than the planned disconnects;
* every served request's events are complete: each sample finished (`finish_reason`, and
  "cancelled" for the cancelled ones), then [DONE]; the engine counted every accepted sample
  finished exactly once (the adapter streams included);
* with adapters: each loaded and unloaded (200 each), every stream on it complete with all its
  tokens through the unload, every request after the unload a 404 model_not_found.

It writes `soak.json` (settings, counts, checks, the samples) and `soak.png` (RSS and free blocks
over time) into `--out`, and exits 1 when a check fails. The suite runs a one-minute version
(tests/e2e/test_soak.py; longer where a minute's plan is too thin).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import pathlib
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import grpc
import httpx
import psutil

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from loadgen.metrics import parse_metrics, wait_idle
from loadgen.workload import LengthMix, WorkItem, arrival_times, synthetic_workload

DISCONNECT_SHARE = 0.2     # the design's: a fifth of the clients leave mid-stream
CANCEL_SHARE = 0.05        # ... and some cancel with DELETE / Cancel
GRPC_SHARE = 0.15          # requests sent over gRPC (the rest REST + SSE)
N2_SHARE = 0.05            # requests asking for n = 2 samples
LOAD = 0.7                 # share of the measured capacity
PROBE_WORKERS = 28         # closed-loop clients of the capacity probe (just under the 32-row cap)
GRPC_FAILURES = {"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DATA_LOSS"}   # gRPC's 5xx
ADAPTER_STREAMS = 3        # streams on each adapter when it is unloaded
ADAPTER_TOKENS = 24        # tokens each of them asks for (it runs on well past the unload)
AFTER_UNLOAD_REQUESTS = 2  # requests naming each adapter after its unload: 404 each
FIRST_TOKEN_WAIT_S = 120.0 # the most the phase waits for its streams' first tokens before unloading


@dataclass
class Target:
    """A running genserve: its public REST and gRPC addresses (Envoy) and its supervisor's pid
    (the engine and the bridge are its children)."""

    base_url: str
    grpc_target: str
    supervisor_pid: int


@dataclass
class Outcome:
    """What happened to one request: `kind` is "complete", "disconnected", "cancelled" (complete,
    every sample finished "cancelled" or earlier), "rejected" (429), "http_5xx", "grpc_failure",
    "client_error" (another 4xx), "incomplete" (the stream ended early) or "transport" (an
    exception); `samples`: n; `accepted`: the engine took it."""

    kind: str
    samples: int
    accepted: bool
    detail: str = ""


@dataclass
class SoakResult:
    """Figures of one soak: settings, outcome counts, samples and checks (name -> passed, why)."""

    settings: dict
    counts: dict[str, int]
    samples: list[dict] = field(default_factory=list)
    checks: dict[str, dict] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every check held."""
        return all(c["ok"] for c in self.checks.values())


def children(supervisor_pid: int) -> tuple[psutil.Process, psutil.Process]:
    """The (engine, bridge) processes under a `genserve serve` supervisor.

    Raises:
        LookupError: one of them is not running.
    """
    engine = bridge = None
    for child in psutil.Process(supervisor_pid).children():
        cmd = child.cmdline()
        if "service" in cmd:
            engine = child
        elif "bridge" in cmd:
            bridge = child
    if engine is None or bridge is None:
        raise LookupError(f"no engine and bridge under pid {supervisor_pid}")
    return engine, bridge


@dataclass(frozen=True)
class Plan:
    """One request of the soak: the work item and how its client behaves."""

    item: WorkItem
    grpc: bool
    n: int
    temperature: float
    disconnect_after: int | None      # leave after this many tokens
    cancel_after: int | None          # DELETE / Cancel after this many tokens, read on
    model: str = ""                   # REST `model` (a LoRA adapter's name); "": none sent


def plans(items: Sequence[WorkItem], seed: int) -> list[Plan]:
    """The client behaviour of each item (seeded): the shares above."""
    rng = random.Random(seed)
    out = []
    for item in items:
        leave = rng.random()
        k = rng.randint(1, max(1, item.output_tokens - 1))
        out.append(Plan(item, grpc=rng.random() < GRPC_SHARE, n=2 if rng.random() < N2_SHARE else 1,
                        temperature=rng.choice([0.0, 0.7, 1.0]),
                        disconnect_after=k if leave < DISCONNECT_SHARE and item.output_tokens > 1 else None,
                        cancel_after=k if DISCONNECT_SHARE <= leave < DISCONNECT_SHARE + CANCEL_SHARE
                        and item.output_tokens > 1 else None))
    return out


async def rest_request(client: httpx.AsyncClient, base_url: str, plan: Plan,
                       first_token: asyncio.Event | None = None) -> Outcome:
    """One request over REST + SSE (see `Plan`); `first_token`, when given, is set once the
    first token arrives or the request ends."""
    try:
        return await _rest_stream(client, base_url, plan, first_token)
    finally:
        if first_token is not None:
            first_token.set()


async def _rest_stream(client: httpx.AsyncClient, base_url: str, plan: Plan,
                       first_token: asyncio.Event | None) -> Outcome:
    item = plan.item
    body = {"prompt": item.prompt_ids(), "max_tokens": item.output_tokens, "ignore_eos": True,
            "temperature": plan.temperature, "seed": item.index, "n": plan.n, "stream": True}
    if plan.model:
        body["model"] = plan.model
    headers = {"Authorization": f"Bearer {item.api_key}"} if item.api_key else {}
    async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:200]
            kind = "rejected" if r.status_code == 429 else "http_5xx" if r.status_code >= 500 else "client_error"
            return Outcome(kind, plan.n, False, f"{r.status_code} {text}")
        request_id = r.headers.get("x-request-id", "")
        tokens, reasons, event, cancelled = 0, [], None, False
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                if event == "error":
                    return Outcome("http_5xx" if '"code":"unavailable"' in data or "internal" in data
                                   else "incomplete", plan.n, True, data[:200])
                if data == "[DONE]":
                    return _ended(plan, reasons, cancelled)
                ev = json.loads(data)
                if "token_id" in ev:
                    tokens += 1
                    if first_token is not None:
                        first_token.set()
                    if plan.disconnect_after is not None and tokens >= plan.disconnect_after:
                        return Outcome("disconnected", plan.n, True)
                    if plan.cancel_after is not None and tokens >= plan.cancel_after and not cancelled:
                        cancelled = True
                        await client.delete(f"{base_url}/v1/requests/{request_id}", headers=headers)
                elif ev.get("finish_reason"):
                    reasons.append(ev["finish_reason"])
        return Outcome("incomplete", plan.n, True, "no [DONE]")


async def adapter_phase(target: Target, adapters: Sequence[tuple[str, str]], admin_key: str,
                        items: Iterator[WorkItem]) -> tuple[dict, list[Outcome]]:
    """Load, stream on, unload and ask again for each adapter (name, directory) in turn (the
    module doc), with `admin_key` ("": none sent); the streams' prompts are `items`' (their
    answers `ADAPTER_TOKENS` long). Returns the check's figures and the streams' outcomes."""
    base = target.base_url
    admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    figures = {"loaded": 0, "unloaded": 0, "streams": 0, "streams_complete": 0, "not_found": 0, "errors": []}
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=3600) as client:
        for name, path in adapters:
            r = await client.post(f"{base}/v1/load_lora_adapter", headers=admin,
                                  json={"lora_name": name, "lora_path": path})
            if r.status_code != 200:
                figures["errors"].append(f"load {name}: {r.status_code} {r.text[:200]}")
                continue
            figures["loaded"] += 1
            firsts = [asyncio.Event() for _ in range(ADAPTER_STREAMS)]
            streams = [asyncio.create_task(rest_request(client, base, Plan(
                dataclasses.replace(next(items), output_tokens=ADAPTER_TOKENS), grpc=False, n=1,
                temperature=0.0, disconnect_after=None, cancel_after=None, model=name), first))
                for first in firsts]
            try:                      # a stalled server fails the phase instead of hanging it
                await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), FIRST_TOKEN_WAIT_S)
            except asyncio.TimeoutError:
                figures["errors"].append(f"{name}: no first token on every stream in {FIRST_TOKEN_WAIT_S:.0f} s")
            r = await client.post(f"{base}/v1/unload_lora_adapter", headers=admin, json={"lora_name": name})
            if r.status_code == 200:
                figures["unloaded"] += 1
            else:
                figures["errors"].append(f"unload {name}: {r.status_code} {r.text[:200]}")
            for _ in range(AFTER_UNLOAD_REQUESTS):
                r = await client.post(f"{base}/v1/completions", headers=admin,
                                      json={"model": name, "prompt": [1, 2, 3], "max_tokens": 2})
                code = r.json().get("error", {}).get("code") if r.status_code == 404 else None
                if code == "model_not_found":
                    figures["not_found"] += 1
                else:
                    figures["errors"].append(f"after unloading {name}: {r.status_code} {r.text[:200]}")
            for out in await asyncio.gather(*streams):
                outcomes.append(out)
                figures["streams"] += 1
                figures["streams_complete"] += out.kind == "complete"
                if out.kind != "complete":
                    figures["errors"].append(f"stream on {name}: {out.kind} {out.detail}")
    expected = len(adapters)
    figures["ok"] = (figures["loaded"] == figures["unloaded"] == expected
                     and figures["streams_complete"] == expected * ADAPTER_STREAMS
                     and figures["not_found"] == expected * AFTER_UNLOAD_REQUESTS and not figures["errors"])
    figures["errors"] = figures["errors"][:10]
    return figures, outcomes


def soak_plans(rate_rps: float, duration_s: float, mix: LengthMix, keys: Sequence[str], seed: int) -> list[Plan]:
    """The seeded requests of a soak: Poisson arrivals at `rate_rps` (requests/s) for `duration_s`
    seconds, lengths from `mix`, keys in turn, and each one's client behaviour (`plans`)."""
    items = synthetic_workload(arrival_times(rate_rps, duration_s=duration_s, seed=seed), mix, keys, seed=seed)
    return plans(items, seed)


def _ended(plan: Plan, reasons: list[str], cancelled: bool) -> Outcome:
    """The outcome of a stream that ended normally with these finish reasons."""
    if len(reasons) != plan.n:
        return Outcome("incomplete", plan.n, True, f"{len(reasons)} of {plan.n} samples finished")
    if cancelled:
        return Outcome("cancelled", plan.n, True)
    if any(r not in ("length", "stop") for r in reasons):
        return Outcome("incomplete", plan.n, True, f"finish reasons {reasons}")
    return Outcome("complete", plan.n, True)


async def grpc_request(stub: pb_grpc.GenerateServiceStub, plan: Plan) -> Outcome:
    """One request over gRPC (see `Plan`)."""
    item = plan.item
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=item.prompt_ids()), max_tokens=item.output_tokens,
                             n=plan.n, sampling=pb.SamplingParams(temperature=plan.temperature, seed=item.index,
                                                                  ignore_eos=True))
    metadata = (("authorization", f"Bearer {item.api_key}"),) if item.api_key else ()
    call = stub.Generate(req, metadata=metadata, timeout=3600)
    accepted, tokens, reasons, cancelled, request_id = False, 0, [], False, ""
    try:
        async for msg in call:
            if msg.HasField("started"):
                accepted, request_id = True, msg.started.request_id
            elif msg.HasField("token"):
                tokens += 1
                if plan.disconnect_after is not None and tokens >= plan.disconnect_after:
                    call.cancel()
                    return Outcome("disconnected", plan.n, True)
                if plan.cancel_after is not None and tokens >= plan.cancel_after and not cancelled:
                    cancelled = True
                    await stub.Cancel(pb.CancelRequest(request_id=request_id), metadata=metadata, timeout=30)
            elif msg.HasField("finished"):
                reasons.append(pb.FinishReason.Name(msg.finished.reason).removeprefix("FINISH_REASON_").lower())
    except grpc.aio.AioRpcError as err:
        code = err.code().name
        kind = "rejected" if code == "RESOURCE_EXHAUSTED" else "grpc_failure" if code in GRPC_FAILURES \
            else "client_error"
        return Outcome(kind, plan.n, accepted, f"{code} {err.details()}")
    return _ended(plan, reasons, cancelled)


async def _drive(target: Target, todo: Sequence[Plan], closed_loop_s: float | None = None
                 ) -> list[Outcome]:
    """Send `todo` at their arrival times (open loop), or, with `closed_loop_s`, from
    PROBE_WORKERS clients back to back for that long; returns every outcome."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client, \
            grpc.aio.insecure_channel(target.grpc_target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)

        async def one(plan: Plan) -> None:
            try:
                out = await (grpc_request(stub, plan) if plan.grpc else rest_request(client, target.base_url, plan))
            except Exception as exc:  # noqa: BLE001 - every other failure is a transport error
                out = Outcome("transport", plan.n, True, repr(exc)[:200])
            outcomes.append(out)

        start = time.monotonic()
        if closed_loop_s is not None:
            queue = iter(todo)

            async def worker() -> None:
                while time.monotonic() - start < closed_loop_s:
                    plan = next(queue, None)
                    if plan is None:
                        return
                    await one(plan)

            await asyncio.gather(*(worker() for _ in range(PROBE_WORKERS)))
        else:
            tasks = []
            for plan in todo:
                delay = plan.item.arrival_s - (time.monotonic() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(plan)))
            await asyncio.gather(*tasks)
    return outcomes


def measure_capacity(target: Target, probe_s: float, mix: LengthMix, keys: Sequence[str], seed: int) -> float:
    """Requests per second the server completes with PROBE_WORKERS closed-loop clients sending
    the mix (no disconnects) for `probe_s` seconds."""
    items = synthetic_workload([0.0] * 100_000, mix, keys, seed=seed + 7)
    todo = [Plan(i, grpc=False, n=1, temperature=0.0, disconnect_after=None, cancel_after=None) for i in items]
    start = time.monotonic()
    outcomes = asyncio.run(_drive(target, todo, closed_loop_s=probe_s))
    elapsed = time.monotonic() - start
    done = sum(1 for o in outcomes if o.kind == "complete")
    if not done:
        raise RuntimeError(f"the capacity probe completed no request: {outcomes[:3]}")
    return done / elapsed


async def _sample(target: Target, every_s: float, stop: asyncio.Event, out: list[dict]) -> None:
    """Every `every_s` seconds: engine and bridge RSS (bytes) and free KV blocks."""
    engine, bridge = children(target.supervisor_pid)
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            text = (await client.get(f"{target.base_url}/metrics")).text
            free = parse_metrics(text)["genserve_kv_blocks_free"]
            out.append({"t_s": round(time.monotonic() - start, 3), "engine_rss": engine.memory_info().rss,
                        "bridge_rss": bridge.memory_info().rss, "kv_blocks_free": free})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


async def _soak(target: Target, todo: Sequence[Plan], sample_s: float, samples: list[dict],
                adapters: Sequence[tuple[str, str]] = (), admin_key: str = "", adapters_at_s: float = 0.0,
                adapter_items: Iterator[WorkItem] = iter(())) -> tuple[list[Outcome], dict | None]:
    """The load, the samples and, with `adapters`, `adapter_phase` from `adapters_at_s` on.
    Returns every outcome (the adapter streams' included) and the phase's figures (None
    without adapters)."""
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(target, sample_s, stop, samples))

    async def phase() -> tuple[dict, list[Outcome]] | None:
        if not adapters:
            return None
        await asyncio.sleep(adapters_at_s)
        return await adapter_phase(target, adapters, admin_key, adapter_items)

    try:
        outcomes, lora = await asyncio.gather(_drive(target, todo), phase())
    finally:
        stop.set()
        await sampler
    if lora is None:
        return outcomes, None
    return outcomes + lora[1], lora[0]


def rss_growth(samples: Sequence[dict], key: str, warmup_s: float) -> float:
    """Relative RSS growth after the warm-up: median of the last tenth of the samples over the
    median of the first minute after `warmup_s` (at least 3 samples), minus 1.

    Raises:
        ValueError: no sample after the warm-up.
    """
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 3:
        raise ValueError(f"no samples after the {warmup_s} s warm-up")
    first = [s[key] for s in after if s["t_s"] < after[0]["t_s"] + 60] or [after[0][key]]
    first = first if len(first) >= 3 else [s[key] for s in after[:3]]
    last = [s[key] for s in after[-max(3, len(after) // 10):]]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return median(last) / median(first) - 1.0


def run_soak(target: Target, *, duration_s: float, capacity_rps: float | None = None, probe_s: float = 60.0,
             load: float = LOAD, scale: float = 0.064, warmup_s: float = 600.0, rss_tolerance: float = 0.05,
             sample_s: float = 5.0, keys: Sequence[str] = ("",), seed: int = 0,
             adapters: Sequence[tuple[str, str]] = (), admin_key: str = "") -> SoakResult:
    """Run the soak against `target` (see the module doc) and check its end state.

    Args:
        duration_s: seconds of arrivals (the run lasts until the last request ends).
        capacity_rps: the server's capacity, requests/s; None: measured (`measure_capacity`).
        probe_s: length of that measurement, seconds.
        load: share of the capacity to send.
        scale: `LengthMix.design` scale (1: the design's 50..8,000-token prompts; 0.064 for CPU).
        warmup_s: RSS samples before this are not held to the flatness bound.
        rss_tolerance: largest relative RSS growth after the warm-up (`rss_growth`).
        sample_s: seconds between samples.
        keys: API keys, round-robin ("" sends none).
        adapters: (name, directory) of LoRA adapters for the served model: loaded and unloaded
            under the load (`adapter_phase`), a third of `duration_s` in; () for no such phase.
        admin_key: the key the adapter phase authenticates with ("" sends none: a server
            without keys takes every caller as an admin).
    Raises:
        RuntimeError: the capacity probe completed nothing.
    """
    mix = LengthMix.design(scale)
    if capacity_rps is None:
        capacity_rps = measure_capacity(target, probe_s, mix, keys, seed)
    rate = load * capacity_rps
    before = wait_idle(target.base_url)
    todo = soak_plans(rate, duration_s, mix, keys, seed)
    samples: list[dict] = []
    start = time.monotonic()
    adapter_items = iter(synthetic_workload([0.0] * (len(adapters) * ADAPTER_STREAMS), mix, keys, seed=seed + 11))
    outcomes, lora = asyncio.run(_soak(target, todo, sample_s, samples, adapters, admin_key,
                                       duration_s / 3, adapter_items))
    after = wait_idle(target.base_url)
    counts = {k: sum(1 for o in outcomes if o.kind == k) for k in sorted({o.kind for o in outcomes})}
    settings = {"duration_s": duration_s, "capacity_rps": round(capacity_rps, 4), "rate_rps": round(rate, 4),
                "load": load, "scale": scale, "warmup_s": warmup_s, "rss_tolerance": rss_tolerance,
                "sample_s": sample_s, "requests": len(todo), "wall_s": round(time.monotonic() - start, 1),
                "seed": seed, "adapters": [name for name, _ in adapters]}
    result = SoakResult(settings, counts, samples,
                        failures=[asdict(o) for o in outcomes if o.kind not in
                                  ("complete", "disconnected", "cancelled", "rejected")][:50])
    finished = sum(after[k] - before.get(k, 0) for k in after if k.startswith("genserve_requests_finished_total"))
    accepted = sum(o.samples for o in outcomes if o.accepted)
    checks = result.checks
    checks["kv_pool_whole"] = {"ok": after["genserve_kv_blocks_free"] == after["genserve_kv_blocks_capacity"],
                               "free": after["genserve_kv_blocks_free"],
                               "capacity": after["genserve_kv_blocks_capacity"]}
    for proc in ("engine", "bridge"):
        growth = rss_growth(samples, f"{proc}_rss", warmup_s)
        checks[f"{proc}_rss_flat"] = {"ok": growth <= rss_tolerance, "growth": round(growth, 4)}
    checks["no_5xx"] = {"ok": not counts.get("http_5xx") and not counts.get("grpc_failure"),
                        "http_5xx": counts.get("http_5xx", 0), "grpc_failure": counts.get("grpc_failure", 0)}
    checks["no_transport_errors"] = {"ok": not counts.get("transport"), "count": counts.get("transport", 0)}
    checks["events_complete"] = {"ok": not counts.get("incomplete") and not counts.get("client_error")
                                 and finished == accepted,
                                 "incomplete": counts.get("incomplete", 0), "engine_finished": finished,
                                 "accepted_samples": accepted}
    if lora is not None:
        checks["adapters_loaded_and_unloaded_under_load"] = lora
    checks["disconnects_and_cancels_happened"] = {"ok": counts.get("disconnected", 0) > 0
                                                  and counts.get("cancelled", 0) > 0}
    return result


def write_report(result: SoakResult, out: pathlib.Path) -> None:
    """`out`/soak.json (everything) and `out`/soak.png (RSS and free blocks over time)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(asdict(result) | {"passed": result.passed}, indent=1) + "\n")
    t = [s["t_s"] / 60 for s in result.samples]
    fig, (mem, blocks) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    mem.plot(t, [s["engine_rss"] / 2**20 for s in result.samples], label="engine")
    mem.plot(t, [s["bridge_rss"] / 2**20 for s in result.samples], label="bridge")
    mem.axvline(result.settings["warmup_s"] / 60, color="grey", linestyle=":", label="end of warm-up")
    mem.set_ylabel("RSS (MiB)")
    mem.legend()
    blocks.plot(t, [s["kv_blocks_free"] for s in result.samples], color="tab:green")
    blocks.set_ylabel("free KV blocks")
    blocks.set_xlabel("minutes")
    fig.suptitle(f"soak: {result.settings['rate_rps']:.2f} req/s ({result.settings['load']:.0%} of "
                 f"{result.settings['capacity_rps']:.2f}), {result.settings['requests']} requests")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def serve(extra: Sequence[str] = (), timeout_s: float = 300.0) -> Iterator[Target]:
    """Start `genserve serve` on free ports (Envoy in front, queue budget of an hour so open-loop
    load below capacity is never refused), yield its `Target`, stop it afterwards.

    Raises:
        RuntimeError: it did not print "genserve ready" within `timeout_s`.
    """
    from genserve.common.ports import free_port

    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.deploy.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
         "--metrics-port", str(metrics_port), "--queue-budget-s", "3600",
         "--ready-timeout-s", f"{timeout_s:g}", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    lines = []
    try:
        while True:
            line = proc.stdout.readline()
            lines.append(line)
            if "genserve ready" in line:
                break
            # "not ready after": the supervisor goes on trying, but the next line may never come.
            if (not line or "not ready after" in line or proc.poll() is not None
                    or time.monotonic() > deadline):
                raise RuntimeError("genserve did not start:\n" + "".join(lines[-30:]))
        # Keep reading its output so the pipe never fills.
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        yield Target(f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module doc). Returns 0 when every check held, else 1."""
    p = argparse.ArgumentParser(prog="python -m loadgen.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, required=True, help="directory for soak.json and soak.png")
    p.add_argument("--duration-s", type=float, default=3600.0, help="seconds of load (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=600.0,
                   help="RSS may grow for this long before it must be flat (default %(default)s)")
    p.add_argument("--rss-tolerance", type=float, default=0.05,
                   help="largest relative RSS growth after the warm-up (default %(default)s)")
    p.add_argument("--capacity-rps", type=float, default=None, help="capacity, requests/s (default: measured)")
    p.add_argument("--probe-s", type=float, default=60.0, help="capacity probe length, s (default %(default)s)")
    p.add_argument("--load", type=float, default=LOAD, help="share of capacity to send (default %(default)s)")
    p.add_argument("--scale", type=float, default=0.064,
                   help="length-mix scale, 1 = the design's (default %(default)s, for CPU)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples (default %(default)s)")
    p.add_argument("--key", action="append", default=None, help="API key (repeat; default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a PEFT LoRA adapter of the served model to load and unload under the load (repeat)")
    p.add_argument("--admin-key", default="", help="API key of the adapter loads and unloads (default: none)")
    p.add_argument("--base-url", help="drive this genserve (with --grpc-target and --supervisor-pid) "
                                      "instead of starting one")
    p.add_argument("--grpc-target")
    p.add_argument("--supervisor-pid", type=int)
    p.add_argument("serve_args", nargs="*", help="after --: flags for the `genserve serve` it starts")
    args = p.parse_args(argv)
    options = dict(duration_s=args.duration_s, capacity_rps=args.capacity_rps, probe_s=args.probe_s,
                   load=args.load, scale=args.scale, warmup_s=args.warmup_s, rss_tolerance=args.rss_tolerance,
                   sample_s=args.sample_s, keys=args.key or ("",), seed=args.seed,
                   adapters=[tuple(a.split("=", 1)) for a in args.adapter], admin_key=args.admin_key)
    if args.base_url:
        if not (args.grpc_target and args.supervisor_pid):
            p.error("--base-url needs --grpc-target and --supervisor-pid")
        result = run_soak(Target(args.base_url, args.grpc_target, args.supervisor_pid), **options)
    else:
        with serve(args.serve_args) as target:
            result = run_soak(target, **options)
    write_report(result, args.out)
    print(json.dumps({"settings": result.settings, "counts": result.counts, "checks": result.checks,
                      "passed": result.passed}, indent=1))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
