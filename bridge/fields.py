"""The field policy: what the bridge does with every field of OpenAI's completions and chat
completions requests, and with the extensions it takes beyond them (vLLM's and genserve's).

Each field is one `Rule` in `COMPLETIONS` or `CHAT`, with one of three statuses:

    honoured            it does what OpenAI documents (or, for an extension, what vLLM does)
    accepted            accepted with no effect (the notes say why that is honest); `user`,
                        `metadata`, `store`, `service_tier` and `safety_identifier` are recorded
                        in the log line and the trace span of the request
    not supported       only values that ask for nothing (null, empty, "none", `{"type": "text"}`)
                        are accepted; anything else is a 400 that says "not supported" and why

`null` means absent for every optional field. A field in neither table is a 400 naming it (typos
stay caught). The request schemas (bridge/protocol.py) have exactly these fields, and README.md's
table is `markdown_table()`'s output; tests/bridge/test_field_policy.py checks both, and walks the
openai SDK's own request types so a field OpenAI adds fails until it is classified here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

HONOURED = "honoured"
ACCEPTED = "accepted"
NOT_SUPPORTED = "not supported"
STATUSES = (HONOURED, ACCEPTED, NOT_SUPPORTED)

OPENAI = "OpenAI"
VLLM = "vLLM"
GENSERVE = "genserve"

_NO_VALUE = object()


@dataclass(frozen=True, slots=True)
class Rule:
    """One request field's policy.

    Attributes:
        status: one of `STATUSES`.
        notes: what the README says of it.
        probe: a value the field walk sends, which must be accepted (a neutral one where only
            neutral values are).
        accepts: which non-null values are accepted (None: every value the schema's type allows).
        why: the refusal's reason, for values `accepts` refuses.
        refused: a value that must be refused (the field walk sends it), or _NO_VALUE.
        origin: whose field it is (OpenAI, vLLM, genserve).
        yet: refusals say "not supported yet" (a feature genserve means to add).
        recorded: logged and put on the request's span.
        grpc: where the value travels in the gRPC GenerateRequest ("sampling.temperature"), for
            the field walk to check.
    """

    status: str
    notes: str
    probe: Any
    accepts: Callable[[Any], bool] | None = None
    why: str = ""
    refused: Any = _NO_VALUE
    origin: str = OPENAI
    yet: bool = False
    recorded: bool = False
    grpc: str = ""

    @property
    def has_refused_example(self) -> bool:
        return self.refused is not _NO_VALUE


class FieldRefused(ValueError):
    """A field's value that the policy refuses: a 400 naming the field, with `code`
    "unsupported_parameter"; a value of the wrong shape (an empty `guided_choice`) is refused
    the same way with `code` "invalid_argument"."""

    def __init__(self, field: str, message: str, code: str = "unsupported_parameter") -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code


def _sampling(name: str, probe: Any, notes: str, origin: str = OPENAI) -> Rule:
    """A sampling control the engine honours; the field walk checks it travels as
    `SamplingParams.<name>` with the probe's value."""
    return Rule(HONOURED, notes, probe, origin=origin, grpc=f"sampling.{name}")


def _recorded(notes: str, probe: Any) -> Rule:
    return Rule(ACCEPTED, f"{notes}; recorded in the request's log line and trace span", probe,
                recorded=True)


def _none_or_empty(v: Any) -> bool:
    return v in ([], {}, "", "none")


# The fields both endpoints share, by name.
_SHARED: dict[str, Rule] = {
    "model": Rule(HONOURED, "the served model, or a LoRA adapter the key may use (`GET /v1/models`, "
                            "docs/lora.md; else 404 `model_not_found`); with LoRA off any name is the "
                            "served model", "any-model", grpc="lora"),
    "temperature": Rule(HONOURED, "0 is greedy", 0.5, grpc="sampling.temperature"),
    "top_p": Rule(HONOURED, "(0, 1]", 0.9, grpc="sampling.top_p"),
    "n": Rule(HONOURED, "1..8 samples", 2, grpc="n"),
    "seed": Rule(HONOURED, "equal seeds and inputs give equal samples", 7, grpc="sampling.seed"),
    "stop": Rule(HONOURED, "a string or up to 4; the matched string is not returned", ["\n\n"],
                 grpc="sampling.stop"),
    "stream": Rule(HONOURED, "server-sent events, ending with `data: [DONE]`", True),
    "stream_options": Rule(HONOURED, "`include_usage` (a last chunk with the usage), "
                           "`continuous_usage_stats` (vLLM's: each chunk carries its choice's usage so "
                           "far), `include_obfuscation` (accepted, no effect: nothing is padded)",
                           {"include_usage": True, "continuous_usage_stats": True}),
    "presence_penalty": _sampling("presence_penalty", 0.5, "-2..2, over the generated tokens"),
    "frequency_penalty": _sampling("frequency_penalty", 0.5, "-2..2, over the generated tokens"),
    "logit_bias": _sampling("logit_bias", {"100": -100}, "token id -> bias in [-100, 100], at most 300"),
    "user": _recorded("an end-user id", "user-1"),
    # vLLM's sampling extensions.
    "top_k": Rule(HONOURED, "0 or -1 = off", 5, origin=VLLM, grpc="sampling.top_k"),
    "ignore_eos": Rule(HONOURED, "keep sampling past the end-of-sequence token", True, origin=VLLM,
                       grpc="sampling.ignore_eos"),
    "repetition_penalty": _sampling("repetition_penalty", 1.2, "> 0, 1 = off; over the prompt and "
                                    "the generated tokens", VLLM),
    "min_p": _sampling("min_p", 0.05, "0..1", VLLM),
    "min_tokens": _sampling("min_tokens", 2, "EOS, `stop_token_ids` and stop strings cannot end a "
                            "sample before this many tokens; <= max_tokens", VLLM),
    "stop_token_ids": _sampling("stop_token_ids", [2], "up to 64 token ids that end a sample "
                                "(their text is not returned)", VLLM),
    "include_stop_str_in_output": _sampling("include_stop_str_in_output", True,
                                            "keep the matched stop string (or stop token's text)", VLLM),
    "skip_special_tokens": _sampling("skip_special_tokens", False,
                                     "default true: control tokens add no text", VLLM),
    # vLLM's output constraints (bridge/constraints.py): one per request.
    "structured_outputs": Rule(HONOURED, "one of `json` (a schema), `regex`, `choice`, `grammar` (Lark), "
                               "`json_object`", {"regex": "[a-z]+"}, origin=VLLM),
    "guided_json": Rule(HONOURED, "vLLM's older name for `structured_outputs.json`", {"type": "object"},
                        origin=VLLM),
    "guided_regex": Rule(HONOURED, "older name for `structured_outputs.regex`", "[a-z]+", origin=VLLM,
                         grpc="regex"),
    "guided_choice": Rule(HONOURED, "older name for `structured_outputs.choice`", ["yes", "no"],
                          origin=VLLM, grpc="choice.options"),
    "guided_grammar": Rule(HONOURED, "older name for `structured_outputs.grammar`", 'start: "a" | "b"',
                           origin=VLLM, grpc="grammar"),
    "return_tokens_as_token_ids": Rule(HONOURED, "with `logprobs`, each token and alternative is named "
                                       "`token_id:<id>` instead of by its text (chat's `bytes` stay the "
                                       "token's own)", True, origin=VLLM),
    "prompt_logprobs": Rule(HONOURED, "0..5 alternatives: each prompt token's logprob as vLLM reports it, "
                            "on each choice (completions) or on the completion (chat): null for the first "
                            "token, then `{\"<id>\": {logprob, rank, decoded_token}}`, the prompt token "
                            "first (`rank` null when it is not among the alternatives), then the "
                            "alternatives ranked from 1; not with `stream`", 2, origin=VLLM,
                            grpc="prompt_logprobs"),
    "cache_salt": Rule(HONOURED, "cached prompt blocks are shared only by requests with the same salt "
                       "(and, by default, the same API key); up to 256 characters", "s1", origin=VLLM,
                       grpc="cache_salt"),
    # genserve's.
    "deadline_s": Rule(HONOURED, "seconds from arrival after which the request is dropped "
                       "(finish_reason cancelled, detail deadline)", 30.0, origin=GENSERVE, grpc="deadline_s"),
}


def _pick(*names: str) -> dict[str, Rule]:
    return {name: _SHARED[name] for name in names}


COMPLETIONS: dict[str, Rule] = {
    "prompt": Rule(HONOURED, "a string, a list of strings, token ids, or a list of token-id lists; "
                   "several prompts give choices prompt-major, then `n`, with usage summed", ["a", "b"]),
    **_pick("model"),
    "max_tokens": Rule(HONOURED, "1..1,000, default 16; prompt + max_tokens <= 8,192", 5, grpc="max_tokens"),
    **_pick("temperature", "top_p", "n", "seed", "stop", "stream", "stream_options"),
    "logprobs": Rule(HONOURED, "0..5 alternatives per token", 2, grpc="logprobs"),
    "echo": Rule(HONOURED, "each choice's text starts with its prompt; with `logprobs`, the prompt "
                 "tokens' logprobs come first (the first null), computed in the prompt's prefill", True),
    "best_of": Rule(HONOURED, "samples `best_of` per prompt, returns the `n` with the highest mean "
                    "token logprob; `best_of >= n`; not with `stream` (as OpenAI)", 2),
    "suffix": Rule(NOT_SUPPORTED, "fill-in-the-middle; `\"\"` accepted", "",
                   accepts=lambda v: v == "", refused="})",
                   why="the served model's vocabulary has no fill-in-the-middle tokens"),
    **_pick("presence_penalty", "frequency_penalty", "logit_bias", "user"),
    "prompt_token_ids": Rule(HONOURED, "the prompt as token ids (instead of `prompt`)", [1, 2, 3],
                             origin=GENSERVE),
    **_pick("top_k", "ignore_eos", "repetition_penalty", "min_p", "min_tokens", "stop_token_ids",
            "include_stop_str_in_output", "skip_special_tokens", "cache_salt", "deadline_s"),
    **_pick("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"),
    "response_format": Rule(HONOURED, "vLLM's extension here: `text`, `json_object`, `json_schema`, as on "
                            "chat", {"type": "json_object"}, origin=VLLM),
    **_pick("return_tokens_as_token_ids", "prompt_logprobs"),
}

_FUNCTIONS_WHY = "OpenAI's deprecated form of tools; send tools and tool_choice"
CHAT: dict[str, Rule] = {
    "messages": Rule(HONOURED, "roles system, developer, user, assistant; text content; `name` "
                     "accepted", [{"role": "user", "content": "hi", "name": "ann"}]),
    **_pick("model"),
    "max_tokens": Rule(HONOURED, "absent or null: as many as allowed (up to 1,000 and the 8,192-token "
                       "context)", 5, grpc="max_tokens"),
    "max_completion_tokens": Rule(HONOURED, "OpenAI's newer name for `max_tokens`", 5, grpc="max_tokens"),
    **_pick("temperature", "top_p", "n", "seed", "stop", "stream", "stream_options"),
    "logprobs": Rule(HONOURED, "each token's logprob and `bytes` (its own)", True, grpc="logprobs"),
    "top_logprobs": Rule(HONOURED, "0..5, with `logprobs: true`", 2),
    **_pick("presence_penalty", "frequency_penalty", "logit_bias", "user"),
    "metadata": _recorded("string pairs", {"team": "a"}),
    "store": _recorded("genserve stores nothing", False),
    "service_tier": _recorded("one tier", "auto"),
    "safety_identifier": _recorded("an end-user id", "user-1"),
    "prompt_cache_key": Rule(ACCEPTED, "prefix caching is automatic, within the API key (`cache_salt` "
                             "narrows it)", "k1"),
    "prompt_cache_retention": Rule(ACCEPTED, "cached prefixes live while the pool has room", "in_memory"),
    "prompt_cache_options": Rule(ACCEPTED, "as `prompt_cache_key`", {}),
    "prediction": Rule(ACCEPTED, "a latency hint; the output is the same without it",
                       {"type": "content", "content": "x"}),
    "reasoning_effort": Rule(ACCEPTED, "the served model does not reason", "low"),
    "verbosity": Rule(ACCEPTED, "no effect on this model", "low"),
    "parallel_tool_calls": Rule(HONOURED, "false: at most one call per answer", False),
    "response_format": Rule(HONOURED, "`text`, `json_object`, `json_schema` (`name`, `schema`, `strict`): "
                            "decoding follows the schema (llguidance), so the answer always parses",
                            {"type": "json_object"}),
    "tools": Rule(HONOURED, "functions (`parameters` may use `$defs`/`$ref`; none: no arguments); written by "
                  "the model's chat template in its own format when the template defines tool calls (hermes, "
                  "llama3_json, mistral), else by bridge/tools.py's generic prompt "
                  "([structured-outputs.md](structured-outputs.md#tool-calling)); calls are parsed into "
                  "`tool_calls`, finish_reason `tool_calls`",
                  [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "tool_choice": Rule(HONOURED, "none (text only, streamed as made), auto, required, or a named function; "
                        "required and named constrain decoding to a call whose arguments follow the "
                        "function's schema", "none"),
    "functions": Rule(NOT_SUPPORTED, "`[]` accepted", [], accepts=_none_or_empty,
                      refused=[{"name": "f"}], why=_FUNCTIONS_WHY),
    "function_call": Rule(NOT_SUPPORTED, "`\"none\"` accepted", "none", accepts=_none_or_empty,
                          refused="auto", why=_FUNCTIONS_WHY),
    "modalities": Rule(NOT_SUPPORTED, "`[\"text\"]` accepted", ["text"], accepts=lambda v: v == ["text"],
                       refused=["text", "audio"], why="the served model writes text only"),
    "audio": Rule(NOT_SUPPORTED, "null only", None, accepts=lambda v: False,
                  refused={"voice": "alloy", "format": "wav"}, why="the served model writes text only"),
    "web_search_options": Rule(NOT_SUPPORTED, "null only", None, accepts=lambda v: False, refused={},
                               why="genserve has no web search"),
    "moderation": Rule(NOT_SUPPORTED, "null only", None, accepts=lambda v: False,
                       refused={"policy": {"input": {"mode": "score"}}}, why="genserve runs no moderation model"),
    **_pick("top_k", "ignore_eos", "repetition_penalty", "min_p", "min_tokens", "stop_token_ids",
            "include_stop_str_in_output", "skip_special_tokens", "cache_salt", "deadline_s"),
    **_pick("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"),
    **_pick("return_tokens_as_token_ids", "prompt_logprobs"),
}

TABLES = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


def enforce(values: Mapping[str, Any], table: Mapping[str, Rule]) -> None:
    """Refuse the first value the policy refuses (null is always absent).

    Raises:
        FieldRefused: naming the field, saying "not supported" (or "not supported yet") and why.
    """
    for name, value in values.items():
        rule = table.get(name)
        if rule is None or value is None or rule.accepts is None or rule.accepts(value):
            continue
        yet = " yet" if rule.yet else ""
        raise FieldRefused(name, f"'{name}' is not supported{yet}: {rule.why}")


def recorded(values: Mapping[str, Any], table: Mapping[str, Rule]) -> dict[str, Any]:
    """The recorded fields (`Rule.recorded`) that `values` sets (not null)."""
    return {name: value for name, value in values.items()
            if value is not None and name in table and table[name].recorded}


def counts(table: Mapping[str, Rule], origin: str | None = OPENAI) -> dict[str, int]:
    """Fields per status (OpenAI's only, by default)."""
    out = dict.fromkeys(STATUSES, 0)
    for rule in table.values():
        if origin is None or rule.origin == origin:
            out[rule.status] += 1
    return out


def markdown_table() -> str:
    """README.md's table: every field of both endpoints, OpenAI's first, then the extensions."""
    lines = ["| field | /v1/completions | /v1/chat/completions | notes |", "|---|---|---|---|"]
    names = list(dict.fromkeys([*COMPLETIONS, *CHAT]))
    names.sort(key=lambda n: (_rule(n).origin != OPENAI, _rule(n).origin != VLLM))
    for name in names:
        comp, chat = COMPLETIONS.get(name), CHAT.get(name)
        if comp is not None and chat is not None and comp.notes != chat.notes:
            notes = f"completions: {comp.notes}; chat: {chat.notes}"
        else:
            notes = (comp or chat).notes
        why = (comp or chat).why
        if NOT_SUPPORTED in (getattr(comp, "status", ""), getattr(chat, "status", "")) and why:
            notes += f"; anything else: 400, {why}"
        origin = "" if _rule(name).origin == OPENAI else f" ({_rule(name).origin})"
        lines.append(f"| `{name}`{origin} | {comp.status if comp else '—'} | {chat.status if chat else '—'} | "
                     f"{notes} |")
    return "\n".join(lines) + "\n"


def _rule(name: str) -> Rule:
    """The rule that places a field's row: OpenAI's where either endpoint has it as OpenAI's
    (`response_format` is OpenAI's on chat, vLLM's extension on completions)."""
    rules = [r for r in (COMPLETIONS.get(name), CHAT.get(name)) if r is not None]
    return next((r for r in rules if r.origin == OPENAI), rules[0])


if __name__ == "__main__":
    print(markdown_table(), end="")
