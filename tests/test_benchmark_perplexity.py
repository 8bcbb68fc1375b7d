"""benchmarks.perplexity without a server: llama-perplexity's chunking and scoring on fake
per-position logprobs against a hand computation, the reply check, the parsing of
llama-perplexity's output, and the refusal of options that cannot work."""

from __future__ import annotations

import math
import pathlib

import pytest

from benchmarks import perplexity as bp
from benchmarks.perplexity import Chunk

GGUF_STANDIN = pathlib.Path(__file__)        # any existing file passes the --model file check


def test_chunks_follow_llama_perplexity():
    """⌊tokens / n_ctx⌋ chunks of n_ctx, the tail unused; --chunks caps the count."""
    assert bp.plan_chunks(13, 6) == [Chunk(0, 0, 6), Chunk(1, 6, 12)]
    assert bp.plan_chunks(3439, 512) == [Chunk(i, 512 * i, 512 * (i + 1)) for i in range(6)]
    assert bp.plan_chunks(3439, 512, max_chunks=2) == [Chunk(0, 0, 512), Chunk(1, 512, 1024)]
    assert bp.plan_chunks(12, 6, max_chunks=10) == [Chunk(0, 0, 6), Chunk(1, 6, 12)]


def test_each_chunk_starts_with_bos_when_the_vocabulary_adds_one():
    tokens = [2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]     # BOS 2 as the tokenizer adds it
    assert bp.chunk_tokens(tokens, Chunk(0, 0, 6), bos_id=2) == [2, 10, 11, 12, 13, 14]
    assert bp.chunk_tokens(tokens, Chunk(1, 6, 12), bos_id=2) == [2, 16, 17, 18, 19, 20]   # 15 lost to BOS
    assert bp.chunk_tokens(tokens, Chunk(1, 6, 12), bos_id=None) == [15, 16, 17, 18, 19, 20]


def test_only_the_second_half_is_scored():
    """first = ⌊n_ctx/2⌋: positions first+1 .. n_ctx−1, n_ctx − first − 1 of them."""
    assert list(bp.scored_positions(6)) == [4, 5]
    assert list(bp.scored_positions(7)) == [4, 5, 6]
    assert len(bp.scored_positions(512)) == 255 and bp.scored_positions(512)[0] == 257


def test_perplexity_equals_a_hand_computation():
    """13 tokens, n_ctx 6: 2 chunks, positions 4 and 5 of each scored; PPL = exp(mean NLL)."""
    n_ctx = 6
    chunk0 = [None, -9.0, -8.0, -7.0, -1.0, -2.0]        # positions 1-3 are context only
    chunk1 = [None, -9.0, -8.0, -7.0, -0.5, -3.5]
    nlls = [bp.chunk_nlls(chunk0, n_ctx), bp.chunk_nlls(chunk1, n_ctx)]
    assert nlls == [[1.0, 2.0], [0.5, 3.5]]
    result = bp.perplexity(nlls)
    assert result.count == 4
    assert result.ppl == pytest.approx(math.exp((1.0 + 2.0 + 0.5 + 3.5) / 4))        # e^1.75
    assert result.running == pytest.approx([math.exp(1.5), math.exp(1.75)])
    # llama-perplexity's ±: PPL · sqrt((mean(v²) − mean²) / (count − 1))
    var = (1 + 4 + 0.25 + 12.25) / 4 - 1.75 ** 2
    assert result.plus_minus == pytest.approx(math.exp(1.75) * math.sqrt(var / 3))


def test_a_missing_or_infinite_scored_logprob_is_refused():
    with pytest.raises(ValueError, match="position 5"):
        bp.chunk_nlls([None, -1.0, -1.0, -1.0, -1.0, None], 6)
    with pytest.raises(ValueError, match="position 4"):
        bp.chunk_nlls([None, -1.0, -1.0, -1.0, float("-inf"), -1.0], 6)
    with pytest.raises(ValueError, match="expected 6"):
        bp.chunk_nlls([None, -1.0], 6)
    # a context position (1..3) may be anything: it is not scored
    assert bp.chunk_nlls([None, None, float("nan"), -1.0, -1.0, -2.0], 6) == [1.0, 2.0]


def test_reply_logprobs_follow_the_asked_ids():
    """The vLLM shape: null first, then {id: {logprob, ...}} naming the prompt token."""
    ids = [2, 7, 9]
    reply = {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -1.5, "rank": None, "decoded_token": "a"}},
                                              {"9": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}}]}],
             "usage": {"prompt_tokens": 3}}
    assert bp.logprobs_of_reply(reply, ids) == [None, -1.5, -0.25]
    with pytest.raises(ValueError, match="does not name token 8"):
        bp.logprobs_of_reply(reply, [2, 7, 8])
    with pytest.raises(ValueError, match="counted 4 prompt tokens"):
        bp.logprobs_of_reply({**reply, "usage": {"prompt_tokens": 4}}, ids)
    body = bp.completion_body("m", ids)
    assert body["prompt"] == ids and body["prompt_logprobs"] == 0 and body["max_tokens"] == 1


