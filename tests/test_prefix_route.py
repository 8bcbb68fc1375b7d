"""The prefix routing key (genserve/common/prefix_route.py) and the bridge's header: a
conversation keeps its key across turns, different conversations and different tenants (API key,
cache_salt) get different keys, and every Generate call the bridge makes carries one."""

from __future__ import annotations

from genserve.common import prefix_route
from genserve.common.prefix_route import LEADING_BYTES, LEADING_TOKENS, request_route_key
from genserve.v1 import generate_pb2 as pb

SYSTEM = "You are a careful assistant. " * 40


def chat(*turns: tuple[str, str], cache_salt: str = "") -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=role, content=content) for role, content in turns]
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=messages), cache_salt=cache_salt)


def turns(n: int, system: str = SYSTEM, first: str = "hello") -> pb.GenerateRequest:
    """Turn n (1-based) of one conversation: the system prompt, n user messages, n - 1 answers."""
    messages = [("system", system), ("user", first)]
    for i in range(1, n):
        messages += [("assistant", f"answer {i}"), ("user", f"question {i + 1}")]
    return chat(*messages)


def test_key_is_32_hex_characters():
    key = request_route_key(turns(1), "Bearer sk-a")
    assert len(key) == 32 and int(key, 16) >= 0


def test_every_turn_of_a_conversation_has_the_same_key():
    keys = {request_route_key(turns(n), "Bearer sk-a") for n in range(1, 6)}
    assert len(keys) == 1
    # also without a system prompt: the opening is the first user message
    keys = {request_route_key(chat(*[("user", "hi"), ("assistant", "yo"), ("user", "more")][:k]), "")
            for k in (1, 3)}
    assert len(keys) == 1


def test_different_conversations_have_different_keys():
    keys = {request_route_key(turns(2, system=f"assistant {i}. " + SYSTEM[:200]), "") for i in range(50)}
    assert len(keys) == 50
    # a short system prompt: the first user message tells conversations apart
    assert request_route_key(turns(1, system="short", first="a"), "") != \
        request_route_key(turns(1, system="short", first="b"), "")


def test_the_tenant_is_part_of_the_key():
    """Another API key or cache_salt never shares a key, as it never shares cached blocks."""
    same = turns(3)
    assert request_route_key(same, "Bearer sk-a") != request_route_key(same, "Bearer sk-b")
    assert request_route_key(same, "") != request_route_key(same, "Bearer sk-a")
    salted = chat(*[(m.role, m.content) for m in same.chat.messages], cache_salt="s1")
    assert request_route_key(salted, "Bearer sk-a") != request_route_key(same, "Bearer sk-a")
    # length-prefixed parts: moving bytes between tenant and salt changes the key
    assert prefix_route.route_key(tenant="ab", cache_salt="", leading=b"x") != \
        prefix_route.route_key(tenant="a", cache_salt="b", leading=b"x")


def test_a_long_common_head_shares_a_key():
    """Past LEADING_BYTES only the head counts: conversations opening with one long system prompt
    go to the replica holding it (bounded load spreads them when it gets busy)."""
    long_system = "x" * (LEADING_BYTES + 10)
    assert request_route_key(turns(1, system=long_system, first="a"), "") == \
        request_route_key(turns(1, system=long_system, first="b"), "")


def test_completion_prompts_are_cut_at_the_leading_bytes():
    head = "p" * LEADING_BYTES
    assert request_route_key(pb.GenerateRequest(prompt=head + "turn one"), "") == \
        request_route_key(pb.GenerateRequest(prompt=head + "turn one, turn two"), "")
    assert request_route_key(pb.GenerateRequest(prompt="short a"), "") != \
        request_route_key(pb.GenerateRequest(prompt="short b"), "")
    ids = list(range(LEADING_TOKENS))
    assert request_route_key(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids + [1])), "") == \
        request_route_key(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids + [2, 3])), "")
