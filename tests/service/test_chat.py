"""Chat templates: rendering equals transformers' apply_chat_template; bad messages name the field."""

from __future__ import annotations


import pytest

from engine.tokenizer import Tokenizer
from genserve.common.chat_messages import ChatError, ChatMessage, MAX_MESSAGES, parse_messages
from service.chat import ChatTemplate, template_for

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]}],
    [{"role": "user", "content": "  leading spaces\n\nand blank lines  "}],
]


@pytest.fixture(scope="module")
def gguf_template() -> ChatTemplate:
    template = template_for(Tokenizer.from_gguf())
    assert template is not None, "the embedded model file carries a chat template"
    return template


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_rendering_equals_transformers(gguf_template: ChatTemplate, conversation: list[dict]):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = parse_messages(conversation)
    plain = [{"role": m.role, "content": m.content} for m in messages]
    expected = chat_utils.render_jinja_template(
        conversations=[plain], chat_template=gguf_template.source, add_generation_prompt=True,
        **gguf_template.special_tokens)[0][0]
    assert gguf_template.render(messages) == expected


def test_smollm2_layout_and_tokens(gguf_template: ChatTemplate):
    text = gguf_template.render(parse_messages([{"role": "user", "content": "Hi"}]))
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = Tokenizer.from_gguf().encode(text)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2   # <|im_start|>, <|im_end|>
    assert gguf_template.special_tokens["eos_token"] == "<|im_end|>"


def test_developer_role_renders_as_system(gguf_template: ChatTemplate):
    a = gguf_template.render(parse_messages([{"role": "developer", "content": "x"},
                                             {"role": "user", "content": "y"}]))
    b = gguf_template.render(parse_messages([{"role": "system", "content": "x"},
                                             {"role": "user", "content": "y"}]))
    assert a == b and a.startswith("<|im_start|>system\nx<|im_end|>")


@pytest.mark.parametrize(("raw", "field"), [
    ("hello", "messages"),
    ([], "messages"),
    ([{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1), "messages"),
    (["hi"], "messages[0]"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
    ([{"role": 3, "content": "b"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 7}], "messages[0].content"),
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "a", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "a", "name": 5}], "messages[0].name"),
])
def test_bad_messages_name_the_field(raw, field):
    with pytest.raises(ChatError) as e:
        parse_messages(raw)
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_template_failures_are_chat_errors():
    refusing = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be "
                            "user') }}{% endif %}{{ messages[0]['content'] }}")
    assert refusing.render([ChatMessage("user", "ok")]) == "ok"
    with pytest.raises(ChatError, match="first must be user") as e:
        refusing.render([ChatMessage("system", "no")])
    assert e.value.field == "messages"
    with pytest.raises(ChatError) as e:
        ChatTemplate("{% for %}")
    assert e.value.field == "chat_template"
    # The sandbox: a template cannot reach Python internals.
    escaping = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatError):
        escaping.render([ChatMessage("user", "x")])


def _chat_request(*messages: tuple[str, str], **fields) -> "pb.GenerateRequest":
    from genserve.v1 import generate_pb2 as pb
    req = pb.GenerateRequest(**fields)
    req.chat.SetInParent()
    for role, content in messages:
        req.chat.messages.add(role=role, content=content)
    return req


def test_validator_renders_chat_and_names_bad_fields(gguf_template: ChatTemplate):
    from engine.config import EngineConfig
    from service.validation import ValidationError, Validator
    tokenizer = Tokenizer.from_gguf()
    v = Validator(EngineConfig(), tokenizer, gguf_template)
    valid = v.validate(_chat_request(("user", "Hi"), max_tokens=5))
    expected = tokenizer.encode(gguf_template.render(parse_messages([{"role": "user", "content": "Hi"}])))
    assert valid.prompt_ids == expected and valid.max_tokens == 5
    for req, field in [(_chat_request(), "messages"),
                       (_chat_request(("user", "a"), ("wizard", "b")), "messages[1].role"),
                       (_chat_request(("user", "x" * 300_000)), "messages"),
                       (_chat_request(("user", "a " * 8000), max_tokens=1000), "messages")]:
        with pytest.raises(ValidationError) as e:
            v.validate(req)
        assert e.value.field == field, str(e.value)
    with pytest.raises(ValidationError, match="no chat template") as e:
        Validator(EngineConfig(), tokenizer).validate(_chat_request(("user", "Hi")))
    assert e.value.field == "messages"
