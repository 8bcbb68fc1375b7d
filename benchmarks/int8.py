"""int8 arithmetic for the block matrices (`--weights int8`) against the exact paths, in one run:
speed of prefill and of decode steps, and what it costs in quality.

Run from the repository root::

    python -m benchmarks.int8 [--prefill 512] [--rows 1,32] [--steps 30] [--generate 4096]
                              [--ppl-tokens 4096] [--quality-only] [--quality-engines LIST]
                              [--json PATH]

Engines over the embedded SmolLM2-135M, from one load of the GGUF:

* ``bf16``: `EngineConfig.weights` "bf16" (the exact products);
* ``q4``: "q4", the default where it runs: the bf16 products' bits from the 4-bit blocks;
* ``int8``: "int8" (`engine.model.int8`);
* ``q4q8``: "q4q8" (`engine.model.gguf_blocks.attach_q4q8`: the Q4_1 blocks exact times inputs rounded
  to 8 bits per row and block of 32, the output projection's Q8_0 blocks times the same 8-bit
  inputs; its decode steps run the Python block loop);
* ``q4q8-exact-output``: the same with the output projection on its bf16 product, so the two
  say what the output's 8-bit product costs and gives;
* two yardsticks for quality, llama.cpp's CPU arithmetic run through the same engine (slow, so
  not timed): ``int8-q8_0``, its 8-bit product (Q8_0 × Q8_0: weights and activations in blocks
  of 32, one scale each), and ``q4_1-q8_1``, its product for this 4-bit file, what llama.cpp's
  server computes by default (Q4_1 × Q8_1: the weights exact, the activations in 8-bit blocks
  of 32).

Speed (the executor's seconds per step, `Engine.step_listeners`; the engines take turns, so load
from other processes falls on all alike):

* prefill: one request whose ``--prefill``-token prompt runs in one step, ``--steps`` times per
  engine (the prefix cache off, so every time computes);
* decode: pure-decode steps at each of ``--rows`` rows (`benchmarks.q4.decode_in_turn`).

Quality, against ``bf16`` (q4 has its bits, so it is not measured again), for ``int8`` and the
two yardsticks:

* greedy agreement: prompts cut from the text below; ``bf16`` generates greedily ``--generate``
  tokens in all; ``int8`` is then given each prompt followed by ``bf16``'s answer and asked for
  its prompt logprobs with the top candidate (teacher forcing), and at every answer position
  its top token is compared with ``bf16``'s. Also the free-running figure: the share of tokens
  before the first difference when ``int8`` generates alone.
* perplexity: exp(−mean log-probability) of ``--ppl-tokens`` tokens of a fixed English text
  that Python itself ships (the documentation topics of `pydoc_data.topics`, in key order), in
  windows of 1,024 tokens, each token scored given the window's tokens before it. The int8
  path chose its outlier channels on the end of the same joined text
  (`engine.runner.int8_calibration`), which these tokens do not reach.

Other processes on the machine distort the speed figures; the header prints the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import statistics
import sys
from dataclasses import dataclass

import torch

from benchmarks.q4 import decode_in_turn
from engine import kernels
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams
from engine.model.int8_weights import attach_int8
from engine.model.transformer import Transformer
from engine.model.gguf_blocks import attach_q4q8
from engine.model.quant import attach_q4
from engine.gguf_file import open_gguf
from engine.model.weights import load_gguf
from engine.runner.builder import engine_from_model, int8_calibration, model_from_weights, set_threads
from engine.runner.int8_calibration import topics_text
from engine.tokenizer import Tokenizer

WINDOW = 1024        # tokens per perplexity window
Q8_0_BLOCK = 32      # ggml's Q8_0: one scale per 32 weights (and per 32 activations)
PROMPT_TOKENS = 48   # tokens per greedy-agreement prompt
ANSWER_TOKENS = 128  # tokens each greedy-agreement prompt generates


def build_models(threads: int) -> tuple[dict[str, Transformer], Tokenizer]:
    """The engines' models (module docstring) from one load of the embedded GGUF, and its
    tokenizer; no ``q4`` where its kernel does not run (CPUs with AVX2 alone)."""
    set_threads(EngineConfig(num_threads=threads))
    reader = open_gguf()
    args, state = load_gguf(reader)
    names = ["bf16", "q4", "int8", "int8-q8_0", "q4_1-q8_1", "q4q8", "q4q8-exact-output"]
    if not kernels.q4_linear_available():
        names.remove("q4")
    models = {name: model_from_weights(args, state, torch.bfloat16) for name in names}
    if "q4" in models:
        attach_q4(models["q4"], reader)
    attach_q4q8(models["q4q8"], reader)
    attach_q4q8(models["q4q8-exact-output"], reader)
    exact = models["q4q8-exact-output"]
    exact.output_packed = dataclasses.replace(exact.output_packed, q8q8=None)
    tokenizer = Tokenizer.from_gguf(reader)
    attach_int8(models["int8"], int8_calibration(models["int8"], tokenizer))
    attach_int8(models["int8-q8_0"], block=Q8_0_BLOCK)
    attach_int8(models["q4_1-q8_1"], block=Q8_0_BLOCK, exact=True)
    return models, tokenizer


def make_engines(models: dict[str, Transformer], prefill: int) -> dict[str, Engine]:
    """One engine per model; no prefix cache (every prefill computes); a step budget that takes a
    `prefill`-token prompt and a 1,024-token window in one step."""
    budget = -(-max(prefill, WINDOW) // 64) * 64
    config = EngineConfig(prefix_caching=False, prefill_token_budget_few_rows=budget,
                          num_blocks=4096)
    return {name: engine_from_model(config, model) for name, model in models.items()}


def prefill_times(engines: dict[str, Engine], prompt_len: int, steps: int) -> dict[str, list[float]]:
    """Per engine, the executor's seconds of each step that prefilled a whole `prompt_len`-token
    prompt alone, the engines taking turns `steps` times."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    g = torch.Generator().manual_seed(prompt_len)
    for i in range(steps):
        for name, engine in engines.items():
            vocab = engine.executor.model.args.vocab_size
            ids = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()

            def on_step(plan, events, step_s: float, name=name) -> None:
                if plan.num_prefill_tokens == prompt_len and plan.num_decode_rows == 0:
                    times[name].append(step_s)
            engine.step_listeners.append(on_step)
            try:
                engine.submit(Request(f"pf-{name}-{i}", "bench", ids, 1,
                                      SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
                engine.run_until_idle()
            finally:
                engine.step_listeners.remove(on_step)
    return times


def run_requests(engine: Engine, prompts: list[list[int]], max_tokens: int,
                 prompt_logprobs: int | None, tag: str) -> list[Request]:
    """Submit greedy requests (`ignore_eos`) for `prompts`, run the engine until idle, return them."""
    reqs = [Request(f"{tag}-{i}", "bench", ids, max_tokens,
                    SamplingParams(temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs),
                    0.0, 0.0) for i, ids in enumerate(prompts)]
    for req in reqs:
        engine.submit(req)
    engine.run_until_idle()
    return reqs


def scored(req: Request) -> list[tuple[float, int]]:
    """(logprob of the prompt token, top candidate id) at prompt positions 1.. of a finished
    request that asked for prompt logprobs with one candidate."""
    out: list[tuple[float, int]] = []
    for logprob, tops in req.prompt_logprob_entries:
        out.append((logprob, tops[0][0]))
    return out


@dataclass(frozen=True)
class Quality:
    """What `quality` measured for one engine against `bf16`.

    Attributes:
        agreement: share of `bf16`'s greedy answer tokens that are also this engine's top token
            given the same preceding tokens (teacher forcing).
        prefix_share: share of answer tokens before the first difference when this engine
            generates alone.
        answer_tokens: answer tokens compared.
        perplexity: exp(−mean logprob) over the reference text's scored tokens.
        ppl_tokens: tokens scored.
    """

    agreement: float
    prefix_share: float
    answer_tokens: int
    perplexity: float
    ppl_tokens: int


def perplexity(engine: Engine, windows: list[list[int]], tag: str) -> tuple[float, int]:
    """exp(−mean logprob) of every token of `windows` after the first of each (prompt logprobs),
    and how many tokens that is."""
    reqs = run_requests(engine, windows, 1, 1, tag)
    logprobs = [lp for req in reqs for lp, _ in scored(req)]
    return math.exp(-statistics.fmean(logprobs)), len(logprobs)


def quality(reference: Engine, engines: dict[str, Engine], tokenizer: Tokenizer, generate: int,
            ppl_tokens: int) -> tuple[dict[str, Quality], float]:
    """Each of `engines`' quality figures against `reference` (module docstring), and the
    reference's own perplexity on the same windows."""
    ids = tokenizer.encode_text(topics_text())
    n_prompts = max(1, generate // ANSWER_TOKENS)
    stride = len(ids) // (n_prompts + 1)
    prompts = [ids[i * stride:i * stride + PROMPT_TOKENS] for i in range(n_prompts)]
    windows = [ids[i:i + WINDOW] for i in range(0, min(len(ids), ppl_tokens), WINDOW)]
    ref = run_requests(reference, prompts, ANSWER_TOKENS, None, "ref")
    out: dict[str, Quality] = {}
    for name, engine in engines.items():
        forced = run_requests(engine, [p + r.generated for p, r in zip(prompts, ref)], 1, 1,
                              f"forced-{name}")
        agree = total = 0
        for prompt, ref_req, req in zip(prompts, ref, forced):
            tops = [top for _, top in scored(req)]
            # the entry at index i is for prompt position i + 1 (it predicts that token)
            for j, token in enumerate(ref_req.generated):
                agree += tops[len(prompt) + j - 1] == token
                total += 1
        alone = run_requests(engine, prompts, ANSWER_TOKENS, None, f"alone-{name}")
        before = 0
        for ref_req, req in zip(ref, alone):
            same = 0
            while same < len(req.generated) and req.generated[same] == ref_req.generated[same]:
                same += 1
            before += same
        ppl, scored_tokens = perplexity(engine, windows, f"ppl-{name}")
        out[name] = Quality(agree / total, before / total, total, ppl, scored_tokens)
    return out, perplexity(reference, windows, "ppl-ref")[0]


def host_description() -> str:
    """This CPU's model name and which of the products' instruction sets it has (AMX, AVX512-VNNI,
    AVX512-BF16), from /proc/cpuinfo: the figures differ between such hosts."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    lines = info.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                "unknown CPU")
    flags = kernels.cpu_flags()
    sets = [label for flag, label in (("amx_int8", "AMX"), ("avx512_vnni", "AVX512-VNNI"),
                                      ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    return f"{name}; {', '.join(sets) or 'no AMX, AVX512-VNNI or AVX512-BF16'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill step")
    parser.add_argument("--rows", default="1,32", help="decode row counts, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="steps per engine and measurement")
    parser.add_argument("--generate", type=int, default=4096,
                        help="greedy answer tokens compared (in answers of 128)")
    parser.add_argument("--ppl-tokens", type=int, default=4096, help="tokens of perplexity text")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--quality-only", action="store_true", help="skip the speed figures")
    parser.add_argument("--quality-engines", default="int8,int8-q8_0,q4_1-q8_1,q4q8",
                        help="engines whose quality is measured against bf16, comma-separated")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    models, tokenizer = build_models(args.threads)
    engines = make_engines(models, args.prefill)
    print(f"# load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cpus", flush=True)
    result: dict = {"prefill_tokens": args.prefill, "host": host_description(), "speed": {},
                    "quality": {}}
    print(f"# host: {result['host']}", flush=True)
    if not args.quality_only:
        measure_speed({name: engines[name] for name in ("bf16", "q4", "int8", "q4q8")
                       if name in engines}, args, result)
    qualities, ref_ppl = quality(engines["bf16"], {name: engines[name] for name in
                                                   args.quality_engines.split(",")},
                                 tokenizer, args.generate, args.ppl_tokens)
    result["quality"] = {"bf16_perplexity": ref_ppl,
                         **{name: q.__dict__ for name, q in qualities.items()}}
    for name, q in qualities.items():
        print(f"quality {name} vs bf16: teacher-forced greedy agreement {q.agreement:.4f} over "
              f"{q.answer_tokens} tokens; free-running tokens before the first difference "
              f"{q.prefix_share:.3f}; perplexity {q.perplexity:.3f} vs bf16 {ref_ppl:.3f} "
              f"({100 * (q.perplexity / ref_ppl - 1):+.2f} %) over {q.ppl_tokens} tokens",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def measure_speed(speed_engines: dict[str, Engine], args: argparse.Namespace, result: dict) -> None:
    """The prefill and decode timings (module docstring) into `result["speed"]`, printed."""
    pre = prefill_times(speed_engines, args.prefill, args.steps)
    result["speed"]["prefill"] = {name: statistics.median(t) for name, t in pre.items()}
    print(f"prefill {args.prefill} tokens, median s: " + ", ".join(
        f"{name} {statistics.median(t):.3f} ({args.prefill / statistics.median(t):.0f} tok/s, "
        f"{statistics.median(pre['bf16']) / statistics.median(t):.2f}x bf16)"
        for name, t in pre.items()), flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        times = decode_in_turn(speed_engines, rows, args.steps, 64).times
        med = {name: statistics.median(t) for name, t in times.items()}
        result["speed"][f"decode_{rows}"] = med
        print(f"decode {rows} rows, median ms: " + ", ".join(
            f"{name} {1e3 * s:.2f} ({med['bf16'] / s:.2f}x bf16, {med['q4'] / s:.2f}x q4)"
            for name, s in med.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
