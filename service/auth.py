"""API keys: configured keys → names; no configuration means one shared anonymous key."""

from __future__ import annotations

import json
import os
import pathlib

ANONYMOUS = "anonymous"


class Authenticator:
    """Resolves the `authorization` metadata (`Bearer <key>`) to the API key used for fairness.

    Args:
        keys: key → display name. None or empty: authentication is off and every caller shares
            the anonymous key (the local default).
    """

    def __init__(self, keys: dict[str, str] | None = None) -> None:
        self.keys = dict(keys or {})

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Authenticator":
        """Keys from `GENSERVE_API_KEYS_FILE` (JSON object key → name) or `GENSERVE_API_KEYS`
        (`key1=name1,key2=name2`); neither set means authentication is off.

        Raises ValueError on a malformed value (the key itself is never printed).
        """
        env = os.environ if environ is None else environ
        if env.get("GENSERVE_API_KEYS_FILE"):
            data = json.loads(pathlib.Path(env["GENSERVE_API_KEYS_FILE"]).read_text())
            if not isinstance(data, dict):
                raise ValueError("GENSERVE_API_KEYS_FILE must hold a JSON object of key -> name")
            return cls({str(k): str(v) for k, v in data.items()})
        keys = {}
        for item in filter(None, (s.strip() for s in env.get("GENSERVE_API_KEYS", "").split(","))):
            key, sep, name = item.partition("=")
            if not key:
                raise ValueError("GENSERVE_API_KEYS: an entry has an empty key")
            keys[key] = name if sep else f"key-{len(keys)}"
        return cls(keys)

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
