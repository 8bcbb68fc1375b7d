"""The kernels' build lock: a lock file left by a killed build no longer blocks later loads."""

from __future__ import annotations

import multiprocessing
import pathlib
import time

from engine.kernels import build_lock


def test_a_lock_file_left_by_a_dead_build_is_removed(tmp_path):
    (tmp_path / "lock").write_text("")              # what torch leaves when its builder is killed
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def _hold(directory, ready, seconds):
    with build_lock(directory):
        (directory / "lock").write_text("")         # a live build's own lock file
        ready.set()
        time.sleep(seconds)
        (directory / "lock").unlink()


def test_a_live_build_is_waited_for_not_broken(tmp_path):
    """While another process builds (holding the lock), a second builder waits for it instead of
    removing the live build's lock file."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    builder = ctx.Process(target=_hold, args=(tmp_path, ready, 1.0))
    builder.start()
    try:
        assert ready.wait(60)
        t0 = time.monotonic()
        with build_lock(tmp_path):
            waited = time.monotonic() - t0
            assert not (tmp_path / "lock").exists()
        assert waited > 0.5, waited                 # it waited for the builder's second
    finally:
        builder.join(60)
    assert builder.exitcode == 0


def test_a_killed_builder_releases_the_lock(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    builder = ctx.Process(target=_hold, args=(tmp_path, ready, 600.0))
    builder.start()
    assert ready.wait(60)
    builder.kill()                                  # mid-build: its torch lock file stays
    builder.join(60)
    assert (tmp_path / "lock").exists()
    with build_lock(tmp_path):                      # the kernel released the flock
        assert not (tmp_path / "lock").exists()


def test_cpu_flags_are_the_cpuinfo_flags_line():
    from engine import kernels

    text = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), None)
    if line is None:
        assert kernels.cpu_flags() == frozenset()
    else:
        assert kernels.cpu_flags() == frozenset(line.split(":", 1)[1].split())
        assert "fpu" in kernels.cpu_flags()       # every x86 CPU Linux lists has it
