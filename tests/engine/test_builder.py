"""engine.builder.set_threads: torch's thread count, and the warning about pinned threads."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine.builder import set_threads
from engine.config import EngineConfig


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_default_to_the_usable_cores(restore_threads, monkeypatch):
    monkeypatch.delenv("OMP_PROC_BIND", raising=False)
    assert set_threads(EngineConfig(num_threads=1)) == 1 and torch.get_num_threads() == 1
    cores = len(os.sched_getaffinity(0))
    assert set_threads(EngineConfig()) == cores and torch.get_num_threads() == cores


@pytest.mark.parametrize("bind,warns", [("true", True), ("close", True), ("FALSE", False), ("", False)])
def test_pinned_threads_are_warned_about(restore_threads, monkeypatch, caplog, bind, warns):
    monkeypatch.setenv("OMP_PROC_BIND", bind)
    with caplog.at_level(logging.WARNING, logger="engine.builder"):
        set_threads(EngineConfig(num_threads=1))
    warned = [r.getMessage() for r in caplog.records if "OMP_PROC_BIND" in r.getMessage()]
    assert bool(warned) == warns, warned
