"""Tool-call formats by name, as vLLM's ``--tool-call-parser`` names them, and which one a model
family's chat template teaches.

A chat template that reads the ``tools`` variable (service/chat.py, `ChatTemplate.defines_tools`)
writes the tools, earlier tool calls and tool results in the format its model was trained on, and
the model answers with calls in that format:

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3,
  Qwen3-MoE; the Hermes 2 Pro format Qwen adopted),
- ``llama3_json``: a bare ``{"name": ..., "parameters": {...}}``, possibly after
  ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3),
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral v0.3, Nemo,
  Mixtral).

Which format a family's templates use is read off the published templates (vLLM's tool-calling
docs pair them the same way: ``--tool-call-parser hermes`` for Qwen2.5, ``llama3_json`` for
Llama 3.1, ``mistral`` for Mistral). A template without tool syntax (SmolLM2, Gemma, Phi-3) gets
no parser: the bridge writes the tools into the conversation itself (bridge/tools.py, the generic
prompt). The bridge parses and constrains each format (bridge/tools.py `ToolFormat`); the engine
chooses one at load (`choose_tool_call_parser`) and reports it in ``InfoResponse.tool_call_parser``.
"""

from __future__ import annotations

from types import MappingProxyType

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
"""The tool-call formats genserve writes and parses, by vLLM's ``--tool-call-parser`` names."""

AUTO = "auto"
"""``--tool-call-parser auto`` (the default): the family's format (`family_tool_call_parser`)."""

FAMILY_TOOL_CALL_PARSERS = MappingProxyType({
    "Qwen2ForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
    "LlamaForCausalLM": "llama3_json",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mistral",
})
"""Checkpoint ``architectures`` name -> the format its family's published chat templates teach
(read-only). Gemma 2/3 and Phi-3 templates define no tool calls: none."""


def family_tool_call_parser(architecture: str) -> str | None:
    """The tool-call format of a family (`FAMILY_TOOL_CALL_PARSERS`), or None for a family whose
    templates define no tool calls."""
    return FAMILY_TOOL_CALL_PARSERS.get(architecture)


def choose_tool_call_parser(architecture: str, template_defines_tools: bool, requested: str = AUTO) -> str:
    """The tool-call format the served model uses: "" (none: the bridge's generic tool prompt)
    when its chat template does not read ``tools``; else the requested one, or with ``auto`` the
    family's (`family_tool_call_parser`; "" for a family without one, e.g. a Phi-4 template).

    Args:
        architecture: the checkpoint's ``architectures`` name (`ModelArgs.architecture`).
        template_defines_tools: the served chat template reads ``tools``.
        requested: ``--tool-call-parser``: ``auto`` or one of `TOOL_CALL_PARSERS`.
    Raises:
        ValueError: `requested` is not ``auto`` or a known name; or a parser was named for a model
            whose template defines no tool calls (the model would never see the tools).
    """
    if requested != AUTO and requested not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be auto or one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {requested!r}")
    if not template_defines_tools:
        if requested != AUTO:
            raise ValueError(f"--tool-call-parser {requested}: the model's chat template does not read "
                             "`tools` (it defines no tool calls); leave it at auto to use the generic "
                             "tool prompt")
        return ""
    if requested != AUTO:
        return requested
    return family_tool_call_parser(architecture) or ""
