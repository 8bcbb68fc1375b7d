"""What `--model` names: the embedded GGUF, another GGUF file, a Hugging Face safetensors
directory, or a random-initialised model of a named shape; and the name the service reports for it.

Spellings of `--model` (`python -m service` and `genserve serve`):

* nothing: the embedded SmolLM2-135M-Instruct GGUF;
* `PATH.gguf`: a llama-architecture GGUF file;
* `DIR`: a Hugging Face Llama checkpoint (`config.json`, `*.safetensors` shards, `tokenizer.json`);
* `random:SHAPE[:seed=N]`: random weights of a named shape (`RANDOM_SHAPES`), seed 0 by default,
  for benchmarks without weights. Its tokenizer is byte-level (`engine.tokenizer.ByteTokenizer`).

Nothing is ever downloaded. Torch-free: the `genserve serve` supervisor names the model for the
bridge without loading it.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

from genserve.common.model_name import DEFAULT_MODEL_NAME

# Shapes a random model can take (engine.model.weights.random_shape builds their ModelArgs).
RANDOM_SHAPES = ("llama-2-7b", "smollm2-135m", "tiny", "qwen3-8b", "gemma-3-12b", "qwen3-30b-a3b")
RANDOM_PREFIX = "random:"
KINDS = ("embedded", "gguf", "safetensors", "random")

# A quantisation or precision tag at the end of a GGUF file's stem: "SmolLM2-135M-Instruct.Q4_1",
# "llama-2-7b.Q4_K_M", "model-f16", "x.BF16" (llama.cpp's file type names, any case).
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d+(?:_[A-Z0-9]+)*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A parsed `--model` value.

    Attributes:
        kind: one of `KINDS`.
        path: the GGUF file or checkpoint directory (None for "embedded" and "random").
        shape: the random model's shape name, one of `RANDOM_SHAPES` (None otherwise).
        seed: the random model's seed (0 otherwise).
    """

    kind: str
    path: pathlib.Path | None = None
    shape: str | None = None
    seed: int = 0

    @property
    def served_name(self) -> str:
        """The model's name in `Info`, completions and `/v1/models`.

        The embedded model: "SmolLM2-135M-Instruct". A GGUF file: its stem without a trailing
        quantisation tag ("llama-2-7b.Q4_K_M.gguf" → "llama-2-7b"; the file's `general.name` is
        often a training-run label, e.g. the embedded file's "Smollm2 135M 8k Lc100K Mix1 Ep2").
        A checkpoint directory: its name ("Llama-2-7b-hf"). A random model: "random-SHAPE",
        plus "-seedN" for a seed other than 0.
        """
        if self.kind == "embedded":
            return DEFAULT_MODEL_NAME
        if self.kind == "random":
            return f"random-{self.shape}" + (f"-seed{self.seed}" if self.seed else "")
        assert self.path is not None
        if self.kind == "gguf":
            return _QUANT_SUFFIX.sub("", self.path.stem) or self.path.stem
        return self.path.resolve().name


def parse_model_source(spec: str | pathlib.Path | None) -> ModelSource:
    """Parse a `--model` value (see the module docstring). Reads nothing from disk.

    Raises:
        ValueError: an unknown random shape or a malformed `random:` spelling (the message lists
            the shapes), or an empty path.
    """
    if spec is None:
        return ModelSource("embedded")
    text = str(spec)
    if text.startswith(RANDOM_PREFIX):
        shape, *options = text[len(RANDOM_PREFIX):].split(":")
        if shape not in RANDOM_SHAPES:
            raise ValueError(f"--model {text!r}: unknown random shape {shape!r}; "
                             f"one of {', '.join(RANDOM_SHAPES)}")
        seed = 0
        for option in options:
            key, _, value = option.partition("=")
            if key != "seed" or not value.isdigit():
                raise ValueError(f"--model {text!r}: expected random:SHAPE[:seed=N] with N >= 0, "
                                 f"got option {option!r}")
            seed = int(value)
        return ModelSource("random", shape=shape, seed=seed)
    if not text.strip():
        raise ValueError("--model: empty path")
    path = pathlib.Path(text).expanduser()
    return ModelSource("gguf" if path.suffix.lower() == ".gguf" else "safetensors", path=path)
