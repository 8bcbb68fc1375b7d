"""Live-server throughput: concurrent REST + SSE streams through `genserve serve`, in one run.

Run from the repository root::

    python -m benchmarks.server [--streams 32] [--tokens 128] [--prompt 16] [--rounds 3] [--json PATH]
                                [--url http://127.0.0.1:8000] [--serve-args '--replicas 2']
                                [--compare-no-envoy]

`--compare-no-envoy` measures what Envoy costs: besides the server it starts (Envoy in front, as
`make serve` runs it) it starts a second bridge wired straight to the same engine, as
`genserve serve --no-envoy` wires it, and alternates the rounds between the two paths
(client -> Envoy -> bridge -> Envoy -> engine, and client -> bridge -> engine), so both see the
same engine and the same moment of the machine.

Starts `genserve serve` on free localhost ports (engine, gRPC service and HTTP bridge, as
`make serve` does, on the embedded model), or with `--url` uses a genserve already running on
this machine, sends one warm-up round, then `rounds` rounds of
`streams` simultaneous `POST /v1/completions` with `stream: true`, `max_tokens = tokens`,
`ignore_eos: true`, sampled at the API defaults (temperature 1, no top-k / top-p) with a seed per
stream, each with a distinct `prompt`-token synthetic prompt (one API key).
Per round, output tokens/s = tokens received by all streams / wall time from sending the first
request to the last stream's end; the best and median rounds are printed with per-stream TTFT and
TPOT. The ratio to llama.cpp's server is `python -m benchmarks.peer`'s: both servers on the same
GGUF, measured in alternating rounds of one run on this machine (the host's GEMM rate and bandwidth
move by up to 2× between days, so a figure from another run is no baseline).

Everything (client, bridge, service, engine) shares this machine's cores, as it would in a
one-box deployment; the client's share is part of the figure, and each round prints the client's
CPU per token (this process's CPU time / tokens received). The client is `loadgen`'s aiohttp
REST client (≈ 35–40 µs a token; the httpx client it replaced took ≈ 90, and the streams ran
≈ 5 % slower for it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

from genserve.common.ports import free_port
from loadgen.clients import RestClient, run_open_loop
from loadgen.live_server import LiveServer
from loadgen.workload import WorkItem


def one_round(url: str, streams: int, tokens: int, prompt: int, round_no: int) -> dict:
    """`streams` simultaneous streams of `tokens` tokens after `prompt`-token prompts.

    Returns {"tokens", "wall_s", "tok_s", "client_cpu_us_per_token" (this process's CPU time —
    the client, and the thread that reads a started server's log — per token received),
    "ttft_ms_p50", "tpot_ms_p50"}. Raises RuntimeError if any stream failed or was rejected.
    """
    items = [WorkItem(index=round_no * 1000 + i, arrival_s=0.0, api_key="", prompt_tokens=prompt,
                      output_tokens=tokens) for i in range(streams)]

    async def go():
        client = RestClient(url, timeout_s=600.0)
        try:
            t0 = time.perf_counter()
            records = await run_open_loop(items, client, request_prefix=f"bench{round_no}-")
            return records, time.perf_counter() - t0 - 0.05      # run_open_loop starts 50 ms late
        finally:
            await client.aclose()

    cpu0 = time.process_time()
    records, wall = asyncio.run(go())
    client_cpu_s = time.process_time() - cpu0
    errors = [r.error for r in records if r.error or r.status != 200]
    if errors:
        raise RuntimeError(f"{len(errors)} of {streams} streams failed, e.g. {errors[0]}")
    got = sum(r.output_tokens for r in records)
    return {"tokens": got, "wall_s": wall, "tok_s": got / wall,
            "client_cpu_us_per_token": 1e6 * client_cpu_s / max(got, 1),
            "ttft_ms_p50": 1000 * statistics.median(r.ttft_s for r in records),
            "tpot_ms_p50": 1000 * statistics.median(r.tpot_s for r in records if r.tpot_s is not None)}


@contextlib.contextmanager
def direct_bridge(grpc_target: str, timeout_s: float = 60.0):
    """A bridge (`python -m bridge`) on a free localhost port calling `grpc_target` directly;
    yields its URL once GET /health answers 200, stops it afterwards.

    Raises:
        RuntimeError: it did not answer within `timeout_s`.
    """
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bridge", "--grpc-target", grpc_target, "--host",
                             "127.0.0.1", "--port", str(port), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the direct bridge to {grpc_target} did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def summary(rounds: list[dict]) -> dict:
    """Best and median tokens/s of `rounds`."""
    return {"best_tok_s": max(r["tok_s"] for r in rounds),
            "median_tok_s": statistics.median(r["tok_s"] for r in rounds)}


def compare(opts: argparse.Namespace, server, load_start: float) -> int:
    """Alternate rounds through Envoy and straight to the engine (see the module docstring)."""
    with direct_bridge(f"127.0.0.1:{server.grpc_port}") as direct_url:
        paths = {"envoy": server.url, "direct": direct_url}
        for name, url in paths.items():
            print(f"[server] warm-up round via {name}", file=sys.stderr, flush=True)
            one_round(url, opts.streams, 8, opts.prompt, 0)
        rounds: dict[str, list[dict]] = {name: [] for name in paths}
        for i in range(1, opts.rounds + 1):
            order = list(paths) if i % 2 else list(reversed(paths))
            for name in order:
                r = one_round(paths[name], opts.streams, opts.tokens, opts.prompt, i)
                rounds[name].append(r)
                print(f"[server] round {i} via {name}: {r['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    out = {"streams": opts.streams, "tokens": opts.tokens, "prompt": opts.prompt,
           "serve_args": opts.serve_args, "rounds": rounds,
           **{name: summary(rs) for name, rs in rounds.items()},
           "loadavg_1min": [load_start, os.getloadavg()[0]]}
    out["envoy_over_direct_median"] = out["envoy"]["median_tok_s"] / out["direct"]["median_tok_s"]
    print(f"genserve through Envoy vs straight to the engine — {opts.streams} concurrent REST+SSE "
          f"streams × {opts.tokens} tokens ({opts.prompt}-token prompts), {opts.rounds} alternating rounds "
          f"each, load average {load_start:.1f} → {os.getloadavg()[0]:.1f}")
    for name in paths:
        for i, r in enumerate(rounds[name], 1):
            print(f"  {name:6s} round {i}: {r['tokens']} tokens in {r['wall_s']:.2f} s = {r['tok_s']:7.1f} tok/s; "
                  f"TTFT p50 {r['ttft_ms_p50']:.0f} ms, TPOT p50 {r['tpot_ms_p50']:.1f} ms; "
                  f"client CPU {r['client_cpu_us_per_token']:.0f} µs/token")
        print(f"  {name:6s} best {out[name]['best_tok_s']:.1f} tok/s, median {out[name]['median_tok_s']:.1f} tok/s")
    print(f"  Envoy / direct (medians): {out['envoy_over_direct_median']:.3f}")
    if opts.json:
        opts.json.write_text(json.dumps(out, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.server", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per stream")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="engine threads of the server it starts (genserve serve --threads)")
    p.add_argument("--json", type=pathlib.Path, help="also write the figures as JSON here")
    p.add_argument("--url", help="a genserve bridge already running on this machine (default: start one)")
    p.add_argument("--serve-args", default="",
                   help="more flags for the genserve serve it starts, one string (e.g. '--no-envoy' or "
                        "'--replicas 2 --lb-policy ROUND_ROBIN')")
    p.add_argument("--compare-no-envoy", action="store_true",
                   help="alternate rounds through Envoy and through a bridge wired straight to the engine")
    opts = p.parse_args(argv)
    if opts.compare_no_envoy and opts.url:
        p.error("--compare-no-envoy starts its own server; drop --url")
    load_start = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        extra_args = ["--threads", str(opts.threads), *shlex.split(opts.serve_args)]
        if opts.compare_no_envoy:
            return compare(opts, stack.enter_context(LiveServer(queue_budget_s=1e6, extra_args=extra_args)),
                           load_start)
        url = opts.url or stack.enter_context(LiveServer(queue_budget_s=1e6, extra_args=extra_args)).url
        print(f"[server] warm-up round ({opts.streams} streams)", file=sys.stderr, flush=True)
        one_round(url, opts.streams, 8, opts.prompt, 0)
        rounds = []
        for i in range(1, opts.rounds + 1):
            rounds.append(one_round(url, opts.streams, opts.tokens, opts.prompt, i))
            print(f"[server] round {i}: {rounds[-1]['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    best = max(rounds, key=lambda r: r["tok_s"])
    median = statistics.median(r["tok_s"] for r in rounds)
    out = {"streams": opts.streams, "tokens": opts.tokens, "prompt": opts.prompt, "rounds": rounds,
           "best_tok_s": best["tok_s"], "median_tok_s": median,
           "loadavg_1min": [load_start, os.getloadavg()[0]]}
    print(f"genserve live server — {opts.streams} concurrent REST+SSE streams × {opts.tokens} tokens "
          f"({opts.prompt}-token prompts), {opts.rounds} rounds, load average {load_start:.1f} → "
          f"{os.getloadavg()[0]:.1f}")
    for i, r in enumerate(rounds, 1):
        print(f"  round {i}: {r['tokens']} tokens in {r['wall_s']:.2f} s = {r['tok_s']:7.1f} tok/s; "
              f"TTFT p50 {r['ttft_ms_p50']:.0f} ms, TPOT p50 {r['tpot_ms_p50']:.1f} ms; "
              f"client CPU {r['client_cpu_us_per_token']:.0f} µs/token")
    print(f"  best {best['tok_s']:.1f} tok/s; median {median:.1f} tok/s "
          "(the ratio to llama.cpp's server: python -m benchmarks.peer)")
    if opts.json:
        opts.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
