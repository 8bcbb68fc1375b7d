"""Multi-LoRA serving through the whole stack: `genserve serve --lora-modules` over a
tiny Llama 3 checkpoint with tiny PEFT adapters built in the test (tests/engine/lora_adapters.py),
API keys with adapter lists (GENSERVE_API_KEYS) and an admin key (GENSERVE_ADMIN_KEYS).

Checked: greedy tokens on an adapter (gRPC `lora`) equal PEFT's own greedy continuation; REST's
`model` selects the adapter (the openai client); GET /v1/models lists each adapter with its
parent, per key; a key refused another key's adapter gets the 404 of an adapter that does not
exist; a key's default adapter; admin-only load and unload, a stream running on an adapter that
is unloaded finishes on it and new requests get 404; a bad directory is a 400 naming the field and
the server keeps serving; the adapter counters on /metrics.
"""

from __future__ import annotations


import grpc
import httpx
import openai
import pytest
import torch

from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import start_server
from tests.engine.hf_families import build_checkpoint
from tests.engine.lora_adapters import build_adapter, peft_logits

pytestmark = pytest.mark.slow

KEYS = {"key-ops": "ops:*", "key-alice": "alice:sql@sql", "key-bob": "bob:chat"}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """(checkpoint, {adapter name: directory}, the server) with adapters "sql" and "chat" loaded at
    start and "late" on disk for a load at run time."""
    root = tmp_path_factory.mktemp("lora_serve")
    ckpt = build_checkpoint("llama3", root / "tiny-llama")
    adapters = {"sql": build_adapter(ckpt, root / "sql", seed=1, r=8),
                "chat": build_adapter(ckpt, root / "chat", seed=2, r=16, targets=("q_proj", "v_proj", "down_proj")),
                "late": build_adapter(ckpt, root / "late", seed=3, r=4)}
    env = {"GENSERVE_API_KEYS": ",".join(f"{k}={v}" for k, v in KEYS.items()), "GENSERVE_ADMIN_KEYS": "ops"}
    gen = start_server("--model", str(ckpt), "--dtype", "float32", "--max-loras", "2",
                       "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}",
                       env=env, kv_pool_gib=0.05)
    server = next(gen)
    try:
        yield ckpt, adapters, server
    finally:
        next(gen, None)


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def grpc_tokens(server, key: str, prompt: list[int], lora: str = "", n: int = NEW_TOKENS) -> list[int]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        messages = stub.Generate(pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=n, lora=lora,
            sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True)),
            metadata=(("authorization", f"Bearer {key}"),), timeout=120)
        return [m.token.token_id for m in messages if m.HasField("token")]


def peft_greedy(ckpt, adapter, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(peft_logits(ckpt, adapter, ids)[-1].argmax()))
    return ids[len(prompt):]


PROMPT = torch.randint(3, 320, (24,), generator=torch.Generator().manual_seed(4)).tolist()


def test_adapter_tokens_equal_peft_and_rest_model_selects_the_adapter(lora):
    ckpt, adapters, server = lora
    want = peft_greedy(ckpt, adapters["sql"], PROMPT)
    assert want != peft_greedy(ckpt, None, PROMPT)
    assert grpc_tokens(server, "key-ops", PROMPT, "sql") == want
    assert grpc_tokens(server, "key-ops", PROMPT) == peft_greedy(ckpt, None, PROMPT)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="key-ops")
    on_sql = client.completions.create(model="sql", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                       logprobs=1, extra_body={"ignore_eos": True})
    assert on_sql.usage.completion_tokens == NEW_TOKENS
    base = client.completions.create(model=ckpt.name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                     logprobs=1, extra_body={"ignore_eos": True})
    assert on_sql.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs
    # each answer names the model that answered: the adapter, or the served model
    assert (on_sql.model, base.model) == ("sql", ckpt.name)
    chunks = list(client.completions.create(model="sql", prompt=PROMPT, max_tokens=3, stream=True))
    assert chunks and {c.model for c in chunks} == {"sql"}
    # alice's default adapter answers when she names none
    alice = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="key-alice")
    assert alice.completions.create(model="", prompt=PROMPT, max_tokens=2).model == "sql"
    # alice's default adapter is sql: naming the base model runs on it
    assert grpc_tokens(server, "key-alice", PROMPT) == want


