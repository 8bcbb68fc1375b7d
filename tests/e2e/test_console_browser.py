"""The web console in a real browser (headless Chromium from Debian, driven by selenium through
Debian's chromium-driver) against a live `genserve serve`: type a prompt, see tokens stream with
their arrival time and logprob, press Stop and see the request cancelled in /metrics, see the
live scheduler view follow a load, see the same long prompt twice raise replica 0's prefix-cache
hit ratio in the Replicas panel as /metrics counts it, and see 429s arrive on it with an API key.

Skips when Chromium, chromium-driver or selenium is missing (`apt-get install chromium
chromium-driver`; .ci/run installs them where apt-get works). With GENSERVE_CONSOLE_SCREENSHOTS
set to a folder (docs/console to refresh docs/console.md's), each view's screenshot is written there.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_keys_admission_cancel import ALICE, _burst

PROMPT = "Write a long story about a lighthouse keeper and the storm that changed his life."
WAIT_S = 120.0


def _chrome_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
    if chromium is None or driver is None:
        pytest.skip("no headless Chromium here: install Debian's `chromium` and `chromium-driver` "
                    "(apt-get install chromium chromium-driver; .ci/run does so where apt-get works)")
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium driven by selenium; closed after the module."""
    chromium, driver_path = _chrome_paths()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,1000", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait_for(condition, timeout_s: float = WAIT_S, what: str = "condition"):
    """Poll `condition()` until it returns a truthy value (returned); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def screenshot(driver, name: str, tmp_path: Path) -> None:
    """Save the window as name.png under tmp_path, and under GENSERVE_CONSOLE_SCREENSHOTS if set."""
    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000       # a rendered page, not a blank image
    target = os.environ.get("GENSERVE_CONSOLE_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / f"{name}.png")


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By
    return driver.find_element(By.ID, element_id)


def fill(driver, element_id: str, value: str) -> None:
    field = by_id(driver, element_id)
    field.clear()
    field.send_keys(value)


def tokens(driver):
    from selenium.webdriver.common.by import By
    return driver.find_elements(By.CSS_SELECTOR, "#output .tok")


def cancelled_total(server) -> float:
    return server.metrics().get("genserve_requests_finished_total{finish_reason=cancelled}", 0.0)


def test_playground_streams_and_stop_cancels(browser, server, tmp_path):
    browser.get(f"{server.base_url}/")
    assert browser.title == "genserve console"
    fill(browser, "prompt", PROMPT)
    fill(browser, "max-tokens", "400")
    fill(browser, "temperature", "0")
    fill(browser, "logprobs", "1")
    if not by_id(browser, "ignore-eos").is_selected():
        by_id(browser, "ignore-eos").click()
    before = cancelled_total(server)
    m = server.metrics()
    steps_before, extra_before = m["genserve_cancel_extra_steps_count"], m["genserve_cancel_extra_steps_sum"]
    by_id(browser, "send").click()
    wait_for(lambda: len(tokens(browser)) >= 5, what="5 streamed tokens")
    # Tokens arrive one by one: each has its arrival time and logprob for the hover.
    spans = tokens(browser)[:5]
    times = [float(s.get_attribute("data-t-ms")) for s in spans]
    assert times == sorted(times) and times[0] > 0
    for span in spans:
        title = span.get_attribute("title")
        assert "ms after sending" in title and "logprob" in title
        assert float(span.get_attribute("data-logprob")) <= 0
    assert by_id(browser, "stop-button").is_enabled()
    by_id(browser, "stop-button").click()
    wait_for(lambda: by_id(browser, "run-status").text == "cancelled", what="the run to show cancelled")
    wait_for(lambda: by_id(browser, "send").is_enabled(), what="the Generate button back")
    assert by_id(browser, "stat-finish").text.startswith("cancelled")
    streamed = len(tokens(browser))
    assert 5 <= streamed < 400
    # The engine counted it: one more cancelled request, which ran at most one step past the flag.
    wait_for(lambda: cancelled_total(server) == before + 1, 30, "the cancel in /metrics")
    m = server.metrics()
    assert m["genserve_cancel_extra_steps_count"] == steps_before + 1
    assert m["genserve_cancel_extra_steps_sum"] - extra_before <= 1

    # A run to its end shows tokens, TTFT and TPOT.
    fill(browser, "prompt", "The three primary colours are")
    fill(browser, "max-tokens", "12")
    by_id(browser, "send").click()
    wait_for(lambda: by_id(browser, "run-status").text == "done", what="the run to finish")
    assert by_id(browser, "stat-tokens").text == "12"
    assert by_id(browser, "stat-finish").text == "length"
    for stat in ("stat-ttft", "stat-tpot"):
        text = by_id(browser, stat).text
        assert text.endswith(" ms") and float(text.split()[0]) > 0, (stat, text)
    assert len(tokens(browser)) == 12
    screenshot(browser, "playground", tmp_path)


def test_playground_tabs_follow_the_server(browser, server):
    """One tab per generation endpoint the server describes; the Chat tab streams a reply."""
    from selenium.webdriver.common.by import By

    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["paths"]
    has_chat = "/v1/chat/completions" in paths
    browser.get(f"{server.base_url}/#playground")
    expected = ["Completions", "Chat"] if has_chat else ["Completions"]
    wait_for(lambda: [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#tabs button")] == expected,
             10, f"the tabs {expected}")
    if not has_chat:
        return
    browser.find_elements(By.CSS_SELECTOR, "#tabs button")[1].click()
    fill(browser, "prompt", "Name a colour.")
    fill(browser, "max-tokens", "6")
    fill(browser, "temperature", "0")
    by_id(browser, "send").click()
    wait_for(lambda: by_id(browser, "run-status").text in ("done", "cancelled") or "error" in
             by_id(browser, "run-status").text, what="the chat reply")
    assert by_id(browser, "run-status").text == "done"
    # The page shows what the endpoint answers to the same body (greedy, so deterministic).
    want = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": by_id(browser, "ignore-eos").is_selected()}).json()
    shown = tokens(browser)
    assert "".join(t.get_attribute("textContent") for t in shown) == want["choices"][0]["message"]["content"]
    assert len(shown) == want["usage"]["completion_tokens"]
    assert by_id(browser, "stat-tokens").text == str(want["usage"]["completion_tokens"])


def _load(base_url: str, n: int, max_tokens: int, done: list) -> None:
    """n concurrent streamed completions (on a thread); appends each status code to `done`."""
    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"{i}: {PROMPT}", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass
            done.append(r.status_code)

    async def all_of_them() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            await asyncio.gather(*(one(client, i) for i in range(n)))

    asyncio.run(all_of_them())


def last_snapshot(driver) -> dict | None:
    return driver.execute_script("return window.genserveConsole.last")


def test_live_view_follows_the_load(browser, server, tmp_path):
    server.wait_idle()
    browser.get(f"{server.base_url}/#live")
    wait_for(lambda: by_id(browser, "live-status").text == "live", 30, "the live stream")
    idle = wait_for(lambda: last_snapshot(browser), 30, "a first snapshot")
    assert idle["running_rows"] == 0 and by_id(browser, "live-rows").text == f"0 / {idle['max_rows']}"
    finished_before = idle["finished_total"]
    done: list[int] = []
    # 6 streams of 400 tokens: long enough on a fast host (≈ 10 ms a step) that the load is still
    # running when the replicas panel's 2 s poll comes round; 48 tokens could end before it.
    load = threading.Thread(target=_load, args=(server.base_url, 6, 400, done), daemon=True)
    load.start()
    busy = wait_for(lambda: (s := last_snapshot(browser)) and s["running_rows"] >= 4 and s["decode_rows"] >= 4
                    and s, what="at least 4 rows decoding in the live view")
    wait_for(lambda: by_id(browser, "live-rows").text.split(" / ")[0] != "0", 10, "the rows on the page")
    assert busy["kv_pool"]["used"] > 0 and busy["kv_pool"]["map"].count("0") < busy["kv_pool"]["total"]
    assert busy["queues"] and busy["queues"][0]["name"] == "anonymous"
    assert busy["recent_steps"] and busy["steps"] > idle["steps"]
    wait_for(lambda: any(s["decode_rows"] >= 4 for s in last_snapshot(browser)["recent_steps"]), 60,
             "a step of at least 4 decode rows in the step chart")
    wait_for(lambda: (js := browser.execute_script("return window.genserveConsole.replicas"))
             and js[0]["running_rows"], 30, "the replicas panel to show the running rows")
    browser.set_window_size(1360, 1560)          # the whole view, block map and replicas included
    time.sleep(0.5)
    screenshot(browser, "live", tmp_path)
    browser.set_window_size(1360, 1000)
    # The step chart is drawn: its canvas is not blank.
    blank = browser.execute_script(
        "const c = document.getElementById('steps-chart');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "for (let i = 3; i < d.length; i += 4) if (d[i]) return false; return true;")
    assert not blank
    load.join(WAIT_S)
    assert done == [200] * 6
    end = wait_for(lambda: (s := last_snapshot(browser)) and s["running_rows"] == 0
                   and s["finished_total"] >= finished_before + 6 and s, 30, "the load to finish")
    assert end["latency"]["ttft"]["count"] >= 6 and end["latency"]["tpot"]["count"] >= 6
    ttft_cells = browser.execute_script(
        "return [...document.querySelectorAll('#live-latency tr[data-key=ttft] td')].map(td => td.textContent)")
    assert ttft_cells[0].endswith(" ms") and int(ttft_cells[3]) >= 6


def replica_cells(driver, replica: str) -> list[str]:
    """The Replicas panel's cells of one replica's row ([] before the row is shown)."""
    return driver.execute_script(
        "const row = document.querySelector(`#live-replicas tr[data-replica='${arguments[0]}']`);"
        "return row ? [...row.cells].map(td => td.textContent) : []", replica)


def shown_percent(text: str) -> float:
    assert text.endswith(" %"), text
    return float(text.removesuffix(" %"))


def test_replicas_panel_shows_the_prefix_cache_hit_ratio(browser, server):
    """The same prompt of a few hundred tokens twice: the second request takes its first whole
    prefill pieces from replica 0's cache, and the panel's ratios are /metrics' counters."""
    hit_name, queried_name = "genserve_prefix_cache_hit_tokens_total", "genserve_prefix_cache_queried_tokens_total"
    before = server.wait_idle()
    browser.get("about:blank")          # a fresh page: no polls kept from an earlier test's view
    browser.get(f"{server.base_url}/#live")
    wait_for(lambda: browser.execute_script("return window.genserveConsole.replicaPolls.length") >= 1, 30,
             "a first poll of the replicas (the window's start)")
    window_start = time.monotonic()
    assert replica_cells(browser, "0")[:2] == ["0", "up"]
    prompt = " ".join(f"Night {i}: the keeper climbed the tower, trimmed the wick and watched the sea."
                      for i in range(24))
    for _ in range(2):
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=WAIT_S,
                       json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] >= 200
    after = server.wait_idle()
    hit, queried = after[hit_name], after[queried_name]
    added_hit, added_queried = hit - before[hit_name], queried - before[queried_name]
    assert added_hit >= 64 and added_queried == 2 * r.json()["usage"]["prompt_tokens"], (added_hit, added_queried)
    finished = sum(v for k, v in after.items() if k.startswith("genserve_requests_finished_total{"))
    # The panel polls every 2 s: wait for a poll after both requests ended (hits are counted at
    # admission, the finish after the last token).
    seen = (hit, queried, finished)
    wait_for(lambda: (js := browser.execute_script("return window.genserveConsole.replicas")) and (
        js[0]["prefix_cache_hit_tokens"], js[0]["prefix_cache_queried_tokens"], js[0]["requests_finished"]) == seen,
        30, f"{seen} (hit, queried, finished) in the Replicas panel")
    [shown] = browser.execute_script("return window.genserveConsole.replicas")
    cells = replica_cells(browser, "0")
    assert shown["up"] and cells[1] == "up"
    since_start, last_minute = shown_percent(cells[4]), shown_percent(cells[5])
    assert since_start > 0 and abs(since_start - 100 * hit / queried) <= 0.06, (cells, hit, queried)
    if time.monotonic() - window_start < 55:     # the first poll is still in the 60 s window
        assert abs(last_minute - 100 * added_hit / added_queried) <= 0.06, (cells, added_hit, added_queried)
    assert cells[3] == str(int(shown["requests_finished"]))


def test_live_view_with_a_key_shows_429s(browser, keyed_server):
    browser.get(f"{keyed_server.base_url}/#live")
    wait_for(lambda: "401" in by_id(browser, "live-status").text, 30, "the 401 without a key")
    fill(browser, "api-key", ALICE["Authorization"].removeprefix("Bearer "))
    browser.execute_script("document.getElementById('api-key').dispatchEvent(new Event('change'))")
    wait_for(lambda: by_id(browser, "live-status").text == "live", 30, "the live stream with the key")
    first = wait_for(lambda: last_snapshot(browser), 30, "a snapshot")
    replies = asyncio.run(_burst(keyed_server.base_url, 12))
    refused = sum(r.status_code == 429 for r in replies)
    assert refused > 0, [r.status_code for r in replies]
    wait_for(lambda: last_snapshot(browser)["rejected_total"] >= first["rejected_total"] + refused, 30,
             "the 429s in the live view")
    assert int(by_id(browser, "live-rejected").text) >= first["rejected_total"] + refused
    events = by_id(browser, "live-events").text
    assert "429" in events
