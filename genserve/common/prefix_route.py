"""The prefix routing key: which engine replica should serve a request so that it finds its
prompt's blocks in that replica's prefix cache.

Envoy routes the engines' gRPC calls that carry the header `ROUTE_KEY_HEADER` by consistent
hashing with bounded load (charts/genserve/files/envoy.yaml, route "affinity"): the same key goes
to the same replica while that replica is not much busier than the others. The bridge sets the
header on every Generate call it makes (bridge/serving.py); a gRPC caller sets it itself, with
`route_key` or any stable string of its own (calls without it are balanced by least request).

The key is a digest of two things:
  * the tenant: the caller's Authorization value and the request's `cache_salt`, the two things
    the engines scope their prefix cache by (engine/core/kv_cache_manager.py), so that requests
    of different API keys or salts never share a key, as they never share cached blocks;
  * the leading text: what the next request of the same conversation repeats verbatim. For a
    chat, the messages up to and including the first user message (every later turn sends them
    again before the turns that followed; for a second or later turn they are the start of the
    messages before the last user turn); for a completion, the prompt. Either is cut at
    `LEADING_BYTES` (`LEADING_TOKENS` for a prompt given as token ids), so that prompts sharing a
    long common head (a long system prompt) share a replica, and a prompt that grows by
    appending keeps its key once it is longer than the cut.

The digest is 128-bit BLAKE2b in hex (32 characters); neither the key nor the text travels in
the clear.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

from genserve.v1 import generate_pb2 as pb

ROUTE_KEY_HEADER = "x-genserve-prefix-key"
LEADING_BYTES = 4096          # of a text prompt, or of the chat opening's text (UTF-8)
LEADING_TOKENS = 1024         # of a prompt given as token ids
_PERSON = b"genserve-route"


def route_key(*, tenant: str, cache_salt: str, leading: bytes) -> str:
    """The routing key of a request: 32 hex characters, a digest of `tenant` (the caller's
    Authorization value, "" without one), `cache_salt` ("" without one) and `leading`, the
    request's leading text as bytes (`leading_bytes`). Equal inputs give equal keys; any
    difference in any of the three gives another key (each part is length-prefixed)."""
    digest = hashlib.blake2b(digest_size=16, person=_PERSON)
    for part in (tenant.encode(), cache_salt.encode(), leading):
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.hexdigest()


def chat_opening(messages: Iterable[pb.ChatMessage]) -> list[pb.ChatMessage]:
    """The messages every turn of a conversation repeats: those up to and including the first
    user message (all of them when there is none)."""
    opening = []
    for message in messages:
        opening.append(message)
        if message.role == "user":
            break
    return opening


def leading_bytes(request: pb.GenerateRequest) -> bytes:
    """The leading text of a GenerateRequest that its key covers: for `chat`, the opening's
    roles and contents (`chat_opening`); for `prompt`, its UTF-8 text; for `prompt_token_ids`,
    the ids as 4-byte little-endian integers; cut at `LEADING_BYTES` (`LEADING_TOKENS` ids).
    Empty when the request has no prompt."""
    kind = request.WhichOneof("prompt_input")
    if kind == "chat":
        parts = []
        for message in chat_opening(request.chat.messages):
            parts.append(message.role.encode() + b"\0" + message.content.encode() + b"\0")
        return b"".join(parts)[:LEADING_BYTES]
    if kind == "prompt":
        return request.prompt.encode()[:LEADING_BYTES]
    if kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids[:LEADING_TOKENS])
        return struct.pack(f"<{len(ids)}I", *ids)
    return b""


def request_route_key(request: pb.GenerateRequest, authorization: str = "") -> str:
    """The routing key of a GenerateRequest sent with the Authorization value `authorization`
    ("" without one): `route_key` over its tenant, `cache_salt` and `leading_bytes`."""
    return route_key(tenant=authorization, cache_salt=request.cache_salt,
                     leading=leading_bytes(request))
