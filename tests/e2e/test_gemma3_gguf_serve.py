"""`genserve serve --model <Gemma 3 270M GGUF>` end to end: the published Q4_K_M file
(tests/gguf_assets.py) is served by the whole stack (Envoy, bridge, engine) with the tokenizer and
model it describes; a greedy REST completion of a text prompt equals transformers' greedy
continuation on the same file, token for token, and /tokenize gives transformers' ids."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.e2e.conftest import start_server
from tests.gguf_assets import gemma3_270m_gguf, gemma3_270m_transformers

pytestmark = pytest.mark.slow

PROMPT = "The tallest mountain in the world is"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    gen = start_server("--model", str(gemma3_270m_gguf()), "--dtype", "float32", kv_pool_gib=0.1)
    yield next(gen)
    next(gen, None)


def test_a_served_gemma3_gguf_completes_text_as_transformers_does(server):
    model, tokenizer = gemma3_270m_transformers()
    ids = tokenizer(PROMPT)["input_ids"]
    tokenized = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == ids
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                       json={"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                             "return_tokens_as_token_ids": True, "logprobs": 1})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ours = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
    with torch.no_grad():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   min_new_tokens=NEW_TOKENS)[0, len(ids):].tolist()
    assert ours == reference
    assert body["choices"][0]["text"] == tokenizer.decode(reference)
    # served under the file's stem without its quantisation tag (gemma-3-270m-q4_k_m.gguf)
    assert body["model"] == "gemma-3-270m" and body["usage"]["prompt_tokens"] == len(ids)