def test_models_list_each_key_its_adapters_with_their_parent(lora):
    ckpt, adapters, server = lora
    listed = httpx.get(f"{server.base_url}/v1/models", headers=headers("key-ops"), timeout=30).json()["data"]
    by_id = {m["id"]: m for m in listed}
    assert set(by_id) == {ckpt.name, "sql", "chat"}
    assert by_id["sql"]["parent"] == ckpt.name and by_id["sql"]["root"] == str(adapters["sql"])
    assert by_id[ckpt.name]["parent"] is None
    alice = httpx.get(f"{server.base_url}/v1/models", headers=headers("key-alice"), timeout=30).json()["data"]
    assert [m["id"] for m in alice] == [ckpt.name, "sql"]
    assert httpx.get(f"{server.base_url}/v1/models/chat", headers=headers("key-alice"), timeout=30).status_code == 404


def test_a_key_refused_another_keys_adapter_gets_the_404_of_a_missing_one(lora):
    ckpt, adapters, server = lora
    answers = []
    for model in ("chat", "no-such-adapter"):
        r = httpx.post(f"{server.base_url}/v1/completions", headers=headers("key-alice"), timeout=60,
                       json={"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found"
        answers.append(error["message"].replace(model, "X"))
    assert answers[0] == answers[1]                 # nothing tells the two apart
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="key-bob")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    assert client.completions.create(model="chat", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_load_and_unload_while_a_stream_runs(lora):
    ckpt, adapters, server = lora
    url = server.base_url
    body = {"lora_name": "late", "lora_path": str(adapters["late"])}
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers=headers("key-alice"), json=body, timeout=60)
    assert r.status_code == 403, r.text
    bad = httpx.post(f"{url}/v1/load_lora_adapter", headers=headers("key-ops"), timeout=60,
                     json={"lora_name": "broken", "lora_path": str(adapters["late"].parent / "nowhere")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    assert "no such directory" in bad.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers=headers("key-ops"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    want = peft_greedy(ckpt, adapters["late"], PROMPT, 96)
    got: list[int] = []
    finished_at_unload = None
    with grpc.insecure_channel(server.grpc_target) as channel:
        stream = pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=PROMPT), max_tokens=96, lora="late",
            sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True)),
            metadata=(("authorization", "Bearer key-ops"),), timeout=120)
        for message in stream:
            if message.HasField("token"):
                got.append(message.token.token_id)
                if len(got) == 1:                    # the stream runs on "late": unload it now
                    finished_at_unload = server.metrics().get("genserve_lora_tokens_total{adapter=late,kind=generated}")
                    r = httpx.post(f"{url}/v1/unload_lora_adapter", headers=headers("key-ops"),
                                   json={"lora_name": "late"}, timeout=60)
                    assert r.status_code == 200, r.text
    print(f"tokens generated on 'late' when it was unloaded: {finished_at_unload} of 96")
    assert got == want                               # finished on the adapter, no stream dropped
    r = httpx.post(f"{url}/v1/completions", headers=headers("key-ops"), timeout=60,
                   json={"model": "late", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    again = httpx.post(f"{url}/v1/unload_lora_adapter", headers=headers("key-ops"), json={"lora_name": "late"},
                       timeout=60)
    assert again.status_code == 404
    # still serving, and counting
    assert grpc_tokens(server, "key-ops", PROMPT, "sql") == peft_greedy(ckpt, adapters["sql"], PROMPT)
    m = server.wait_idle()
    assert m['genserve_lora_loads_total'] == 3 and m['genserve_lora_unloads_total'] == 1
    assert m['genserve_lora_adapters'] == 2
    assert m['genserve_lora_requests_total{adapter=late}'] == 1
    assert m['genserve_lora_tokens_total{adapter=late,kind=generated}'] == 96
    assert m['genserve_lora_resident'] <= 2
