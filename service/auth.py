"""API keys: configured keys → names, the LoRA adapters each may use and its default, and the
admin keys that may load and unload adapters; no configuration means one shared anonymous key
(every adapter, admin).

`GENSERVE_API_KEYS` entries are `key=name`, or `key=name:ADAPTERS` with ADAPTERS `a|b` (the
adapters the key may use; `*` every one; empty: none, the base model only), optionally
`@default` after it (the adapter a request that names the base model, or no model, runs on):
`k1=alice:support|sql@support,k2=bob:*,k3=carol:`. A key without `:` may use every adapter.
`GENSERVE_ADMIN_KEYS` lists the names (not the keys) of the admin keys: `alice,ops`.
`GENSERVE_API_KEYS_FILE` holds the same as JSON: key → name, or key → {"name": ..., "adapters":
[...] or "*", "default_adapter": ..., "admin": true}.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """What one API key may do beyond generating from the base model.

    Attributes:
        adapters: the LoRA adapter names it may use; None: every adapter.
        default_adapter: the adapter its requests run on when they name the base model or no
            model; "" for the base model.
        admin: it may load and unload adapters.
    """

    adapters: frozenset[str] | None = None
    default_adapter: str = ""
    admin: bool = False

    def allows(self, adapter: str) -> bool:
        """Whether the key may run on `adapter`."""
        return self.adapters is None or adapter in self.adapters


# The anonymous caller of a server without keys: every adapter, admin (a local server).
OPEN = KeyPolicy(admin=True)


def _parse_policy(item: str, admin_names: set[str], name: str) -> KeyPolicy:
    """The policy of a `GENSERVE_API_KEYS` entry's part after `name:` (module docstring)."""
    adapters, _, default = item.partition("@")
    allowed = None if adapters.strip() == "*" else frozenset(a.strip() for a in adapters.split("|") if a.strip())
    default = default.strip()
    if default and allowed is not None and default not in allowed:
        raise ValueError(f"GENSERVE_API_KEYS: key {name!r}'s default adapter {default!r} is not among its adapters")
    return KeyPolicy(allowed, default, name in admin_names)


class Authenticator:
    """Resolves the `authorization` metadata (`Bearer <key>`) to the API key used for fairness.

    Args:
        keys: key → display name. None or empty: authentication is off and every caller shares
            the anonymous key (the local default).
        policies: key → `KeyPolicy` (adapters, default adapter, admin); a key not listed may use
            every adapter and is not an admin. Without keys the anonymous caller is `OPEN`.
    """

    def __init__(self, keys: dict[str, str] | None = None,
                 policies: dict[str, KeyPolicy] | None = None) -> None:
        self.keys = dict(keys or {})
        self.policies = dict(policies or {})

    def policy(self, key: str) -> KeyPolicy:
        """The `KeyPolicy` of an authenticated key (`api_key`'s answer)."""
        if not self.keys:
            return OPEN
        return self.policies.get(key, KeyPolicy())

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Authenticator":
        """Keys from `GENSERVE_API_KEYS_FILE` (JSON object key → name, or key → policy) or
        `GENSERVE_API_KEYS` (`key1=name1,key2=name2:adapterA|adapterB@adapterA`), admin keys from
        `GENSERVE_ADMIN_KEYS` (names; module docstring); neither set means authentication is off.

        Raises ValueError on a malformed value (the key itself is never printed).
        """
        env = os.environ if environ is None else environ
        admins = {n.strip() for n in env.get("GENSERVE_ADMIN_KEYS", "").split(",") if n.strip()}
        keys: dict[str, str] = {}
        policies: dict[str, KeyPolicy] = {}
        if env.get("GENSERVE_API_KEYS_FILE"):
            data = json.loads(pathlib.Path(env["GENSERVE_API_KEYS_FILE"]).read_text())
            if not isinstance(data, dict):
                raise ValueError("GENSERVE_API_KEYS_FILE must hold a JSON object of key -> name")
            for k, v in data.items():
                if isinstance(v, dict):
                    name = str(v.get("name", f"key-{len(keys)}"))
                    adapters = v.get("adapters", "*")
                    spec = "*" if adapters == "*" else "|".join(map(str, adapters))
                    policy = _parse_policy(f"{spec}@{v.get('default_adapter') or ''}", admins, name)
                    policies[str(k)] = KeyPolicy(policy.adapters, policy.default_adapter,
                                                 policy.admin or bool(v.get("admin")))
                else:
                    name = str(v)
                    policies[str(k)] = KeyPolicy(admin=name in admins)
                keys[str(k)] = name
            return cls(keys, policies)
        for item in filter(None, (s.strip() for s in env.get("GENSERVE_API_KEYS", "").split(","))):
            key, sep, rest = item.partition("=")
            if not key:
                raise ValueError("GENSERVE_API_KEYS: an entry has an empty key")
            name, colon, spec = rest.partition(":")
            name = name if sep and name else f"key-{len(keys)}"
            keys[key] = name
            policies[key] = _parse_policy(spec, admins, name) if colon else KeyPolicy(admin=name in admins)
        return cls(keys, policies)

    @property
    def enabled(self) -> bool:
        """True when keys are configured."""
        return bool(self.keys)

    def api_key(self, authorization: str | None) -> str | None:
        """The caller's key, or None when keys are configured and this one is missing/unknown."""
        if not self.keys:
            return ANONYMOUS
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization[len("Bearer "):].strip()
        return key if key in self.keys else None
