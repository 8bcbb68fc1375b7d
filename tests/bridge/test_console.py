"""The web console through the bridge: the page and its files, the scheduler snapshot stream
(GET /v1/console/events) over the real servicer and scheduler (a simulated forward pass, see
tests/service/harness.py): snapshot fields while requests run, the API key, bad intervals, and
a client that leaves ending the engine-side stream; and the replicas' counters (GET
/v1/console/replicas) read from engine metrics endpoints, a live engine's among them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from bridge.app import create_app
from bridge.console import replicas_event, snapshot_event
from genserve.v1 import generate_pb2 as pb
from service.auth import Authenticator
from tests.bridge.test_metrics_replicas import serve_expositions, unreachable_url
from tests.service.harness import collect, request, running_server
from tests.uvicorn_app import served

KEYS = {"secret-alice": "alice", "secret-bob": "bob"}


async def read_snapshots(client: httpx.AsyncClient, url: str, count: int, headers=None,
                         until=None) -> list[dict]:
    """The first `count` snapshots of the stream (or, with `until`, up to the first for which it is
    true, at most `count`)."""
    out = []
    async with client.stream("GET", url, headers=headers or {}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
                if len(out) >= count or (until is not None and until(out[-1])):
                    break
    return out


async def test_page_and_static_files_are_served():
    async with running_server() as engine, served(create_app(engine.target)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            page = await client.get("/")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert '<script src="/static/console.js">' in page.text
            js = await client.get("/static/console.js")
            css = await client.get("/static/console.css")
            assert js.status_code == 200 and "/v1/console/events" in js.text
            assert css.status_code == 200 and "text/css" in css.headers["content-type"]
            # Nothing is loaded from elsewhere: the page works offline.
            for text in (page.text, js.text, css.text):
                assert "http://" not in text and "https://" not in text
            assert (await client.get("/static/nope.js")).status_code == 404


async def test_snapshots_follow_the_running_batch():
    async with running_server(num_blocks=64, step_s=0.02) as engine, \
            served(create_app(engine.target)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            [idle] = await read_snapshots(client, "/v1/console/events?interval_ms=100", 1)
            assert idle["running_rows"] == 0 and idle["queue_depth"] == 0 and idle["queues"] == []
            assert idle["kv_pool"]["total"] == 64 and idle["kv_pool"]["free"] == 64
            assert idle["kv_pool"]["map"] == "0" * 64
            assert idle["engine"].startswith(f"{engine.target} pid ")
            assert idle["queue_budget_s"] == 600.0 and idle["max_rows"] > 0
            # Three requests of 40 prompt bytes + 200 tokens: each holds ceil(240 / 16) = 15 blocks at
            # the end, so 64 blocks hold at most 4 such requests.
            calls = [engine.stub.Generate(pb.GenerateRequest(
                prompt="x" * 40, max_tokens=200, sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True)))
                for _ in range(3)]
            busy = await read_snapshots(client, "/v1/console/events?interval_ms=100", 50,
                                        until=lambda s: s["running_rows"] == 3 and s["decode_rows"] == 3)
            snap = busy[-1]
            assert snap["running_rows"] == 3 and snap["decode_rows"] == 3 and snap["prefill_rows"] == 0
            assert snap["queues"] == [{"name": "anonymous", "queued": 0, "running": 3}]
            kv = snap["kv_pool"]
            held = kv["map"].count("1") + kv["map"].count("2")
            assert kv["used"] == held == kv["total"] - kv["free"] - kv["cached"] >= 3 * 3
            steps = snap["recent_steps"]
            assert steps and all(s["age_s"] >= 0 for s in steps)
            assert [s["age_s"] for s in steps] == sorted((s["age_s"] for s in steps), reverse=True)
            # Step time is split, not invented: every step took at least the executor's 20 ms.
            assert all(s["decode_ms"] + s["prefill_ms"] >= 19.0 for s in steps)
            assert any(s["decode_rows"] == 3 and s["prefill_ms"] == 0 for s in steps)
            assert any(s["prefill_tokens"] > 0 and s["prefill_ms"] > 0 for s in steps)
            for call in calls:
                call.cancel()
            done = await read_snapshots(client, "/v1/console/events?interval_ms=100", 100,
                                        until=lambda s: s["finished_total"] == 3 and s["running_rows"] == 0)
            assert done[-1]["finished_total"] == 3 and done[-1]["kv_pool"]["free"] == 64
            # Cancelled requests had their first token: they count in the minute's TTFT.
            assert done[-1]["latency"]["ttft"]["count"] == 3
            assert done[-1]["latency"]["window_s"] == 60.0


async def test_the_stream_needs_a_key_when_keys_are_configured():
    async with running_server(auth=Authenticator(KEYS)) as engine, \
            served(create_app(engine.target)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.get("/v1/console/events")
            assert r.status_code == 401 and "authorization" in r.json()["error"]["message"]
            r = await client.get("/v1/console/events", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            # A console that lacks a key is not a refused generation request.
            registry = engine.server.metrics.registry
            assert registry.get_sample_value("genserve_requests_rejected_total", {"code": "401"}) == 0
            call = engine.stub.Generate(pb.GenerateRequest(
                prompt="y" * 20, max_tokens=500, sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True)),
                metadata=(("authorization", "Bearer secret-bob"),))
            snaps = await read_snapshots(client, "/v1/console/events?interval_ms=100", 50,
                                         headers={"Authorization": "Bearer secret-alice"},
                                         until=lambda s: s["queues"])
            # Keys appear by their configured names; the keys themselves never leave the engine.
            assert snaps[-1]["queues"][0]["name"] == "bob"
            assert "secret" not in json.dumps(snaps)
            call.cancel()
            # The page itself is public (it holds no data).
            assert (await client.get("/")).status_code == 200


@pytest.mark.parametrize("interval", ["5", "10001"])
async def test_an_interval_out_of_range_is_a_400_naming_it(interval):
    async with running_server() as engine, served(create_app(engine.target)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.get(f"/v1/console/events?interval_ms={interval}")
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "interval_ms" and "between 100 and 10000" in err["message"]
            r = await client.get("/v1/console/events?interval_ms=-1")
            assert r.status_code == 400 and r.json()["error"]["param"] == "interval_ms"


async def test_a_client_that_leaves_ends_the_engine_stream():
    async with running_server() as engine, served(create_app(engine.target)) as url:
        servicer = engine.server.servicer
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await read_snapshots(client, "/v1/console/events?interval_ms=100", 2)
        # The bridge cancelled its WatchScheduler call: the engine's server has no call left.
        for _ in range(100):
            if servicer.num_watching == 0:
                break
            await asyncio.sleep(0.02)
        assert servicer.num_watching == 0


def test_snapshot_event_maps_every_field():
    snap = pb.SchedulerSnapshot(
        unix_time_s=1.5, engine="e", steps=7, running_rows=5, prefill_rows=2, max_rows=32,
        queues=[pb.KeyQueue(name="a", queued=3, running=5)], queued_device_s=0.25, queue_budget_s=2.0,
        kv_pool=pb.KvPool(block_size=16, total_blocks=4, free_blocks=1, used_blocks=3,
                          block_states=bytes([1, 2, 0, 1])),
        recent_steps=[pb.StepSample(age_s=0.5, decode_rows=5, prefill_tokens=64, decode_ms=10.0, prefill_ms=30.0)],
        ttft=pb.LatencySummary(count=2, p50_ms=10, p95_ms=20, max_ms=20), latency_window_s=60.0,
        rejected_total=4, preemptions_total=1, finished_total=9)
    ev = snapshot_event(snap)
    assert ev["decode_rows"] == 3 and ev["queue_depth"] == 3
    assert ev["kv_pool"] == {"block_size": 16, "total": 4, "free": 1, "used": 3, "cached": 0, "map": "1201"}
    assert ev["recent_steps"] == [{"age_s": 0.5, "decode_rows": 5, "prefill_tokens": 64,
                                   "decode_ms": 10.0, "prefill_ms": 30.0}]
    assert ev["latency"]["ttft"] == {"count": 2, "p50_ms": 10.0, "p95_ms": 20.0, "max_ms": 20.0}
    assert ev["latency"]["tpot"]["count"] == 0
    assert (ev["rejected_total"], ev["preemptions_total"], ev["finished_total"]) == (4, 1, 9)


# ---- GET /v1/console/replicas ----

NO_ENGINE = "127.0.0.1:1"       # the replicas endpoint never calls the gRPC service


def replica_exposition(queried: int, hit: int, finished: dict[str, int], rows: int) -> bytes:
    """An exposition with the engine's families as service/metrics.py declares them (counters
    with their `_created` samples, the finish-reason label)."""
    registry = CollectorRegistry()
    Counter("genserve_prefix_cache_queried_tokens", "Queried.", registry=registry).inc(queried)
    Counter("genserve_prefix_cache_hit_tokens", "Hit.", registry=registry).inc(hit)
    by_reason = Counter("genserve_requests_finished", "Finished.", ["finish_reason"], registry=registry)
    for reason, n in finished.items():
        by_reason.labels(reason).inc(n)
    Gauge("genserve_running_rows", "Rows.", registry=registry).set(rows)
    return generate_latest(registry)


async def get_replicas(urls) -> list[dict]:
    async with served(create_app(NO_ENGINE, engine_metrics_url=urls)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.get("/v1/console/replicas")
    assert r.status_code == 200 and r.headers["cache-control"] == "no-cache"
    return r.json()["replicas"]


async def test_replicas_show_each_engine_in_url_order():
    with serve_expositions(replica_exposition(1000, 250, {"length": 3, "stop": 2}, 1),
                           replica_exposition(300, 192, {"length": 7}, 4),
                           replica_exposition(0, 0, {"length": 0}, 0)) as (first, second, idle):
        got = await get_replicas([first, unreachable_url(), second, idle])
    assert got == [
        {"replica": "0", "up": True, "prefix_cache_queried_tokens": 1000, "prefix_cache_hit_tokens": 250,
         "requests_finished": 5, "running_rows": 1, "hit_ratio": 0.25},
        {"replica": "1", "up": False, "prefix_cache_queried_tokens": None, "prefix_cache_hit_tokens": None,
         "requests_finished": None, "running_rows": None, "hit_ratio": None},
        {"replica": "2", "up": True, "prefix_cache_queried_tokens": 300, "prefix_cache_hit_tokens": 192,
         "requests_finished": 7, "running_rows": 4, "hit_ratio": 0.64},
        # Nothing queried yet: no ratio, not 0.
        {"replica": "3", "up": True, "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0,
         "requests_finished": 0, "running_rows": 0, "hit_ratio": None},
    ]


async def test_replicas_without_engine_metrics_urls_is_an_empty_list():
    assert await get_replicas(None) == []


async def test_replicas_need_no_key_and_count_failed_reads():
    """Like GET /metrics, the endpoint answers without an API key; a failed read is counted."""
    app = create_app(NO_ENGINE, engine_metrics_url=[unreachable_url()])
    async with served(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.get("/v1/console/replicas", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 200 and r.json()["replicas"][0]["up"] is False
    errors = app.state.bridge.metrics.registry.get_sample_value("genserve_bridge_engine_scrape_errors_total")
    assert errors == 1


def test_replicas_event_survives_bad_expositions():
    nan = b"# TYPE genserve_prefix_cache_queried_tokens counter\ngenserve_prefix_cache_queried_tokens_total NaN\n" \
          b"genserve_prefix_cache_hit_tokens_total 3\ngenserve_running_rows +Inf\n"
    got = replicas_event([b"<html>not metrics</html>", b"\xff\xfe", nan, b""])["replicas"]
    assert [r["up"] for r in got] == [False, False, True, True]
    assert all(v is None for r in got[:2] for k, v in r.items() if k not in ("replica", "up"))
    assert (got[2]["prefix_cache_queried_tokens"], got[2]["prefix_cache_hit_tokens"]) == (None, 3)
    assert got[2]["running_rows"] is None and got[2]["hit_ratio"] is None
    # An engine whose endpoint answers without these families: up, numbers unknown.
    assert got[3] == {"replica": "3", "up": True, "prefix_cache_queried_tokens": None,
                      "prefix_cache_hit_tokens": None, "requests_finished": None, "running_rows": None,
                      "hit_ratio": None}


async def test_replicas_follow_a_live_engines_prefix_cache():
    """The real engine's metrics (service/metrics.py over the real scheduler and prefix cache):
    the same 300-byte prompt twice, the second takes its first 256 tokens (4 whole 64-token
    prefill pieces) from the cache."""
    async with running_server() as engine:
        registry = engine.server.metrics.registry
        with serve_expositions(lambda: generate_latest(registry)) as urls:
            before = (await get_replicas(urls))[0]
            assert before["up"] and before["hit_ratio"] is None and before["requests_finished"] == 0
            prompt = "".join(chr(97 + i % 26) for i in range(300))
            for _ in range(2):
                _, err = await collect(engine.stub.Generate(request(prompt, max_tokens=4)))
                assert err is None
            [after] = await get_replicas(urls)
    assert after["prefix_cache_queried_tokens"] == 600 and after["prefix_cache_hit_tokens"] == 256
    assert after["hit_ratio"] == round(256 / 600, 4) and after["requests_finished"] == 2
    assert after["running_rows"] == 0
    assert registry.get_sample_value("genserve_prefix_cache_hit_tokens_total") == 256
