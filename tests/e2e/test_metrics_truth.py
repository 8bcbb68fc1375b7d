"""/metrics stays true: promtool accepts it, and after a mass cancellation the gauges are back to
an idle engine's (no rows, no queue, every KV block free), the TTFT histogram counted exactly the
requests that received a first token, every request was counted as finished once, and no gauge
was ever negative."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "Write a long story about a lighthouse keeper."


def promtool() -> str | None:
    """promtool on PATH or next to this Python (scripts/bootstrap.sh copies it into the venv)."""
    found = shutil.which("promtool")
    local = Path(sys.executable).parent / "promtool"
    return found or (str(local) if local.exists() else None)


def test_promtool_accepts_the_bridge_metrics(server):
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not found (Debian package `prometheus`; scripts/bootstrap.sh installs it "
                    "into .venv/bin when apt-get is available)")
    for stream in (False, True):      # fill the histograms and labelled counters
        r = httpx.post(f"{server.base_url}/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 3, "stream": stream}, timeout=60)
        assert r.status_code == 200
    assert httpx.post(f"{server.base_url}/v1/completions", json={"prompt": ""}, timeout=30).status_code == 400
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert "genserve_bridge_http_responses_total" in text and "genserve_ttft_seconds_bucket" in text
    # The bridge's and the engine's standard process series, told apart by `component`.
    for component in ("bridge", "engine"):
        for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                     "process_start_time_seconds"):
            assert f'{name}{{component="{component}"}}' in text, (name, component)
    check = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def gauges(base_url: str) -> dict[str, float]:
    """Every gauge sample of GET /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text) if fam.type == "gauge" for s in fam.samples}


def histogram_count(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(f"{name}_count"))


def finished_total(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("genserve_requests_finished_total"))


async def _one(client: httpx.AsyncClient, base: str, i: int, how: str, go: asyncio.Event) -> dict:
    """One streaming request. `how`: "delete-after-token" (DELETE once a token came, then read
    to the end), "disconnect-after-token", or "delete-at-once" (DELETE as soon as the request id
    is known, likely while queued, then read to the end)."""
    body = {"prompt": f"{PROMPT} ({i})", "max_tokens": 400, "ignore_eos": True, "stream": True}
    out = {"how": how, "tokens": 0, "finish_reason": None}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        request_id = r.headers["x-request-id"]
        if how == "delete-at-once":
            await go.wait()
            assert (await client.delete(f"{base}/v1/requests/{request_id}")).status_code in (200, 404)
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "token_id" in event:
                out["tokens"] += 1
                if out["tokens"] == 1 and how == "disconnect-after-token":
                    return out
                if out["tokens"] == 1 and how == "delete-after-token":
                    await go.wait()
                    reply = await client.delete(f"{base}/v1/requests/{request_id}")
                    assert reply.status_code in (200, 404)
            elif event.get("finish_reason"):
                out["finish_reason"] = event["finish_reason"]
    return out


async def _mass_cancel(base: str, per_group: int) -> tuple[list[dict], list[dict[str, float]]]:
    limits = httpx.Limits(max_connections=4 * per_group + 10, max_keepalive_connections=10)
    go = asyncio.Event()
    samples: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        tasks = [asyncio.create_task(_one(client, base, i, how, go))
                 for how in ("delete-after-token", "disconnect-after-token", "delete-at-once")
                 for i in range(per_group)]
        await asyncio.sleep(1.0)
        for _ in range(3):                       # gauges while the engine is busy
            samples.append(await asyncio.to_thread(gauges, base))
            await asyncio.sleep(0.3)
        go.set()                                 # now cancel everything
        results = await asyncio.gather(*tasks)
    return results, samples


def test_gauges_and_ttft_count_are_true_after_every_stream_is_cancelled(server):
    before = server.wait_idle()
    results, samples = asyncio.run(_mass_cancel(server.base_url, per_group=14))
    after = server.wait_idle(timeout_s=60)
    samples.append(gauges(server.base_url))

    assert after["genserve_running_rows"] == 0 and after["genserve_queue_depth"] == 0
    assert after["genserve_kv_blocks_free"] == after["genserve_kv_blocks_capacity"] > 0
    assert after["genserve_queued_device_seconds"] == pytest.approx(0.0, abs=1e-6)
    for sample in samples:
        negative = {k: v for k, v in sample.items() if v < 0}
        assert not negative, negative
    # Every request ended exactly once in the engine's books, and each stream that was read to
    # its end saw it end as cancelled (or, rarely, run out: a DELETE that came after the end).
    assert finished_total(after) - finished_total(before) == len(results)
    for res in results:
        if res["how"] != "disconnect-after-token":
            assert res["finish_reason"] in ("cancelled", "length"), res
    # TTFT is observed once per request that got a first token, and only for those.
    got_first_token = sum(1 for r in results if r["tokens"] > 0)
    assert got_first_token >= 2 * 14                  # both "after-token" groups got one
    ttft = histogram_count(after, "genserve_ttft_seconds") - histogram_count(before, "genserve_ttft_seconds")
    assert ttft == got_first_token
    assert (histogram_count(after, "genserve_e2e_seconds") - histogram_count(before, "genserve_e2e_seconds")
            == len(results))
