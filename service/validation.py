"""Request validation before anything is queued: every error names the field and the limit."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.structured.spec import ConstraintError, ConstraintSpec
from genserve.common.chat_messages import ChatError, parse_messages
from genserve.v1 import generate_pb2 as pb
from service.chat import ChatTemplate
from service.stop import MAX_STOP_CHARS, MAX_STOP_STRINGS

DEFAULT_MAX_TOKENS = 16          # OpenAI completions API default
MAX_SAMPLES = 8                  # n: samples per prompt
MAX_PROMPT_CHARS = 200_000       # bound on text handed to the tokenizer (≈ 8,192 tokens × 24)
MAX_LOGIT_BIAS = 300             # logit_bias entries (OpenAI's limit)
MAX_BIAS = 100.0                 # |bias| (OpenAI's range, -100..100)
MAX_STOP_TOKEN_IDS = 64          # stop_token_ids entries
MAX_CACHE_SALT_CHARS = 256       # cache_salt: a scope name, not data (a digest's hex is 64)


class ValidationError(ValueError):
    """Bad input: gRPC INVALID_ARGUMENT / HTTP 400. `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request that passed validation: token ids and settings the engine accepts as they are."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    deadline_s: float | None
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    constraint: ConstraintSpec | None = None
    cache_salt: str = ""


class Validator:
    """Checks a `GenerateRequest` against the engine's limits and tokenizes its prompt.

    Args:
        config: limits (max_context 8,192, max_new_tokens 1,000).
        tokenizer: has `encode(text) -> list[int]` and `vocab_size`.
        chat_template: renders `chat` requests (service/chat.py); None refuses them (a model
            file without a template).
    """

    def __init__(self, config: EngineConfig, tokenizer, chat_template: ChatTemplate | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def validate(self, req: pb.GenerateRequest) -> ValidRequest:
        """Return the validated request or raise `ValidationError` naming the field."""
        cfg = self.config
        explicit = req.HasField("max_tokens")
        max_tokens = req.max_tokens if explicit else DEFAULT_MAX_TOKENS
        if not 1 <= max_tokens <= cfg.max_new_tokens:
            raise ValidationError("max_tokens", f"must be between 1 and {cfg.max_new_tokens}, got {max_tokens}")
        n = req.n if req.HasField("n") else 1
        if not 1 <= n <= MAX_SAMPLES:
            raise ValidationError("n", f"must be between 1 and {MAX_SAMPLES}, got {n}")
        which = req.WhichOneof("prompt_input")
        if which == "prompt":
            prompt_ids, field = self.tokenize_prompt(req.prompt), "prompt"
        elif which == "prompt_token_ids":
            prompt_ids = list(req.prompt_token_ids.ids)
            field = "prompt_token_ids"
            self.check_token_ids(prompt_ids, field)
        elif which == "chat":
            prompt_ids, field = self.tokenize_chat(req.chat), "messages"
        else:
            raise ValidationError("prompt", "one of prompt, prompt_token_ids or chat is required")
        if not prompt_ids:
            raise ValidationError(field, "is empty; at least one token is required")
        if which == "chat" and not explicit:
            # The chat API's default: as many tokens as the server and the context allow.
            max_tokens = min(cfg.max_new_tokens, cfg.max_context - len(prompt_ids))
            if max_tokens < 1:
                raise ValidationError(field, f"render to {len(prompt_ids)} tokens, leaving no room for an "
                                             f"answer in the {cfg.max_context}-token context")
        if len(prompt_ids) + max_tokens > cfg.max_context:
            raise ValidationError(
                field, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) is "
                       f"{len(prompt_ids) + max_tokens} tokens, over the {cfg.max_context}-token limit")
        logprobs = req.logprobs if req.HasField("logprobs") else 0
        if not 0 <= logprobs <= 5:
            raise ValidationError("logprobs", f"must be between 0 and 5, got {logprobs}")
        prompt_logprobs = req.prompt_logprobs if req.HasField("prompt_logprobs") else None
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= 5:
            raise ValidationError("prompt_logprobs", f"must be between 0 and 5, got {prompt_logprobs}")
        sampling = replace(self._sampling(req.sampling), top_logprobs=logprobs,
                           logprobs=req.HasField("logprobs"), prompt_logprobs=prompt_logprobs)
        if sampling.min_tokens > max_tokens:
            raise ValidationError("min_tokens", f"must be at most max_tokens ({max_tokens}), "
                                                f"got {sampling.min_tokens}")
        constraint = constraint_spec(req)
        if constraint is not None and sampling.min_tokens:
            # The grammar may allow only the end-of-sequence token where min_tokens bans it.
            raise ValidationError("min_tokens", "cannot be combined with a structured-output constraint")
        if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValidationError("cache_salt", f"is {len(req.cache_salt)} characters; the limit is "
                                                f"{MAX_CACHE_SALT_CHARS}")
        s = req.sampling
        return ValidRequest(prompt_ids, max_tokens, sampling, self._deadline(req), n, self._stop(s),
                            include_stop_str_in_output=s.include_stop_str_in_output,
                            skip_special_tokens=(s.skip_special_tokens
                                                 if s.HasField("skip_special_tokens") else True),
                            constraint=constraint, cache_salt=req.cache_salt)

    def tokenize_prompt(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (field `prompt`), as Generate counts them."""
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ValidationError("prompt", f"is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
        return self.tokenizer.encode(prompt)

    def tokenize_chat(self, chat: pb.ChatMessages) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (field `messages`).

        Only the template makes control tokens: they are matched in its own text, never in a
        message's (`ChatTemplate.render_pieces`, `Tokenizer.encode_pieces`).
        """
        pieces = self._render_chat(chat)
        encode_pieces = getattr(self.tokenizer, "encode_pieces", None)
        if encode_pieces is not None:
            prompt_ids = encode_pieces(pieces)
        else:                               # a tokenizer without control tokens
            prompt_ids = self.tokenizer.encode("".join(text for text, _ in pieces))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and prompt_ids[:2] == [bos, bos]:
            prompt_ids = prompt_ids[1:]     # the template wrote the BOS the tokenizer adds
        return prompt_ids

    def check_token_ids(self, ids: list[int], field: str) -> None:
        """Raise `ValidationError` naming `field` for an id outside the vocabulary."""
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ValidationError(field, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")

    def _render_chat(self, chat: pb.ChatMessages) -> list[tuple[str, bool]]:
        """The conversation as prompt pieces (`ChatTemplate.render_pieces`), rendered with the
        model's chat template: with its tools (``tools_json``), earlier tool calls and tool
        results when the template defines tool calls (`ChatTemplate.defines_tools`).

        Raises:
            ValidationError: naming the field: no template; bad messages (``messages[1].role``);
                tools or tool turns for a template without tool syntax, ``tools`` that are not a
                JSON array of objects, or tools / tool calls holding a control token's text (the
                template writes them as its own text, where it would open or close turns); the
                template refusing the conversation (``messages``); a prompt over the length limit.
        """
        if self.chat_template is None:
            raise ValidationError("messages", "the served model has no chat template; "
                                              "send a prompt to /v1/completions instead")
        native = self.chat_template.defines_tools
        tools = self._tools(chat.tools_json) if chat.tools_json else None
        if tools is not None and not native:
            raise ValidationError("tools", "the served model's chat template defines no tool calls; "
                                           "write the tools into the conversation instead")
        try:
            messages = parse_messages([_message_dict(m) for m in chat.messages], tools=native)
            for i, m in enumerate(messages):
                for j, call in enumerate(m.tool_calls):
                    at = f"messages[{i}].tool_calls[{j}]"
                    self._no_control_text(call.id, f"{at}.id")
                    self._no_control_text(call.name, f"{at}.function.name")
                    self._no_control_text(call.arguments, f"{at}.function.arguments")
                if m.tool_call_id is not None:
                    self._no_control_text(m.tool_call_id, f"messages[{i}].tool_call_id")
            pieces = self.chat_template.render_pieces(messages, tools=tools)
        except ChatError as e:
            raise ValidationError(e.field, e.message) from None
        length = sum(len(text) for text, _ in pieces)
        if length > MAX_PROMPT_CHARS:
            raise ValidationError("messages", f"render to {length} characters; the limit is "
                                              f"{MAX_PROMPT_CHARS}")
        return pieces

    def _tools(self, text: str) -> list:
        """``ChatMessages.tools_json`` as the template's ``tools``. Raises ValidationError (field
        ``tools``): not a JSON array of objects, over the length limit, or holding control-token
        text."""
        if len(text) > MAX_PROMPT_CHARS:
            raise ValidationError("tools", f"is {len(text)} characters; the limit is {MAX_PROMPT_CHARS}")
        try:
            tools = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValidationError("tools", f"is not JSON: {e}") from None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValidationError("tools", "must be a JSON array of tool objects")
        for i, tool in enumerate(tools):
            self._no_control_text(json.dumps(tool, ensure_ascii=False), f"tools[{i}]")
        return tools

    def _no_control_text(self, text: str, field: str) -> None:
        """Raise ValidationError naming `field` when `text` (written by the template as its own
        text) holds a control token's text; the arguments' JSON is checked as the template writes
        it (decoded escapes included)."""
        find = getattr(self.tokenizer, "control_token_in", None)
        if find is None or not text:
            return
        try:
            decoded = json.dumps(json.loads(text), ensure_ascii=False)
        except (json.JSONDecodeError, RecursionError):
            decoded = text
        found = find(text) or find(decoded)
        if found is not None:
            raise ValidationError(field, f"holds the control token {found!r}; tools and tool calls "
                                         "may not hold the model's control tokens")

    def _stop(self, s: pb.SamplingParams) -> tuple[str, ...]:
        if len(s.stop) > MAX_STOP_STRINGS:
            raise ValidationError("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(s.stop)}")
        for text in s.stop:
            if not 0 < len(text) <= MAX_STOP_CHARS:
                raise ValidationError("stop", f"each string must have 1 to {MAX_STOP_CHARS} characters")
        return tuple(s.stop)

    def _sampling(self, s: pb.SamplingParams) -> SamplingParams:
        temperature = s.temperature if s.HasField("temperature") else 1.0
        if not math.isfinite(temperature) or temperature < 0:
            raise ValidationError("temperature", f"must be a finite number >= 0, got {temperature}")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise ValidationError("top_p", f"must be in (0, 1], got {top_p}")
        top_k = s.top_k if s.HasField("top_k") else 0
        if top_k < -1:
            raise ValidationError("top_k", f"must be -1, 0 (off) or a positive count, got {top_k}")
        seed = s.seed if s.HasField("seed") else None
        penalties = {}
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(s, name) if s.HasField(name) else 0.0
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValidationError(name, f"must be in [-2, 2], got {value}")
            penalties[name] = float(value)
        repetition = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
        if not (math.isfinite(repetition) and repetition > 0):
            raise ValidationError("repetition_penalty", f"must be a finite number > 0, got {repetition}")
        min_p = s.min_p if s.HasField("min_p") else 0.0
        if not (math.isfinite(min_p) and 0.0 <= min_p <= 1.0):
            raise ValidationError("min_p", f"must be in [0, 1], got {min_p}")
        return SamplingParams(temperature=float(temperature), top_k=max(0, top_k), top_p=float(top_p),
                              seed=seed, ignore_eos=s.ignore_eos, repetition_penalty=float(repetition),
                              min_p=float(min_p), logit_bias=self._logit_bias(s),
                              min_tokens=s.min_tokens if s.HasField("min_tokens") else 0,
                              stop_token_ids=self._stop_token_ids(s), **penalties)

    def _logit_bias(self, s: pb.SamplingParams) -> tuple[tuple[int, float], ...]:
        if len(s.logit_bias) > MAX_LOGIT_BIAS:
            raise ValidationError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(s.logit_bias)}")
        self.check_token_ids(list(s.logit_bias), "logit_bias")
        for token, bias in s.logit_bias.items():
            if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise ValidationError("logit_bias", f"the bias of token {token} must be in "
                                                    f"[-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")
        return tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items()))

    def _stop_token_ids(self, s: pb.SamplingParams) -> tuple[int, ...]:
        if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValidationError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got "
                                                    f"{len(s.stop_token_ids)}")
        ids = list(s.stop_token_ids)
        self.check_token_ids(ids, "stop_token_ids")
        return tuple(dict.fromkeys(ids))

    def _deadline(self, req: pb.GenerateRequest) -> float | None:
        if not req.HasField("deadline_s"):
            return None
        d = req.deadline_s
        if not (math.isfinite(d) and 0 < d <= self.config.default_deadline_s):
            raise ValidationError("deadline_s", f"must be in (0, {self.config.default_deadline_s:g}] seconds, got {d}")
        return float(d)


def constraint_spec(req: pb.GenerateRequest) -> ConstraintSpec | None:
    """The request's `constraint` oneof as a `ConstraintSpec` (None when absent); its shape and
    size only: whether it compiles is the grammar compiler's to say.

    Raises:
        ValidationError: naming the constraint's field (too long, no choices, bad JSON text).
    """
    which = req.WhichOneof("constraint")
    try:
        if which is None:
            return None
        if which == "json_schema":
            return ConstraintSpec.json_schema(req.json_schema, field="json_schema")
        if which == "json_object":
            return ConstraintSpec("json_object", "", field="json_object")
        if which == "choice":
            return ConstraintSpec.choices(list(req.choice.options), field="choice")
        return ConstraintSpec(which, getattr(req, which), field=which)
    except ConstraintError as e:
        raise ValidationError(e.field, e.reason) from None


def _message_dict(m: pb.ChatMessage) -> dict:
    """A gRPC chat message as an OpenAI message dict (`parse_messages` checks it): tool calls and
    a tool call id only when set, null content for an assistant message that only calls tools."""
    out: dict = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
        if not m.content:
            out["content"] = None
    if m.tool_call_id or m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out
