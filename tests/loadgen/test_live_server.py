"""loadgen.live_server: the live server's start gives up at its deadline."""

from __future__ import annotations

import sys
import time

import pytest

from loadgen.live_server import LiveServer


@pytest.mark.parametrize("script, output", [
    ("import time; time.sleep(60)", ""),                                  # silent, never ready
    ("import sys, time; print('loading', flush=True); time.sleep(60)", "loading"),
    ("print('model missing')", "model missing"),                           # exits at once
])
def test_live_server_gives_up_at_its_deadline_even_when_the_server_prints_nothing(script, output):
    server = LiveServer(start_timeout_s=1.5)
    server.argv = [sys.executable, "-c", script]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not start within 1.5 s") as raised:
        server.__enter__()
    assert time.monotonic() - started < 10
    assert output in str(raised.value)
    assert server.proc.poll() is not None               # stopped, not left running
