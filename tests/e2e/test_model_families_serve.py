"""`genserve serve --model DIR` end to end, once per registered family, on the tiny random
checkpoints transformers writes (tests/engine/hf_families.py): the whole stack (Envoy, bridge,
engine) loads the directory, and a greedy completion of a prompt given as token ids (gRPC,
through Envoy) equals transformers' own greedy continuation, with the logprobs transformers
gives those tokens; a text prompt over REST answers too."""

from __future__ import annotations

import grpc
import httpx
import pytest
import torch

from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import start_server
from tests.engine.hf_families import FAMILIES, build_checkpoint, reference_logits

pytestmark = pytest.mark.slow

NEW_TOKENS = 8


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """(family, checkpoint directory, the server serving it)."""
    directory = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / request.param)
    gen = start_server("--model", str(directory), "--dtype", "float32", kv_pool_gib=0.05)
    server = next(gen)
    try:
        yield request.param, directory, server
    finally:
        next(gen, None)


def test_greedy_tokens_equal_transformers_through_the_whole_stack(served):
    family, directory, server = served
    prompt = torch.randint(3, 320, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        messages = list(stub.Generate(pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=NEW_TOKENS,
            sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True), logprobs=0), timeout=120))
    tokens = [m.token for m in messages if m.HasField("token")]
    ids = [t.token_id for t in tokens]
    reference = list(prompt)
    for _ in range(NEW_TOKENS):
        reference.append(int(reference_logits(directory, reference)[-1].argmax()))
    assert ids == reference[len(prompt):], family
    scores = torch.log_softmax(reference_logits(directory, reference), dim=-1)
    want = [scores[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]
    assert max(abs(t.logprob - w) for t, w in zip(tokens, want)) < 1e-4
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={"prompt": "hello hello", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == directory.name and body["usage"]["completion_tokens"] == 4
