"""The published chat templates of three families that define tool calls (tests/chat_templates/,
see its README.md for where each comes from), and tiny tokenizer directories that carry them, for
tests that compare genserve's rendering with transformers' ``apply_chat_template(..., tools=...)``
and serve a checkpoint whose template writes tools itself.

`write_tokenizer` writes ``tokenizer.json`` (tests/engine/checkpoint.py's 269-token Llama-2-style
tokenizer plus the family's control tokens, ids 269 and up, all under the tiny checkpoints'
vocabulary of 320) and ``tokenizer_config.json`` (``chat_template``, ``bos_token``,
``eos_token``), as a Hugging Face checkpoint directory holds them.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import AddedToken

TEMPLATE_DIR = pathlib.Path(__file__).parent / "chat_templates"

# family -> (template file, vLLM's --tool-call-parser name, the control tokens its template writes,
# bos, eos)
FAMILIES: dict[str, tuple[str, str, tuple[str, ...], str, str]] = {
    "qwen2.5": ("qwen2.5-instruct.jinja", "hermes",
                ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|endoftext|>", "<|im_end|>"),
    "llama3.1": ("llama-3.1-instruct.jinja", "llama3_json",
                 ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"), "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("mistral-nemo-instruct-2407.jinja", "mistral",
                ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "<s>", "</s>"),
}


def template(family: str) -> str:
    """The published chat template of `family` (a key of `FAMILIES`), as its checkpoint ships it."""
    return (TEMPLATE_DIR / FAMILIES[family][0]).read_text(encoding="utf-8")


def write_tokenizer(directory: pathlib.Path, family: str, config: bool = True) -> pathlib.Path:
    """Write `family`'s tiny tokenizer files into `directory` (created); returns it. With
    `config`, also a ``config.json`` naming the BOS and EOS ids (where the engine reads them; a
    checkpoint directory has its own)."""
    from tests.engine.checkpoint import sentencepiece_tokenizer

    _, _, controls, bos, eos = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    tk = sentencepiece_tokenizer()
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in controls])
    tk.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template(family),
        "bos_token": bos, "eos_token": eos, "add_bos_token": False}), encoding="utf-8")
    if config:
        (directory / "config.json").write_text(json.dumps({
            "bos_token_id": tk.token_to_id(bos), "eos_token_id": tk.token_to_id(eos)}), encoding="utf-8")
    return directory
