"""Goodput at the SLO against a peer server, open loop: the design's load test, both servers in one run.

Run from the repository root (the peer installed once, see `benchmarks.peer`)::

    python -m benchmarks.goodput [--peer vllm] [--mix design|long|short|both] [--rates 1,2,3,4] [--requests 48]
                                 [--ttft-slo-ms 1000] [--tpot-slo-ms 100] [--serve-args ARGS ...] [--vllm-bind all]
                                 [--vllm-dtype bfloat16|float32]
                                 [--out benchmarks/results/goodput/NAME]

The method is the design's load test (docs/design.md): requests arrive as a Poisson process at a fixed
rate (open loop: a slow server does not slow the arrivals), not from a fixed number of users.

* Mixes (`MIXES`): "design" is the design's shape scaled to this CPU: prompts of 300–600 tokens
  (uniform, mean 450), 128-token answers, 1–4 req/s; "long" has prompts of 1,000–2,000 tokens at
  lower rates; "short" (100–200 tokens) is the design mix for a host too slow for the first, where
  one 450-token prefill alone takes most of the TTFT target. Answers are exactly that long (`ignore_eos`, greedy).
* Prompts are drawn per (mix, rate, request) (`benchmarks.peer.prompt_texts` with its own tag), so no
  rate reuses another's prefix cache, and each server gets the same texts at the same offsets.
* Per rate, every server runs the same arrivals back to back, and which goes first rotates from
  rate to rate, so a drift of the machine's speed weighs on all alike. Each server gets a warm-up
  first (`WARMUP_STREAMS` short streams), not counted. `--serve-args` given more than once runs
  several genserve configurations in the same run (all servers stay up; the ones not measured idle).
* A request's TTFT runs from its intended arrival to the first chunk that carries generated text;
  TPOT is (last text chunk − first) / (completion tokens − 1), the tokens from the stream's usage.
  A request meets the SLO when it completed all its tokens with TTFT ≤ `--ttft-slo-ms` and
  TPOT ≤ `--tpot-slo-ms`; a 429 or an error misses it.
* Goodput of a run = requests that met the SLO / its duration (first arrival to the last request's
  end), as vLLM's `benchmark_serving --goodput` counts it. A server's figure is its best goodput over
  the rates; the ratio compares the two best. That best is the grid's: a server that kept 95 % of
  requests within the SLO at no rate of the grid is past its knee everywhere on it, and may do
  better below it, so the page names it and calls the ratio a bound (`compare`'s `below_grid`).
* Capacity, the design's own capacity number: the highest rate at which ≥ 95 % of requests meet
  the SLO (`CAPACITY_ATTAINMENT`), every lower rate of the run meeting it too, so one lucky rate
  above a failing one does not count. It is a rate offered, read off the grid of `--rates`, so it
  is as fine as that grid. Met / duration runs below it at any rate: the duration also holds the
  last request's own answer (128 tokens at the server's TPOT), which weighs more the fewer
  requests a rate has and the slower the server's TPOT.

genserve runs as `make serve` starts it (`genserve serve`, Envoy in front, default flags, plus
`--serve-args`); the peer as `benchmarks.peer` starts it. Writes results.json, summary.md and
goodput.png (goodput, TTFT p95 and TPOT p95 against rate) under `--out`. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks import peer as peer_mod
from benchmarks.peer import GENSERVE, PEERS, SseReader, asks_usage, prompt_texts, request_body
from benchmarks.vllm_peer import VLLM

WARMUP_STREAMS, WARMUP_TOKENS, WARMUP_PROMPT = 4, 16, 64     # small: within any queue budget
CAPACITY_ATTAINMENT = 0.95    # the design's capacity: the highest rate at which 95 % meet both targets
REQUEST_TIMEOUT_S = 600.0
DRAIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Mix:
    """A request mix: prompt lengths uniform in [prompt_min, prompt_max] tokens (genserve's
    tokenizer), `output_tokens` per answer, the rates to run (req/s) and requests per rate."""

    name: str
    prompt_min: int
    prompt_max: int
    output_tokens: int
    rates: tuple[float, ...]
    requests: int


MIXES = {
    "design": Mix("design", 300, 600, 128, (1.0, 2.0, 3.0, 4.0), 48),
    "long": Mix("long", 1000, 2000, 128, (0.5, 0.75, 1.0, 1.5), 24),
    # For a slow host: a lone 450-token prefill near the 1 s TTFT target leaves no room to queue.
    "short": Mix("short", 100, 200, 128, (0.25, 0.5, 0.75, 1.0), 24),
}


@dataclass(frozen=True)
class Arrival:
    """One request of a run: when it arrives (s from the run's start) and its prompt."""

    offset_s: float
    prompt: str
    prompt_tokens: int          # asked length (genserve's tokenizer)


def arrivals(mix: Mix, rate: float, requests: int, tokenizer, seed: int = 0) -> list[Arrival]:
    """`requests` Poisson arrivals at `rate` req/s (exponential gaps, the first at 0) with prompts
    drawn for this (mix, rate): the same for the same arguments, different for another rate.

    Raises:
        ValueError: `rate` ≤ 0 or `requests` < 1.
    """
    if rate <= 0 or requests < 1:
        raise ValueError(f"arrivals need rate > 0 and requests >= 1, got {rate} and {requests}")
    rng = random.Random(f"{seed}/{mix.name}/{rate:g}")
    t, out = 0.0, []
    for i in range(requests):
        n = rng.randint(mix.prompt_min, mix.prompt_max)
        text = prompt_texts(tokenizer, 1, n, f"goodput/{seed}/{mix.name}/{rate:g}/{i}")[0]
        out.append(Arrival(t, text, n))
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it; times in seconds from its intended arrival."""

    status: int                 # HTTP status (0: no answer)
    error: str
    completion_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    end_s: float                # from the run's start to the request's end

    def meets(self, ttft_s: float, tpot_s: float, tokens: int) -> bool:
        """Completed all `tokens` with TTFT ≤ `ttft_s` and TPOT ≤ `tpot_s` (a one-token answer has
        no TPOT and meets it)."""
        return (self.status == 200 and not self.error and self.completion_tokens == tokens
                and self.ttft_s is not None and self.ttft_s <= ttft_s
                and (self.tpot_s is None or self.tpot_s <= tpot_s))


async def _one(session, url: str, arr: Arrival, tokens: int, include_usage: bool, start: float) -> Outcome:
    import aiohttp

    sent = start + arr.offset_s
    delay = sent - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    reader = SseReader(sent)
    status, error = 0, ""
    try:
        async with session.post(f"{url}/v1/completions", json=request_body(arr.prompt, tokens, include_usage)) as resp:
            status = resp.status
            if status != 200:
                return Outcome(status, (await resp.text())[:200], 0, None, None, time.perf_counter() - start)
            async for line in resp.content:
                reader.feed(line, time.perf_counter())
                if reader.done:
                    break
        r = reader.result(time.perf_counter(), tokens)
        return Outcome(status, "", r.completion_tokens, r.ttft_s, r.tpot_s, time.perf_counter() - start)
    except (RuntimeError, OSError, ValueError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    got = int((reader.usage or {}).get("completion_tokens", 0))
    return Outcome(status, error, got, None if reader.first is None else reader.first - sent, None,
                   time.perf_counter() - start)


def run_rate(url: str, items: Sequence[Arrival], tokens: int, include_usage: bool) -> list[Outcome]:
    """Send `items` open loop to `url` (POST /v1/completions, streamed) and collect one `Outcome` each."""
    import aiohttp

    async def go() -> list[Outcome]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
            start = time.perf_counter() + 0.05
            tasks = [asyncio.create_task(_one(session, url, a, tokens, include_usage, start)) for a in items]
            done, pending = await asyncio.wait(tasks, timeout=items[-1].offset_s + DRAIN_TIMEOUT_S)
            for task in pending:
                task.cancel()
            now = time.perf_counter() - start
            return [t.result() if t in done else Outcome(0, "drain timeout", 0, None, None, now) for t in tasks]

    return asyncio.run(go())


def summarize_rate(outcomes: Sequence[Outcome], items: Sequence[Arrival], tokens: int, ttft_slo_ms: float,
                   tpot_slo_ms: float) -> dict:
    """One server at one rate: goodput (met / duration, req/s), SLO attainment, 429s, errors, and
    TTFT / TPOT p50 and p95 (ms, numpy linear percentiles over completed requests).

    Raises:
        ValueError: no outcomes, or not one per item.
    """
    if not outcomes or len(outcomes) != len(items):
        raise ValueError(f"need one outcome per item, got {len(outcomes)} for {len(items)}")
    met = sum(o.meets(ttft_slo_ms / 1000.0, tpot_slo_ms / 1000.0, tokens) for o in outcomes)
    duration = max(o.end_s for o in outcomes) - items[0].offset_s
    done = [o for o in outcomes if o.status == 200 and not o.error]
    ttft = [o.ttft_s * 1000.0 for o in done if o.ttft_s is not None]
    tpot = [o.tpot_s * 1000.0 for o in done if o.tpot_s is not None]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None      # noqa: E731
    return {"requests": len(outcomes), "met": met, "attainment": met / len(outcomes),
            "duration_s": duration, "goodput": met / duration if duration > 0 else 0.0,
            "rejected_429": sum(o.status == 429 for o in outcomes),
            "errors": sum(o.status != 429 and (o.status != 200 or bool(o.error)) for o in outcomes),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p95": pct(ttft, 95),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p95": pct(tpot, 95),
            "first_error": next((o.error for o in outcomes if o.error), "")}


def capacity(rows: dict[float, dict]) -> float:
    """The design's capacity number for one server: the highest rate (req/s) of `rows` (rate →
    `summarize_rate` row) at which ≥ `CAPACITY_ATTAINMENT` of requests met the SLO, every lower rate
    meeting it too; 0.0 where the lowest rate already missed it."""
    found = 0.0
    for rate in sorted(rows, key=float):
        if rows[rate]["attainment"] < CAPACITY_ATTAINMENT:
            break
        found = float(rate)
    return found


def compare(table: dict[str, dict[float, dict]], peer: str, ours: str = GENSERVE) -> dict:
    """Best goodput of `ours` and of `peer` over the rates and their ratio; each one's capacity
    (`capacity`) and that ratio; and the rates where both kept ≥ 95 % of requests within the SLO
    with `ours`' TTFT p95 against the peer's there.

    `below_grid` lists the servers that kept ≥ 95 % of requests within the SLO at no rate of the
    grid: such a server is past its knee (or cannot serve the mix) everywhere on it, so its best
    goodput may lie at a rate below the grid, and a ratio taken from the grid's best is a bound,
    not the figure: an upper bound when only the peer is listed, a lower one when only `ours` is
    (each taking the other's best on the grid as its best)."""
    best = {s: max((row["goodput"] for row in table[s].values()), default=0.0) for s in (ours, peer)}
    cap = {s: capacity(table[s]) for s in (ours, peer)}
    both = [r for r in sorted(table[ours]) if r in table[peer]
            and table[ours][r]["attainment"] >= CAPACITY_ATTAINMENT
            and table[peer][r]["attainment"] >= CAPACITY_ATTAINMENT]
    return {"best": best, "ratio": best[ours] / best[peer] if best[peer] else None,
            "capacity": cap, "capacity_ratio": cap[ours] / cap[peer] if cap[peer] else None,
            "below_grid": [s for s in (ours, peer)
                           if all(row["attainment"] < CAPACITY_ATTAINMENT for row in table[s].values())],
            "ttft_p95_where_both_serve": {r: (table[ours][r]["ttft_ms_p95"], table[peer][r]["ttft_ms_p95"])
                                          for r in both}}


def variant_labels(serve_args: Sequence[str]) -> list[str]:
    """The name of each genserve configuration in the tables: "genserve" alone; with several,
    "genserve" for the one with no extra flags and "genserve <flags>" for the others."""
    if len(serve_args) == 1:
        return [GENSERVE]
    return [f"{GENSERVE} {a}".strip() for a in serve_args]


# -- page and plot -------------------------------------------------------------------------------
def _f(x: float | None, nd: int = 0) -> str:
    return "–" if x is None else f"{x:,.{nd}f}"


def markdown(report: dict) -> str:
    """The summary page: the command, the setup, per mix a table per rate and server, the best
    goodput and the ratio."""
    meta = report["meta"]
    peer = meta["peer"]
    ours = meta.get("variants", [GENSERVE])
    lines = [f"# Goodput at the SLO: genserve and {peer}, open loop", "", "Regenerate (one run, both servers "
             "on this machine):", "", "```", meta["command"], "```", "",
             f"- Date: {meta['date']} (UTC); {meta['cpus']} CPU cores; load average (1 min) "
             f"{meta['loadavg_1min'][0]:.2f} at the start, {meta['loadavg_1min'][1]:.2f} at the end.",
             *(f"- {label}: `{' '.join(args)}` (commit {meta['genserve_commit']})."
               for label, args in zip(ours, meta["genserve_args"])),
             f"- {peer}: `{' '.join(meta.get('peer_args', []))}` ({meta.get('peer_version', '')})"
             + (f", env {meta['peer_env']}" if meta.get("peer_env") else "") + ".",
             f"- SLO: TTFT ≤ {meta['ttft_slo_ms']:g} ms and TPOT ≤ {meta['tpot_slo_ms']:g} ms; goodput = requests "
             "that met both / (first arrival → last end).", ""]
    for name, mix in report["mixes"].items():
        m = mix["mix"]
        lines += [f"## Mix `{name}`: prompts {m['prompt_min']}–{m['prompt_max']} tokens, {m['output_tokens']}-token "
                  f"answers, {m['requests']} requests a rate", "",
                  "| rate (req/s) | server | goodput (req/s) | met | 429 | errors | TTFT p50 / p95 (ms) | "
                  "TPOT p50 / p95 (ms) |", "|---:|---|---:|---:|---:|---:|---|---|"]
        for rate in m["rates"]:
            for server in (*ours, peer):
                row = mix["table"][server].get(str(rate)) or mix["table"][server].get(rate)
                if row is None:
                    continue
                lines.append(f"| {rate:g} | {server} | {row['goodput']:.2f} | {row['met']}/{row['requests']} | "
                             f"{row['rejected_429']} | {row['errors']} | {_f(row['ttft_ms_p50'])} / "
                             f"{_f(row['ttft_ms_p95'])} | {_f(row['tpot_ms_p50'], 1)} / {_f(row['tpot_ms_p95'], 1)} |")
        lines.append("")
        lowest = min(float(r) for r in m["rates"])
        for label in ours:
            cmp_ = mix["compare"][label]
            both = "; ".join(f"{float(r):g} req/s {_f(g)} vs {_f(v)}" for r, (g, v)
                             in cmp_["ttft_p95_where_both_serve"].items())
            lines += [f"- Best goodput: {label} {cmp_['best'][label]:.2f} req/s, {peer} {cmp_['best'][peer]:.2f} "
                      f"req/s: **{_f(cmp_['ratio'], 2)}×**. TTFT p95 (ms) where both keep ≥ 95 % within the "
                      f"SLO: {both or 'no such rate'}."]
            below = cmp_.get("below_grid", [])      # pages saved before this check lack it
            if below:
                bound = {(peer,): " and the ratio above is an upper bound",
                         (label,): " and the ratio above is a lower bound"}.get(tuple(below), "")
                lines += [f"- {' and '.join(below)} kept ≥ 95 % of requests within the SLO at no rate here, "
                          f"so {'its' if len(below) == 1 else 'their'} best goodput may lie below the lowest rate "
                          f"({lowest:g} req/s){bound}: run lower `--rates` too."]
            if "capacity" in cmp_:      # pages saved before the capacity figure existed lack it
                cap = cmp_["capacity"]
                lines += [f"- Capacity (the highest rate at which ≥ 95 % of requests meet the SLO, every "
                          f"lower rate too): {label} {_capacity_text(cap[label], lowest)}, {peer} "
                          f"{_capacity_text(cap[peer], lowest)}"
                          + (f": **{_f(cmp_['capacity_ratio'], 2)}×**." if cmp_["capacity_ratio"] else ".")]
        lines.append("")
    lines += ["![goodput, TTFT p95 and TPOT p95 against rate](goodput.png)", ""]
    return "\n".join(lines)


def _capacity_text(capacity_rps: float, lowest_rps: float) -> str:
    """A `capacity` figure for the page: "2.5 req/s", or "below 1.5 req/s (the lowest rate
    measured)" where `capacity` found none (0.0: the lowest rate already missed the SLO)."""
    if capacity_rps > 0:
        return f"{capacity_rps:g} req/s"
    return f"below {lowest_rps:g} req/s (the lowest rate measured)"


def plot(report: dict, path: pathlib.Path) -> None:
    """goodput, TTFT p95 and TPOT p95 against rate, one row of panels per mix (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peer = report["meta"]["peer"]
    mixes = list(report["mixes"].items())
    fig, axes = plt.subplots(len(mixes), 3, figsize=(13, 3.6 * len(mixes)), squeeze=False)
    for row, (name, mix) in zip(axes, mixes):
        rates = mix["mix"]["rates"]
        ours = report["meta"].get("variants", [GENSERVE])
        for server, style in [(label, "o-") for label in ours] + [(peer, "s--")]:
            rows = [mix["table"][server].get(str(r)) or mix["table"][server].get(r) for r in rates]
            for ax, key in zip(row, ("goodput", "ttft_ms_p95", "tpot_ms_p95")):
                ax.plot(rates, [np.nan if x is None or x[key] is None else x[key] for x in rows], style, label=server)
        slo = report["meta"]
        row[0].plot(rates, rates, ":", color="grey", label="offered")
        row[1].axhline(slo["ttft_slo_ms"], color="grey", ls=":", label="SLO")
        row[2].axhline(slo["tpot_slo_ms"], color="grey", ls=":", label="SLO")
        for ax, title in zip(row, ("goodput (req/s)", "TTFT p95 (ms)", "TPOT p95 (ms)")):
            ax.set_title(f"{name}: {title}")
            ax.set_xlabel("rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        row[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line --------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.split("\n")[0])
    p.add_argument("--peer", choices=PEERS, default=VLLM)
    p.add_argument("--mix", choices=(*MIXES, "both"), default="both", help="both: design and long")
    p.add_argument("--rates", default=None, help="comma-separated req/s for every mix (default: each mix's own)")
    p.add_argument("--requests", type=int, default=None, help="requests a rate (default: each mix's own)")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--threads", type=int, default=2, help="genserve --threads and llama.cpp -t")
    p.add_argument("--serve-args", action="append", default=None,
                   help="more flags for genserve serve, one string; given more than once, each is a "
                        "genserve configuration of its own in the same run ('' = the defaults)")
    p.add_argument("--vllm-bind", default="auto", help="as benchmarks.peer's --vllm-bind")
    p.add_argument("--vllm-eager", action="store_true")
    p.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="as benchmarks.peer's --vllm-dtype")
    p.add_argument("--llama-server", type=pathlib.Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=None, help="folder for results.json, summary.md, goodput.png")
    p.add_argument("--render", type=pathlib.Path, default=None, metavar="DIR",
                   help="run nothing: rewrite DIR's summary.md and goodput.png from its results.json (the "
                        "comparisons recomputed from its tables)")
    return p


def render(folder: pathlib.Path) -> None:
    """Rewrite `folder`'s summary.md and goodput.png from its results.json, each mix's comparisons
    recomputed from the saved tables (so a page saved before a figure existed gains it).

    Raises:
        FileNotFoundError: no results.json in `folder`.
    """
    report = json.loads((folder / "results.json").read_text())
    peer = report["meta"]["peer"]
    for mix in report["mixes"].values():
        mix["compare"] = {label: compare(mix["table"], peer, label)
                          for label in report["meta"].get("variants", [GENSERVE])}
    report = json.loads(json.dumps(report))
    (folder / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "summary.md").write_text(markdown(report))
    plot(report, folder / "goodput.png")


def mixes_of(p: argparse.ArgumentParser, opts: argparse.Namespace) -> list[Mix]:
    """The mixes to run with `--rates` / `--requests` applied; exits through `p` (status 2) naming
    the option and its limit."""
    chosen = [MIXES["design"], MIXES["long"]] if opts.mix == "both" else [MIXES[opts.mix]]
    if opts.rates is not None:
        try:
            rates = tuple(float(x) for x in opts.rates.split(",") if x.strip())
        except ValueError:
            p.error(f"--rates takes comma-separated numbers, got {opts.rates!r}")
        if not rates or min(rates) <= 0 or max(rates) > 100:
            p.error(f"--rates must be in (0, 100] req/s, got {opts.rates!r}")
        chosen = [dataclasses.replace(m, rates=rates) for m in chosen]
    if opts.requests is not None:
        if not 1 <= opts.requests <= 10000:
            p.error(f"--requests must be 1..10000, got {opts.requests}")
        chosen = [dataclasses.replace(m, requests=opts.requests) for m in chosen]
    if not (opts.ttft_slo_ms > 0 and opts.tpot_slo_ms > 0):
        p.error("--ttft-slo-ms and --tpot-slo-ms must be > 0")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = parser()
    opts = p.parse_args(argv)
    if opts.render is not None:
        if not (opts.render / "results.json").is_file():
            p.error(f"--render needs a folder with results.json, got {str(opts.render)!r}")
        render(opts.render)
        return 0
    mixes = mixes_of(p, opts)
    # benchmarks.peer's options and checks: prompt / tokens / rounds / streams only size llama.cpp's slots.
    peer_opts = argparse.Namespace(**vars(opts), rounds=1, tokens=max(m.output_tokens for m in mixes),
                                   prompt=max(m.prompt_max for m in mixes), streams=[64])
    found = peer_mod.check_options(p, peer_opts)

    from engine.gguf_file import default_gguf_path
    from engine.tokenizer import Tokenizer
    from genserve.common.model_name import DEFAULT_MODEL_NAME
    from loadgen.live_server import LiveServer

    gguf = default_gguf_path()
    tokenizer = Tokenizer.from_gguf(gguf)
    peer = opts.peer
    log = lambda msg: print(f"[goodput] {msg}", file=sys.stderr, flush=True)   # noqa: E731
    variants = opts.serve_args or [""]
    labels = variant_labels(variants)
    base_args = ["--threads", str(opts.threads), "--ready-timeout-s", f"{peer_mod.START_TIMEOUT_S:g}"]
    meta = {"command": "python -m benchmarks.goodput " + shlex.join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "cpus": os.cpu_count(), "peer": peer, "genserve_commit": peer_mod._commit(),
            "variants": labels, "genserve_args": [["genserve", "serve", *base_args, *shlex.split(a)] for a in variants],
            "ttft_slo_ms": opts.ttft_slo_ms, "tpot_slo_ms": opts.tpot_slo_ms}
    load_start = os.getloadavg()[0]
    report: dict = {"meta": meta, "mixes": {}}
    with contextlib.ExitStack() as stack:
        log(f"starting genserve serve and {peer}")
        urls = {label: stack.enter_context(LiveServer(queue_budget_s=None, extra_args=[*base_args, *shlex.split(a)],
                                                      start_timeout_s=peer_mod.START_TIMEOUT_S)).url
                for label, a in zip(labels, variants)}
        running = stack.enter_context(peer_mod.peer_server(peer_opts, found, gguf, DEFAULT_MODEL_NAME, meta))
        urls[peer] = running.url
        servers = [*labels, peer]
        # While a genserve is measured the peer is idle (vLLM stopped: it polls for work when idle).
        quiet = lambda server: running.idle() if server != peer else contextlib.nullcontext()  # noqa: E731
        for server in servers:
            log(f"warm-up: {server}")
            with quiet(server):
                peer_mod.run_round(server if server == peer else GENSERVE, urls[server],
                                   prompt_texts(tokenizer, WARMUP_STREAMS, WARMUP_PROMPT, f"goodput-warm-{server}"),
                                   WARMUP_TOKENS, 0)
        for mix in mixes:
            table: dict[str, dict[float, dict]] = {s: {} for s in servers}
            for i, rate in enumerate(mix.rates):
                items = arrivals(mix, rate, mix.requests, tokenizer, opts.seed)
                for server in servers[i % len(servers):] + servers[:i % len(servers)]:   # who goes first rotates
                    with quiet(server):
                        outcomes = run_rate(urls[server], items, mix.output_tokens, asks_usage(server))
                    row = summarize_rate(outcomes, items, mix.output_tokens, opts.ttft_slo_ms, opts.tpot_slo_ms)
                    table[server][rate] = row
                    log(f"{mix.name} {rate:g} req/s {server}: goodput {row['goodput']:.2f}, met {row['met']}/"
                        f"{row['requests']}, 429 {row['rejected_429']}, errors {row['errors']}, TTFT p95 "
                        f"{_f(row['ttft_ms_p95'])} ms, TPOT p95 {_f(row['tpot_ms_p95'], 1)} ms"
                        + (f" ({row['first_error']})" if row["first_error"] else ""))
                    time.sleep(2.0)               # let the last streams' tails settle
            report["mixes"][mix.name] = {"mix": dataclasses.asdict(mix), "table": table,
                                         "compare": {label: compare(table, peer, label) for label in labels}}
    meta["loadavg_1min"] = [load_start, os.getloadavg()[0]]
    report = json.loads(json.dumps(report))       # rate keys as strings, as the saved file has them
    page = markdown(report)
    print(page)
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        (opts.out / "summary.md").write_text(page)
        plot(report, opts.out / "goodput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
