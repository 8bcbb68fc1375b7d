"""Which LoRA adapter a request runs on, per API key: GENSERVE_API_KEYS' adapter lists
and defaults, GENSERVE_ADMIN_KEYS, the JSON file form, and the servicer's resolution of a
request's `lora` (a refused adapter and a missing one are the same LookupError)."""

from __future__ import annotations

import json

import pytest

from engine.core.request import LoraRequest
from genserve.v1 import generate_pb2 as pb
from service.auth import OPEN, Authenticator, KeyPolicy
from service.servicer import GenerateServicer


def test_key_entries_carry_adapters_default_and_admin():
    auth = Authenticator.from_env({"GENSERVE_API_KEYS": "k1=alice:sql|chat@sql,k2=bob:*,k3=carol:,k4=dave",
                                   "GENSERVE_ADMIN_KEYS": "dave"})
    assert auth.keys == {"k1": "alice", "k2": "bob", "k3": "carol", "k4": "dave"}
    assert auth.policy("k1") == KeyPolicy(frozenset({"sql", "chat"}), "sql", False)
    assert auth.policy("k2") == KeyPolicy(None, "", False)
    assert auth.policy("k3").adapters == frozenset() and not auth.policy("k3").allows("sql")
    assert auth.policy("k4") == KeyPolicy(None, "", True)
    assert Authenticator().policy("anonymous") is OPEN and OPEN.admin
    with pytest.raises(ValueError, match="default adapter 'x'"):
        Authenticator.from_env({"GENSERVE_API_KEYS": "k1=alice:sql@x"})


def test_keys_file_holds_policies(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": "alice", "k2": {"name": "ops", "admin": True},
                                "k3": {"name": "bob", "adapters": ["chat"], "default_adapter": "chat"}}))
    auth = Authenticator.from_env({"GENSERVE_API_KEYS_FILE": str(path)})
    assert auth.keys == {"k1": "alice", "k2": "ops", "k3": "bob"}
    assert auth.policy("k1") == KeyPolicy() and auth.policy("k2").admin
    assert auth.policy("k3") == KeyPolicy(frozenset({"chat"}), "chat", False)


class FakeAdapters:
    """A registry holding `names` (engine.runner.lora.LoraRegistry's `request`)."""

    def __init__(self, *names: str) -> None:
        self.names = list(names)

    def adapters(self) -> list[str]:
        return list(self.names)

    def request(self, name: str) -> LoraRequest:
        if name not in self.names:
            raise KeyError(name)
        return LoraRequest(name, self.names.index(name) + 1)


def servicer(enabled: bool = True) -> GenerateServicer:
    s = GenerateServicer(auth=Authenticator.from_env({"GENSERVE_API_KEYS": "k1=alice:sql@sql,k2=bob:chat,k3=ops"}))
    s.info = pb.InfoResponse(model_name="base")
    s.adapters, s.lora_enabled = FakeAdapters("sql", "chat"), enabled
    return s


def test_a_request_runs_on_its_adapter_its_keys_default_or_the_base():
    s = servicer()
    assert s.lora_for("sql", "k1") == LoraRequest("sql", 1)
    assert s.lora_for("", "k1") == LoraRequest("sql", 1)        # alice's default
    assert s.lora_for("base", "k1") == LoraRequest("sql", 1)
    assert s.lora_for("", "k2") is None and s.lora_for("base", "k3") is None
    assert s.lora_for("chat", "k3") == LoraRequest("chat", 2)   # no list: every adapter
    for name, key in (("chat", "k1"), ("sql", "k2"), ("gone", "k3")):
        with pytest.raises(LookupError):                        # refused or missing: one answer
            s.lora_for(name, key)
    off = servicer(enabled=False)
    off.adapters = FakeAdapters()
    assert off.lora_for("gpt-4o", "k3") is None                 # LoRA off: any name is the base


def test_a_server_started_without_adapters_serves_them_while_one_loaded_at_run_time_is_loaded():
    s = servicer(enabled=False)
    s.adapters = FakeAdapters()
    assert not s.serves_adapters() and s.lora_for("gpt-4o", "k3") is None
    s.adapters.names.append("late")                             # loaded by an admin at run time
    assert s.serves_adapters() and s.lora_for("late", "k3") == LoraRequest("late", 1)
    with pytest.raises(LookupError):
        s.lora_for("gpt-4o", "k3")
    s.adapters.names.remove("late")                             # its unload: any name is the base again,
    s.unloaded_adapters.add("late")                             # but never the unloaded adapter's
    assert not s.serves_adapters() and s.lora_for("gpt-4o", "k3") is None
    with pytest.raises(LookupError):
        s.lora_for("late", "k3")
