"""One tiny `benchmarks.peer` round against the e2e suite's live genserve (Envoy in front, as
`make serve` runs it): the request body the peer benchmark sends to both servers is one genserve
takes, and the stream's usage, text events and prompt count read as the benchmark expects."""

from __future__ import annotations

from benchmarks import peer


def test_one_peer_round_against_genserve(server, gguf_tokenizer):
    prompts = peer.prompt_texts(gguf_tokenizer, 2, 32, "e2e")
    r = peer.run_round(peer.GENSERVE, server.base_url, prompts, 4, 1)
    assert (r.streams, r.tokens, r.text_events) == (2, 4, 8)        # one event per token, 4 tokens each
    assert r.prompt_tokens == len(gguf_tokenizer.encode(prompts[0]))
    assert 0 < r.ttft_ms_p50 <= r.ttft_ms_p95 and r.tok_s > 0