def test_llama_perplexity_output_is_parsed():
    out = ("perplexity: calculating perplexity over 6 chunks, n_ctx=512, batch_size=2048, n_seq=4\n"
           "perplexity: 2.10 seconds per pass - ETA 0.05 minutes\n"
           "[1]20.1234,[2]18.5000,[3]17.0001,[4]16.5,[5]16.25,[6]16.125,\n"
           "Final estimate: PPL = 16.1250 +/- 0.71234\n")
    got = bp.parse_llama_perplexity(out)
    assert got == {"ppl": 16.125, "plus_minus": 0.71234, "chunks": 6, "n_ctx": 512,
                   "running": [20.1234, 18.5, 17.0001, 16.5, 16.25, 16.125]}
    assert bp.parse_token_count("perplexity: the data file you provided tokenizes to only 3439 tokens\n") == 3439
    assert bp.parse_token_count("nothing here") is None
    with pytest.raises(ValueError, match="Final estimate"):
        bp.parse_llama_perplexity("main: error: unable to load model\n")
    assert bp.llama_perplexity_argv("lp", "m.gguf", "t.txt", 512, 2) == [
        "lp", "-m", "m.gguf", "-f", "t.txt", "-c", "512", "-t", "2"]
    assert bp.llama_perplexity_argv("lp", "m.gguf", "t.txt", 512, 2, chunks=3)[-2:] == ["--chunks", "3"]


@pytest.mark.parametrize("n_tokens, n_ctx, chunks, needle", [
    (1023, 512, None, "needs at least 1024 tokens"),
    (100, 3, None, "at least 4 tokens"),
    (100, 8, 0, "at least 1"),
])
def test_plan_refuses_what_cannot_be_measured(n_tokens, n_ctx, chunks, needle):
    with pytest.raises(ValueError, match=needle):
        bp.plan_chunks(n_tokens, n_ctx, chunks)


@pytest.mark.parametrize("argv, needle", [
    (["--model", "/nonexistent.gguf"], "--model /nonexistent.gguf is not a file"),
    (["--model", str(GGUF_STANDIN), "--text", "/nonexistent.txt"], "--text /nonexistent.txt is not a file"),
    (["--model", str(GGUF_STANDIN), "--ctx", "2"], "--ctx must be 4..8191"),
    (["--model", str(GGUF_STANDIN), "--ctx", "9000"], "--ctx must be 4..8191"),
    (["--model", str(GGUF_STANDIN), "--chunks", "0"], "--chunks must be at least 1, got 0"),
    (["--model", str(GGUF_STANDIN), "--threads", "0"], "--threads must be 1..1024"),
    (["--model", str(GGUF_STANDIN), "--url", "http://x", "--serve-args=--no-envoy"],
     "--serve-args configures the server this module starts"),
    (["--model", str(GGUF_STANDIN), "--llama-perplexity", "/nonexistent"], "is not an executable file"),
    (["--model", str(GGUF_STANDIN), "--token-ids", "/nonexistent"], "--token-ids /nonexistent is not a file"),
    (["--model", str(GGUF_STANDIN), "--token-ids", str(GGUF_STANDIN)], "is not a JSON list of token ids"),
])
def test_bad_options_exit_2_naming_the_option(argv, needle, capsys):
    p = bp.parser()
    with pytest.raises(SystemExit) as exc:
        bp.check_options(p, p.parse_args(argv))
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_the_default_text_is_the_committed_one():
    """The fixed text ships with the repository (Python 3.11's LICENSE.txt), byte for byte."""
    assert bp.sha256(bp.DEFAULT_TEXT) == "3b2f81fe21d181c499c59a256c8e1968455d6689d269aa85373bfb6af41da3bf"


def test_the_text_is_read_as_llama_cpp_reads_a_file(tmp_path):
    """llama.cpp's -f drops one trailing newline (common/arg.cpp); so does the module."""
    f = tmp_path / "t.txt"
    f.write_bytes("a\nb\n\n".encode())
    assert bp.read_text(f) == "a\nb\n"
    f.write_bytes(b"ab")
    assert bp.read_text(f) == "ab"


def test_token_ids_files_and_differences(tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text("some log line\n[2, 5, 6]\n")
    assert bp.read_token_ids(f) == [2, 5, 6]
    f.write_text("[2, -1]\n")
    with pytest.raises(ValueError, match="not a JSON list of token ids"):
        bp.read_token_ids(f)
    diff = bp.token_differences([2, 9, 9, 7, 8], [2, 10, 7, 8], decode=lambda ids: "".join(map(str, ids)))
    assert diff == [{"at": 1, "their_at": 1, "ours": [9, 9], "theirs": [10], "our_text": "99", "their_text": "10"}]
    assert bp.token_differences([1, 2], [1, 2]) == []
