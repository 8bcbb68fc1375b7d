"""Engine benchmark: this machine's limits, the engine's prefill and decode rates, and
transformers' static-batch `generate` on the same model, all measured in one run.

Run from the repository root::

    python -m benchmarks.engine [--quick] [--json PATH] [--skip-transformers] [--profile]

Machines are noisy and shared, so absolute figures move between runs; the ratios printed next to
them are between figures of the same run and are the ones to compare.

What is measured:

* machine: best-of-N 2048³ `torch.matmul` rate in bf16 and fp32 (GFLOP/s); the bandwidth of a
  large tensor copy counting bytes read + written (GB/s); and the read bandwidth, best-of-N
  `torch.sum` over 256 MiB of fp32 (bytes read / s; a reduction reads and hardly writes). The
  1-row decode floor is weight bytes / read bandwidth; an older estimate took half the copy rate
  (the copy's read share) instead, printed beside it.
* prefill: 1,024-token prompts (max_tokens 1) at `prefill_token_budget` 256 and 1,024 (and
  `prefill_token_budget_few_rows` set equal, so the budget holds with no decode row); time per step from
  `Engine.step_listeners` (the executor's time), only steps that carry no decode row.
* decode: one engine (max_rows 48, prefill budget 1,024) runs 48 requests with 16-token (short) or
  1,480-token (long: contexts ≈ 1,490–1,560 while counted, the mean is printed) prompts,
  `SamplingParams(temperature=0, ignore_eos=True)`; after a fixed number of steps at 48
  rows the newest requests are cancelled down to 32, then 8, then 1 row. Only steps that are pure
  decode at the phase's row count are counted (`plan.num_decode_rows == rows and
  plan.num_prefill_tokens == 0`), the first `decode_skip` of each phase are dropped as warm-up;
  step time is the median listener time and tokens/s = rows / median step time.
* step breakdown at 32 rows: `Engine.step()` wall time vs time inside the model's forward, the
  logits projection and `sample`, over `breakdown_steps` 32-row steps run after the counted ones;
  and, from `split_steps` more 32-row steps run through the Python block loop (a pure-decode
  step's blocks otherwise run in one C++ call the profiler cannot see into), the forward's time
  in `linear`, `attend` and `rope_store_kv`. Measured with `torch.profiler` (CPU activity, no
  shapes), started and stopped around each of those steps only, so the profiler's cost per op
  is in their times but not in the decode figures: the executor's ranges "genserve.forward",
  "genserve.logits" and "genserve.sample" (`ModelRunner.execute`) give the breakdown; for the
  split the profiler also records Python calls (`with_stack=True`), and the calls of those
  functions inside the forward are summed. The share outside the forward counts the logits projection (the LM head) as part
  of the forward; the rest — scheduling, building inputs, sampling, pushing events — is outside.
* decode attention (`benchmarks.decode_attention`): `torch.ops.genserve.paged_decode` alone over
  one step's keys and values, 32 rows × 1,500 tokens × 30 layers on shuffled block tables (1.1 GB):
  step time, K/V bytes, GB/s and time / (bytes ÷ the read bandwidth above), with the pools in
  4 KB pages and advised for transparent huge pages (as the engine's KV cache); printed beside
  the 32-row short- and long-context decode steps.
* sampling controls: 32-row pure-decode steps where every row has the repetition, frequency and
  presence penalties and a 10-entry `logit_bias` on (`PENALIZED`), against the same steps with
  plain greedy rows, in alternating runs over the same 16- and 512-token prompts (median executor
  time of each; the ratio is the cost of `engine.runner.logits_processors`).
* structured outputs: 32-row pure-decode steps where 16 rows follow a nested JSON schema
  (`NESTED_SCHEMA`, an array of at least 16 nested objects, so no row's grammar can end within
  the counted steps) and 16 are free, against the same steps with 32 free rows, alternating runs
  over the same 16-token prompts as the penalty step (median executor time; the ratio is what
  masking costs on the step's critical path); the compile time of the schema the first time and
  the second time (the cache: a lookup), on a fresh `GrammarCompiler` whose vocabulary was built
  before; and from `ModelRunner.grammar.stats`, the grammar worker's time per constrained row per
  step (advancing the matcher and filling the mask, overlapped with the forward pass), and per
  step the time sampling waited for it and spent applying the masks.
* end to end: the engine and transformers' `generate` (bf16, greedy, 64 new tokens forced with
  min_new_tokens) on the same static batches: 1 × 16-token prompts, 32 × 16, 32 × 512; tokens/s =
  generated tokens / wall time including prefill.

A full run takes ≈ 2–4 minutes on 2 cores, most of it prefilling the 48 long prompts. Other
processes on the machine distort the figures far beyond their share of the CPU (torch's threads
wait for each other at every one of the ~10,000 small ops of a step), so the header prints the
load average and warns when something else ran.

Model FLOPs (useful work; the duplicated row `engine.model.linear.linear` adds for 1-row inputs is
not counted)::

    N_blocks = n_layers · (dim·(n_heads + 2·n_kv_heads)·head_dim + n_heads·head_dim·dim + 3·dim·ffn)
    N_out    = vocab · dim   (the output projection, tied to the embedding in SmolLM2)
    FLOPs of one token attending L keys = 2·N_blocks + 4·n_layers·n_heads·head_dim·L
                                          [+ 2·N_out when its logits are computed]

Every decode row computes logits; a prefill chunk computes them only for its last token when it
ends the prompt. Step FLOPs are summed exactly from each plan's segments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from benchmarks import decode_attention as attention_bench
from benchmarks._measure import copy_gbps, gemm_gflops, read_gbps
from engine import kernels
from engine.attention.paged_sdpa import attend, decode_attention
from engine.config import CAPS_ALONE, EngineConfig
from engine.core.engine import Engine
from engine.core.plan import StepPlan
from engine.core.request import Request, SamplingParams
from engine.model.layer_ops import KernelLayerOps, TorchLayerOps
from engine.model.linear import linear
from engine.model.config import ModelArgs
from engine.gguf_file import default_gguf_path, open_gguf
from engine.model.weights import load_gguf
from engine.runner.builder import engine_from_weights, set_threads
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import ConstraintSpec
from engine.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
# Every sampling control that reads the row's history or vocabulary entries, on at once: what the
# penalty step measures against GREEDY (rows of the same prompts, same step shape).
PENALIZED = SamplingParams(temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                           frequency_penalty=0.5, repetition_penalty=1.1,
                           logit_bias=tuple((100 + 97 * i, -5.0 + i) for i in range(10)))
# The structured step's schema: nested objects, a bounded string, a pattern, an integer range, a
# bounded array of enums and an anyOf, in an array of at least 16 of them so the grammar cannot
# end (allow end-of-sequence) within the step's counted tokens; the rows are GREEDY (ignore_eos).
_PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "contact": {"anyOf": [{"type": "string", "format": "email"}, {"type": "null"}]}},
    "required": ["name", "age", "address", "tags", "contact"], "additionalProperties": False}
NESTED_SCHEMA = {"type": "object", "properties": {
    "people": {"type": "array", "items": _PERSON, "minItems": 16, "maxItems": 64}},
    "required": ["people"], "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class Sizes:
    """Problem sizes of one run (`FULL`, or `QUICK` for the smoke test)."""

    gemm_n: int = 2048
    gemm_repeats: int = 5
    copy_mib: int = 256
    copy_repeats: int = 10
    prefill_prompt: int = 1024
    prefill_requests: int = 2
    prefill_chunks: tuple[int, ...] = (256, 1024)
    decode_phases: tuple[int, ...] = (48, 32, 8, 1)     # rows, in the order they are reached
    short_prompt: int = 16
    long_prompt: int = 1480       # contexts ≈ 1,490–1,560 in the counted steps (reported)
    decode_chunk: int = 1024      # prefill budget per step of the decode sweep
    decode_steps: int = 16        # counted steps per phase
    decode_skip: int = 2          # full-row steps dropped at the start of each phase
    profile_steps: int = 3
    breakdown_steps: int = 16     # profiled 32-row steps for the step breakdown
    split_steps: int = 8          # 32-row steps run through the Python block loop for the split
    e2e_new_tokens: int = 64
    attn_rows: int = 32           # decode attention microbenchmark: rows × context tokens
    attn_context: int = 1500
    attn_repeats: int = 5
    e2e_cases: tuple[tuple[str, int, int], ...] = (
        ("b1_short", 1, 16), ("b32_short", 32, 16), ("b32_long", 32, 512))
    controls_prompts: tuple[int, ...] = (16, 512)   # prompt lengths of the penalty step
    controls_steps: int = 24      # counted 32-row steps per run of the penalty step
    controls_rounds: int = 3      # plain / penalized runs, alternating
    structured_prompt: int = 16   # prompt length of the structured step
    structured_steps: int = 24    # counted 32-row steps per run of the structured step
    structured_rounds: int = 3    # free / half-constrained runs, alternating


FULL = Sizes()
QUICK = Sizes(gemm_n=256, gemm_repeats=2, copy_mib=16, copy_repeats=2, prefill_prompt=48,
              prefill_requests=2, short_prompt=16, long_prompt=64, decode_steps=2, decode_skip=1,
              profile_steps=1, breakdown_steps=2, split_steps=2, e2e_new_tokens=4,
              attn_rows=4, attn_context=64, attn_repeats=2,
              e2e_cases=(("b1_short", 1, 16), ("b32_short", 32, 16), ("b32_long", 32, 48)),
              controls_prompts=(16,), controls_steps=3, controls_rounds=1,
              structured_steps=3, structured_rounds=1)


# -- report --------------------------------------------------------------------------------------
@dataclass(slots=True)
class Report:
    """Figures by key (what --json writes) and the printed rows, grouped by section."""

    figures: dict[str, float] = field(default_factory=dict)
    meta: dict[str, object] = field(default_factory=dict)
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)

    def add(self, key: str, value: float, label: str, unit: str = "", note: str = "") -> float:
        self.figures[key] = float(value)
        self.rows.append((key.split(".", 1)[0], label, f"{_fmt(value)} {unit}".rstrip(), note))
        return float(value)

    def print(self, out=sys.stdout) -> None:
        width = max(len(r[1]) for r in self.rows) + 2
        vwidth = max(len(r[2]) for r in self.rows) + 2
        section = None
        for sec, label, value, note in self.rows:
            if sec != section:
                section = sec
                print(f"\n== {sec} ==", file=out)
            print(f"  {label:<{width}}{value:>{vwidth}}   {note}".rstrip(), file=out)
        out.flush()


def _fmt(v: float) -> str:
    if v == 0 or abs(v) >= 1e4:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:,.1f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- model FLOPs and bytes -----------------------------------------------------------------------
def block_params(args: ModelArgs) -> int:
    """Matrix parameters of the transformer blocks (QKV, O, gate, up, down), all layers."""
    hd = args.head_dim
    per_layer = (args.dim * (args.n_heads + 2 * args.n_kv_heads) * hd
                 + args.n_heads * hd * args.dim + 3 * args.dim * args.intermediate_size)
    return args.n_layers * per_layer


def plan_flops(plan: StepPlan, args: ModelArgs) -> float:
    """Model FLOPs of one step (module docstring): linear layers, attention over each token's
    keys (position + 1), and the output projection of every sampling segment."""
    linear = 2 * block_params(args)
    attn = 4 * args.n_layers * args.n_heads * args.head_dim
    out = 2 * args.vocab_size * args.dim
    total = 0.0
    for s in plan.segments:
        keys = (s.start + 1 + s.end) * s.length / 2          # sum of (p + 1), p in [start, end)
        total += linear * s.length + attn * keys + (out if s.samples else 0)
    return total


def matmul_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight matrix a decode step reads: the blocks' QKV, O, gate/up and down,
    and the output projection (the embedding table is only gathered, a few rows a step)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if p.dim() == 2 and not name.startswith("tok_embeddings"))


# -- step profile -------------------------------------------------------------------------------
# Breakdown part -> the `torch.profiler.record_function` range of `ModelRunner.execute` it sums
# (the rest of execute is reported as building inputs).
EXECUTE_RANGES = (("forward", "genserve.forward"), ("logits", "genserve.logits"),
                  ("sample", "genserve.sample"))
FORWARD_RANGE = "genserve.forward"
# Forward split part -> the engine functions whose calls inside the forward it sums: `linear`
# (every matrix product of the blocks), `attend` (decode rows and prefill pieces),
# `decode_attention` (the batched decode rows, part of `attend`) and `rope_store_kv` of either
# `layer_ops` implementation (RoPE and the K/V cache write).
FORWARD_SPLIT = (("linear", (linear,)), ("attention", (attend,)),
                 ("decode_attention", (decode_attention,)),
                 ("rope", (TorchLayerOps.rope_store_kv, KernelLayerOps.rope_store_kv)))


# torch.profiler's name for a Python call (`with_stack=True`): "<file>(<first line>): <function>",
# the file relative to the sys.path entry it was imported from.
PYTHON_EVENT = re.compile(r"(?P<file>.+)\((?P<line>\d+)\): (?P<name>\w+)")


def split_part(event_name: str) -> str | None:
    """The `FORWARD_SPLIT` part a profiler event is a call of (None when it is none): its
    function name and first line match one of the part's functions, and its file ends that
    function's file."""
    m = PYTHON_EVENT.fullmatch(event_name)
    if m is None:
        return None
    for part, fns in FORWARD_SPLIT:
        for fn in fns:
            code = fn.__code__
            if (code.co_name == m["name"] and code.co_firstlineno == int(m["line"])
                    and os.path.normpath(code.co_filename).endswith(os.path.normpath(m["file"]))):
                return part
    return None


def profiled_parts(prof: torch.profiler.profile, split: bool) -> dict[str, float]:
    """Seconds per part of the steps `prof` recorded: each `EXECUTE_RANGES` part; with `split`
    (a profile taken with `with_stack=True`) also each `FORWARD_SPLIT` part, the calls of its
    functions inside the forward range, a call inside another call of the same part counted once.
    A part none of whose ranges or functions ran is left out."""
    ranges = {name: part for part, name in EXECUTE_RANGES}
    parts: dict[str, float] = defaultdict(float)
    events = prof.events()
    calls = {ev.name: split_part(ev.name) for ev in events} if split else {}
    for ev in events:
        part = ranges.get(ev.name)
        if part is None:
            part = calls.get(ev.name)
            if part is None:
                continue
            outer = []                                      # the names of the enclosing events
            parent = ev.cpu_parent
            while parent is not None:
                outer.append(parent.name)
                parent = parent.cpu_parent
            if FORWARD_RANGE not in outer or any(calls.get(name) == part for name in outer):
                continue
        parts[part] += ev.cpu_time_total / 1e6             # FunctionEvent times are in µs
    return dict(parts)


# -- driving the engine --------------------------------------------------------------------------
@dataclass(slots=True)
class TimedStep:
    """One engine step this benchmark timed (`Bench.run`): its shape, model FLOPs and times
    (seconds), and the profiler's seconds per part when the step was profiled. Not the engine's
    own `engine.snapshot.StepRecord` (the step chart's record)."""

    rows: int             # plan.num_decode_rows
    prefill: int          # plan.num_prefill_tokens
    flops: float
    context: float        # mean keys attended by the decode rows
    step_s: float         # the listener's time: executor.execute
    wall_s: float         # Engine.step() wall time
    parts: dict[str, float]   # seconds per `profiled_parts` part; empty when not profiled


class Bench:
    """The engine under test: one model and KV cache, one `Engine` per configuration."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes
        # KV blocks for the long decode sweep's 48 requests, above the 5 % admission margin.
        bs = EngineConfig().block_size
        long_blocks = -(-(sizes.long_prompt + self.decode_max_tokens(sizes.long_prompt)) // bs)
        num_blocks = max(1024, math.ceil(max(sizes.decode_phases) * long_blocks / 0.9))
        path = default_gguf_path()
        log(f"loading {path.name}")
        self.args, state = load_gguf(open_gguf(path))
        base = engine_from_weights(EngineConfig(num_blocks=num_blocks, dtype="bfloat16"),
                                   self.args, state)
        del state
        self.executor = base.executor
        self.model = base.executor.model
        # Whether `run` profiles the next step: "execute" (the executor's ranges), "split" (and
        # the forward's Python calls) or None; the decode sweep sets it between steps.
        self.profiling: Literal["execute", "split"] | None = None
        self._ids = 0

    def engine(self, **overrides) -> Engine:
        """A fresh engine (own scheduler and pool) over the shared executor and KV cache; a
        step's prefill is the token caps alone (TPOT and gap targets of 1 ms, which no step is
        predicted within), so a chunk measured is the chunk asked for."""
        kv = self.executor.kv
        settings = dict(num_blocks=kv.num_blocks, block_size=kv.block_size, dtype="bfloat16",
                        queue_budget_s=1e9, default_deadline_s=1e9, prefix_caching=False,
                        **dict(CAPS_ALONE))
        return Engine(EngineConfig(**{**settings, **overrides}), self.executor)

    def prompts(self, n: int, length: int) -> list[list[int]]:
        """`n` distinct deterministic prompts of `length` token ids."""
        g = torch.Generator().manual_seed(1000 * n + length)
        hi = min(self.args.vocab_size, 32000)
        return torch.randint(100, hi, (n, length), generator=g).tolist()

    def submit(self, engine: Engine, prompts: list[list[int]], max_tokens: int,
               sampling: SamplingParams = GREEDY) -> list[Request]:
        reqs = []
        for p in prompts:
            self._ids += 1
            req = Request(f"bench-{self._ids}", "bench", list(p), max_tokens, sampling, 0.0, 0.0)
            engine.submit(req)
            reqs.append(req)
        return reqs

    def run(self, engine: Engine, on_record: Callable[[TimedStep], None] | None = None,
            max_steps: int = 100_000) -> list[TimedStep]:
        """Step `engine` on this thread until idle, timing every pass that ran a plan."""
        ran: list[tuple[StepPlan, float]] = []
        listener = lambda plan, events, s: ran.append((plan, s))  # noqa: E731
        engine.step_listeners.append(listener)
        records: list[TimedStep] = []
        try:
            for _ in range(max_steps):
                with engine.lock:
                    if not engine.scheduler.has_work:
                        break
                ran.clear()
                prof = None
                if self.profiling is not None:
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                  record_shapes=False,
                                                  with_stack=self.profiling == "split")
                    prof.start()
                try:
                    t0 = time.perf_counter()
                    engine.step()
                    wall = time.perf_counter() - t0
                finally:
                    if prof is not None:
                        prof.stop()
                parts = {} if prof is None else profiled_parts(prof, split=self.profiling == "split")
                plans = [(p, s) for p, s in ran if not p.empty]
                if not plans:
                    continue
                plan, step_s = plans[-1]
                dec = [s.end for s in plan.segments if getattr(s, "decode", s.length == 1)]
                rec = TimedStep(plan.num_decode_rows, plan.num_prefill_tokens,
                                plan_flops(plan, self.args),
                                statistics.fmean(dec) if dec else 0.0, step_s, wall, parts)
                records.append(rec)
                if on_record is not None:
                    on_record(rec)
            else:
                raise RuntimeError(f"engine still busy after {max_steps} steps")
        finally:
            engine.step_listeners.remove(listener)
        engine.pool.check_all_free()
        return records

    # -- the measurements ------------------------------------------------------------------------
    def warm_up(self) -> None:
        eng = self.engine()
        self.submit(eng, self.prompts(32, 16), 4)
        self.submit(eng, self.prompts(1, 256), 1)
        self.run(eng)

    def prefill(self, chunk: int) -> dict[str, float]:
        s = self.sizes
        eng = self.engine(prefill_token_budget=chunk, prefill_token_budget_few_rows=chunk)
        self.submit(eng, self.prompts(s.prefill_requests, s.prefill_prompt), 1)
        recs = [r for r in self.run(eng) if r.rows == 0 and r.prefill > 0]
        tokens = sum(r.prefill for r in recs)
        secs = sum(r.step_s for r in recs)
        flops = sum(r.flops for r in recs)
        return {"tok_s": tokens / secs, "step_ms": 1000 * secs / len(recs),
                "flops_per_token": flops / tokens, "gflops": flops / secs / 1e9,
                "steps": len(recs)}

    def decode_max_tokens(self, prompt_len: int) -> int:
        """Enough tokens for every request of the sweep to live to the end of its last phase:
        the early requests decode while the later ones prefill, one chunk a step."""
        s = self.sizes
        rows = max(s.decode_phases)
        prefill_steps = -(-rows * prompt_len // s.decode_chunk) + rows
        return (prefill_steps + len(s.decode_phases) * (s.decode_skip + s.decode_steps + 2)
                + s.profile_steps + s.breakdown_steps + s.split_steps + 16)

    def decode(self, prompt_len: int, profile: bool = False
               ) -> tuple[dict[int, list[TimedStep]], list[TimedStep], list[TimedStep]]:
        """The decode sweep: rows go 48 → 32 → 8 → 1 by cancelling the newest requests.

        Returns the counted steps per row count; `breakdown_steps` more 32-row steps, profiled
        (`profiled_parts`: forward, logits, sample); and `split_steps` more 32-row steps run
        through the Python block loop (the runner's `decode_loop` set aside), profiled with the
        forward split: the production path runs a pure-decode step's blocks in one C++ call
        (`decode_layers`), inside which the profiler cannot time the matrix products and
        attention apart; the Python loop calls the same kernels one by one, so its steps give the
        split (and its cost over the C++ loop).

        All requests are submitted at once and admitted together (max_rows 48); prefill carries
        `decode_chunk` prompt tokens a step, and each request decodes from the step after its
        prompt is done, so contexts in a phase differ by the steps between the first and the
        last request finishing prefill (the scheduler interleaves prompts; the mean context is
        reported). Cancelling takes effect at the next step boundary.
        """
        s = self.sizes
        phases = s.decode_phases
        eng = self.engine(max_rows=max(phases), prefill_token_budget=s.decode_chunk,
                          prefill_token_budget_few_rows=s.decode_chunk)
        max_tokens = self.decode_max_tokens(prompt_len)
        reqs = self.submit(eng, self.prompts(max(phases), prompt_len), max_tokens)
        counted: dict[int, list[TimedStep]] = {rows: [] for rows in phases}
        breakdown: list[TimedStep] = []
        split: list[TimedStep] = []
        st = {"phase": 0, "seen": 0, "prof": None, "prof_left": 0, "breakdown": False,
              "splitting": False}
        saved_loop = self.executor.decode_loop

        def on_record(rec: TimedStep) -> None:
            if st["breakdown"]:
                if rec.rows == 32 and rec.prefill == 0 and rec.parts:
                    breakdown.append(rec)
                if len(breakdown) >= s.breakdown_steps:
                    st["breakdown"] = False
                    self.executor.decode_loop = None
                    self.profiling = "split"
                    st["splitting"] = True
                return
            if st["splitting"]:
                if rec.rows == 32 and rec.prefill == 0 and rec.parts:
                    split.append(rec)
                if len(split) >= s.split_steps:
                    self.executor.decode_loop = saved_loop
                    self.profiling = None
                    st["splitting"] = False
                    after_32()
                return
            if st["prof"] is not None:
                st["prof_left"] -= 1
                if st["prof_left"] > 0:
                    return
                st["prof"].__exit__(None, None, None)
                print_profile(st["prof"], prompt_len)
                st["prof"] = None
                advance()
                return
            if st["phase"] >= len(phases):
                return
            rows = phases[st["phase"]]
            if rec.rows == rows and rec.prefill == 0:
                if st["seen"] == 0 and st["phase"] == 0:
                    log(f"  prompts prefilled, {rows} rows decoding")
                st["seen"] += 1
                if st["seen"] > s.decode_skip:
                    counted[rows].append(rec)
            if len(counted[rows]) >= s.decode_steps:
                if rows == 32:
                    self.profiling = "execute"
                    st["breakdown"] = True
                    return
                advance()

        def after_32() -> None:
            if profile:
                st["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                st["prof"].__enter__()
                st["prof_left"] = s.profile_steps
                return
            advance()

        def advance() -> None:
            done = counted[phases[st["phase"]]]
            log(f"  {phases[st['phase']]} rows: median step "
                f"{1000 * statistics.median(r.step_s for r in done):.1f} ms, "
                f"mean context {statistics.fmean(r.context for r in done):.0f}")
            st["phase"] += 1
            st["seen"] = 0
            keep = phases[st["phase"]] if st["phase"] < len(phases) else 0
            for req in [r for r in reqs if not r.finished][keep:]:
                eng.cancel(req.request_id)

        try:
            self.run(eng, on_record)
        finally:
            self.executor.decode_loop = saved_loop
            self.profiling = None
        if st["phase"] < len(phases):
            raise RuntimeError(f"decode sweep ended in phase {st['phase']} "
                               f"({ {r: len(v) for r, v in counted.items()} } steps counted)")
        return counted, breakdown, split

    def controls_step(self, prompt_len: int) -> tuple[list[float], list[float]]:
        """The penalty step: 32-row pure-decode steps where every row is GREEDY, and where every
        row is PENALIZED (repetition, frequency and presence penalties and a 10-entry bias over
        the same prompts), in alternating runs of `controls_steps` counted steps each
        (`controls_rounds` of each, the first 2 steps of a run dropped), so drift in the
        machine's speed falls on both. Returns the step times (executor time, s) of each."""
        s = self.sizes
        out: dict[bool, list[float]] = {False: [], True: []}
        prompts = self.prompts(32, prompt_len)
        for _ in range(s.controls_rounds):
            for penalized in (False, True):
                eng = self.engine(max_rows=32, prefill_token_budget=2048,
                                  prefill_token_budget_few_rows=2048)
                self.submit(eng, prompts, s.controls_steps + 2 + 1, PENALIZED if penalized else GREEDY)
                recs = [r for r in self.run(eng) if r.rows == 32 and r.prefill == 0]
                out[penalized] += [r.step_s for r in recs[2:]]
        return out[False], out[True]

    def structured_step(self) -> tuple[list[float], list[float], dict[str, float]]:
        """The structured step: 32-row pure-decode steps of GREEDY rows, free, and with rows
        0–15 following `NESTED_SCHEMA` (rows 16–31 free), over the same `structured_prompt`-token
        prompts, in alternating runs of `structured_steps` counted steps (`structured_rounds` of
        each, the first 2 of a run dropped). Returns the step times (executor time, s) of the free
        and the half-constrained runs, and other figures: `compile_first_ms`, `compile_second_ms`
        (a fresh `GrammarCompiler`, vocabulary built beforehand), and from the grammar worker's
        counters (`ModelRunner.grammar.stats`) over the constrained runs (after one short untimed
        constrained run, so first-call costs are not in them): `mask_steps`, `mask_rows`,
        `compute_s`, `wait_s`, `apply_s`.
        """
        s = self.sizes
        log("  compiling")
        tokenizer = Tokenizer.from_gguf(default_gguf_path())
        compiler = GrammarCompiler(tokenizer)
        compiler.compile(ConstraintSpec.choices(["warm"]))        # the vocabulary, built once
        spec = ConstraintSpec.json_schema(NESTED_SCHEMA)
        t0 = time.perf_counter()
        grammar = compiler.compile(spec)
        t1 = time.perf_counter()
        again = compiler.compile(ConstraintSpec.json_schema(json.dumps(NESTED_SCHEMA, indent=2)))
        t2 = time.perf_counter()
        assert again is grammar and compiler.stats.misses == 2
        compile_ms = {"compile_first_ms": 1000 * (t1 - t0), "compile_second_ms": 1000 * (t2 - t1),
                      "compile_llguidance_ms": 1000 * grammar.compile_s}
        prompts = self.prompts(32, s.structured_prompt)

        def one_run(constrained: bool, max_tokens: int) -> list[float]:
            eng = self.engine(max_rows=32, prefill_token_budget=2048, prefill_token_budget_few_rows=2048)
            reqs = []
            for i, p in enumerate(prompts):
                self._ids += 1
                req = Request(f"bench-{self._ids}", "bench", list(p), max_tokens, GREEDY, 0.0, 0.0,
                              constraint=grammar if constrained and i < 16 else None)
                eng.submit(req)
                reqs.append(req)
            t0 = time.perf_counter()
            recs = [r for r in self.run(eng) if r.rows == 32 and r.prefill == 0]
            log(f"  {'16 constrained' if constrained else 'free'}: {len(recs)} 32-row steps, "
                f"{time.perf_counter() - t0:.1f} s")
            states = eng.executor.states      # the runner's per-request state (not yet dropped)
            for req in reqs[:16] if constrained else []:    # every constrained row stayed valid
                held = states.get(req.request_id)
                assert held is None or not held.grammar.matcher.is_error(), req.request_id
            return [r.step_s for r in recs[2:]]

        one_run(True, 4)                                    # first-call costs, untimed
        stats = self.executor.grammar.stats
        before = (stats.steps, stats.rows, stats.compute_s, stats.wait_s, stats.apply_s)
        out: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(s.structured_rounds):
            for constrained in (False, True):
                out[constrained] += one_run(constrained, s.structured_steps + 3)
        after = (stats.steps, stats.rows, stats.compute_s, stats.wait_s, stats.apply_s)
        figures = dict(compile_ms, **dict(zip(("mask_steps", "mask_rows", "compute_s", "wait_s", "apply_s"),
                                              (a - b for a, b in zip(after, before)))))
        return out[False], out[True], figures

    def end_to_end(self, batch: int, prompt_len: int, new_tokens: int) -> float:
        """Static batch through the default engine (32 rows, chunk 256): generated tokens/s."""
        eng = self.engine()
        prompts = self.prompts(batch, prompt_len)
        t0 = time.perf_counter()
        reqs = self.submit(eng, prompts, new_tokens)
        self.run(eng)
        wall = time.perf_counter() - t0
        assert all(len(r.generated) == new_tokens for r in reqs)
        return batch * new_tokens / wall


def print_profile(prof, prompt_len: int) -> None:
    print(f"\n-- torch.profiler: 32-row decode steps, {prompt_len}-token prompts "
          "(self CPU time, top ops) --", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def transformers_tok_s(cases: list[tuple[str, list[list[int]]]], new_tokens: int,
                       threads: int) -> dict[str, float]:
    """transformers' greedy static-batch `generate` (bf16, same GGUF): tokens/s per case."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    path = default_gguf_path()
    log("loading the transformers model")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.bfloat16).eval()
    torch.set_num_threads(threads)
    pad = model.config.eos_token_id if model.config.eos_token_id is not None else 0

    def generate(ids: torch.Tensor, n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=pad)
        wall = time.perf_counter() - t0
        assert out.shape == (ids.shape[0], ids.shape[1] + n), out.shape
        return wall

    generate(torch.tensor(cases[0][1]), 2)          # warm-up
    result = {}
    for name, prompts in cases:
        log(f"transformers generate {name}: batch {len(prompts)} × {len(prompts[0])} tokens")
        ids = torch.tensor(prompts)
        result[name] = len(prompts) * new_tokens / generate(ids, new_tokens)
    return result


def report_controls(rep: Report, bench: Bench, s: Sizes) -> None:
    """The sampling controls' cost: 32-row steps with every row penalized and biased, beside the
    same steps without (alternating runs of one engine, same prompts; `Bench.controls_step`)."""
    for plen in s.controls_prompts:
        log(f"penalty step: 32 rows, {plen}-token prompts, plain vs penalties + bias")
        plain, penalized = bench.controls_step(plen)
        k = f"controls.prompt{plen}.rows32"
        p_ms, q_ms = 1000 * statistics.median(plain), 1000 * statistics.median(penalized)
        rep.add(f"{k}.plain_step_ms", p_ms, f"{plen}-token prompts, 32 rows: plain step", "ms",
                f"median of {len(plain)}")
        rep.add(f"{k}.penalized_step_ms", q_ms, f"{plen}-token prompts, 32 rows: penalties + bias",
                "ms", f"median of {len(penalized)}; repetition, frequency, presence, 10-entry bias")
        rep.add(f"{k}.penalized_over_plain", q_ms / p_ms, f"{plen}-token prompts: penalized / plain step",
                "×", "target ≤ 1.05")


def report_structured(rep: Report, bench: Bench, s: Sizes) -> None:
    """Structured outputs' cost: the 32-row step with 16 rows under `NESTED_SCHEMA` beside the
    same step free (`Bench.structured_step`), the schema's compile time first and second, and the
    grammar worker's time per constrained row (`ModelRunner.grammar.stats`, the difference over
    the constrained runs)."""
    log(f"structured step: 32 rows, {s.structured_prompt}-token prompts, free vs 16 rows under a nested schema")
    free, constrained, fig = bench.structured_step()
    compile_ms = fig
    steps, rows = fig["mask_steps"], fig["mask_rows"]
    compute_s, wait_s, apply_s = fig["compute_s"], fig["wait_s"], fig["apply_s"]
    k = "structured.rows32"
    f_ms, c_ms = 1000 * statistics.median(free), 1000 * statistics.median(constrained)
    rep.add(f"{k}.free_step_ms", f_ms, "32 free rows: step", "ms", f"median of {len(free)}")
    rep.add(f"{k}.constrained16_step_ms", c_ms, "16 rows under the nested schema + 16 free: step",
            "ms", f"median of {len(constrained)}")
    rep.add(f"{k}.constrained_over_free", c_ms / f_ms, "half-constrained / free step", "×",
            "target ≤ 1.10")
    rep.add("structured.compile_first_ms", compile_ms["compile_first_ms"],
            "nested schema: first compile", "ms", "llguidance, vocabulary already built")
    rep.add("structured.compile_second_ms", compile_ms["compile_second_ms"],
            "nested schema: second request (cache)", "ms", "same schema, other whitespace")
    rep.add("structured.mask_us_per_row", 1e6 * compute_s / rows, "grammar worker per constrained row-step",
            "µs", f"{rows} row-steps over {steps} steps; overlaps the forward")
    rep.add("structured.mask_wait_ms_per_step", 1000 * wait_s / steps, "sampling waited for the masks",
            "ms/step", "on the critical path")
    rep.add("structured.mask_apply_ms_per_step", 1000 * apply_s / steps, "applying 16 masks to the logits",
            "ms/step", "on the critical path")


# -- the run -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, seconds)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    ap.add_argument("--skip-transformers", action="store_true",
                    help="do not run transformers' generate for comparison")
    ap.add_argument("--profile", action="store_true",
                    help="print a torch.profiler op table of a few 32-row decode steps")
    ap.add_argument("--only", choices=["controls", "structured"],
                    help="run one section only: the sampling controls' step cost, or structured "
                         "outputs' (step, compile, mask)")
    opts = ap.parse_args(argv)
    s = QUICK if opts.quick else FULL
    rep = Report()
    threads = set_threads(EngineConfig())
    rep.meta.update(threads=threads, torch=torch.__version__, quick=opts.quick,
                    sizes={k: getattr(s, k) for k in s.__slots__})
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    if opts.only is not None:
        bench = Bench(s)
        log("warm-up")
        bench.warm_up()
        {"controls": report_controls, "structured": report_structured}[opts.only](rep, bench, s)
        return finish(rep, opts, threads, started, load_start)

    # 1. machine
    log("machine limits")
    bf16 = rep.add("machine.gemm_bf16_gflops", gemm_gflops(s.gemm_n, torch.bfloat16, s.gemm_repeats),
                   f"bf16 GEMM {s.gemm_n}³", "GFLOP/s", f"best of {s.gemm_repeats}, {threads} threads")
    fp32 = rep.add("machine.gemm_fp32_gflops", gemm_gflops(s.gemm_n, torch.float32, s.gemm_repeats),
                   f"fp32 GEMM {s.gemm_n}³", "GFLOP/s")
    rep.add("machine.bf16_over_fp32", bf16 / fp32, "bf16 / fp32 GEMM", "×")
    bw = rep.add("machine.copy_gbps", copy_gbps(s.copy_mib, s.copy_repeats),
                 f"copy bandwidth ({s.copy_mib} MiB)", "GB/s", "bytes read + written")
    read_bw = rep.add("machine.read_gbps", read_gbps(s.copy_mib, s.copy_repeats),
                      f"read bandwidth ({s.copy_mib} MiB sum)", "GB/s", "bytes read")

    attn = {}
    if kernels.available():
        log(f"decode attention microbenchmark: {s.attn_rows} rows × {s.attn_context} tokens")
        attn = attention_bench.measure(read_bw, s.attn_rows, s.attn_context, s.attn_repeats)
    rep.meta["thp_mode"] = attention_bench.thp_mode()

    # 2. engine
    bench = Bench(s)
    args = bench.args
    wbytes = matmul_weight_bytes(bench.model)
    nb, nout = block_params(args), args.vocab_size * args.dim
    rep.add("model.block_params", nb, "block matrix params N_blocks", "", "QKV, O, gate, up, down × 30")
    rep.add("model.output_params", nout, "output projection params N_out", "", "49,152 × 576")
    rep.add("model.weight_bytes", wbytes, "bf16 matrix bytes read / step", "B",
            "N_blocks + N_out, 2 bytes each")
    attn_per_key = 4 * args.n_layers * args.n_heads * args.head_dim
    rep.add("model.attn_flops_per_key", attn_per_key, "attention FLOPs per token per key", "FLOP",
            "4·n_layers·n_heads·head_dim")
    floor_ms = 1000 * wbytes / (read_bw * 1e9)
    floor_copy_ms = 1000 * wbytes / (bw / 2 * 1e9)
    rep.meta["flops_formula"] = ("2*N_blocks + 4*n_layers*n_heads*head_dim*L "
                                 "[+ 2*N_out if the token's logits are computed]")

    log("warm-up")
    bench.warm_up()

    pre = {}
    for chunk in s.prefill_chunks:
        log(f"prefill chunk {chunk}")
        pre[chunk] = r = bench.prefill(chunk)
        k = f"prefill.chunk{chunk}"
        rep.add(f"{k}.tok_s", r["tok_s"], f"chunk {chunk}: prefill", "tok/s",
                f"{s.prefill_requests} × {s.prefill_prompt}-token prompts, {r['steps']} steps")
        rep.add(f"{k}.step_ms", r["step_ms"], f"chunk {chunk}: time per step", "ms")
        rep.add(f"{k}.flops_per_token", r["flops_per_token"], f"chunk {chunk}: model FLOPs / token",
                "FLOP", "2·N_blocks + attention at mean context")
        rep.add(f"{k}.gflops", r["gflops"], f"chunk {chunk}: achieved model rate", "GFLOP/s")
        rep.add(f"{k}.of_gemm", r["gflops"] / bf16, f"chunk {chunk}: of bf16 GEMM rate", "×")
    c0, c1 = s.prefill_chunks[0], s.prefill_chunks[-1]
    rep.add("prefill.chunk_ratio", pre[c1]["tok_s"] / pre[c0]["tok_s"],
            f"prefill tok/s chunk {c1} / chunk {c0}", "×")

    sweeps, breakdowns, splits = {}, {}, {}
    for ctx, plen in (("short", s.short_prompt), ("long", s.long_prompt)):
        log(f"decode sweep, {ctx} context ({plen}-token prompts)")
        sweeps[ctx], breakdowns[ctx], splits[ctx] = bench.decode(plen, profile=opts.profile)
    dec: dict[tuple[str, int], dict[str, float]] = {}
    for ctx, counted in sweeps.items():
        for rows in sorted(counted):
            recs = counted[rows]
            med = statistics.median(r.step_s for r in recs)
            d = dec[ctx, rows] = {"step_ms": 1000 * med, "tok_s": rows / med,
                                  "context": statistics.fmean(r.context for r in recs),
                                  "flops_per_token": sum(r.flops for r in recs) / (rows * len(recs))}
            k = f"decode.{ctx}.rows{rows}"
            rep.add(f"{k}.step_ms", d["step_ms"], f"{ctx} ctx, {rows:>2} rows: step", "ms",
                    f"median of {len(recs)}, mean context {d['context']:.0f}")
            rep.add(f"{k}.tok_s", d["tok_s"], f"{ctx} ctx, {rows:>2} rows: decode", "tok/s")
    for ctx in sweeps:
        rep.add(f"decode.{ctx}.flops_per_token", dec[ctx, 32]["flops_per_token"],
                f"{ctx} ctx: model FLOPs / decode token", "FLOP", "2·(N_blocks + N_out) + attention")

    # ratios
    rep.add("ratio.rows1_floor_ms", floor_ms, "1-row bandwidth floor", "ms", "weight bytes / read GB/s")
    rep.add("ratio.rows1_floor_copy_ms", floor_copy_ms, "1-row floor from half the copy rate", "ms",
            "weight bytes / (copy GB/s ÷ 2)")
    for ctx in sweeps:
        rep.add(f"ratio.{ctx}.rows1_over_floor", dec[ctx, 1]["step_ms"] / floor_ms,
                f"{ctx} ctx: 1-row step / floor", "×", "target ≤ 2")
        rep.add(f"ratio.{ctx}.rows1_over_floor_copy", dec[ctx, 1]["step_ms"] / floor_copy_ms,
                f"{ctx} ctx: 1-row step / floor (copy ÷ 2)", "×")
    for ctx in sweeps:
        ceiling = bf16 * 1e9 / dec[ctx, 32]["flops_per_token"]
        rep.add(f"ratio.{ctx}.rows32_ceiling_tok_s", ceiling,
                f"{ctx} ctx: 32-row arithmetic ceiling", "tok/s", "bf16 GEMM rate / FLOPs per token")
        rep.add(f"ratio.{ctx}.rows32_of_ceiling", dec[ctx, 32]["tok_s"] / ceiling,
                f"{ctx} ctx: 32-row tok/s / ceiling", "×", "target ≥ 0.4")
    for ctx in sweeps:
        rep.add(f"ratio.{ctx}.rows32_over_rows1", dec[ctx, 32]["tok_s"] / dec[ctx, 1]["tok_s"],
                f"{ctx} ctx: 32-row / 1-row tok/s", "×", "target ≥ 10")
        rep.add(f"ratio.{ctx}.rows48_over_rows32", dec[ctx, 48]["tok_s"] / dec[ctx, 32]["tok_s"],
                f"{ctx} ctx: 48-row / 32-row tok/s", "×")
    for rows in sorted(s.decode_phases):
        rep.add(f"ratio.long_over_short.rows{rows}",
                dec["long", rows]["step_ms"] / dec["short", rows]["step_ms"],
                f"long / short ctx step time, {rows:>2} rows", "×")

    # decode attention at long contexts, beside the 32-row steps it is part of
    short32, long32 = dec["short", 32], dec["long", 32]
    rep.add("attention.rows32.short_step_ms", short32["step_ms"], "32-row decode step, short ctx", "ms",
            f"mean context {short32['context']:.0f}")
    rep.add("attention.rows32.long_step_ms", long32["step_ms"], "32-row decode step, long ctx", "ms",
            f"mean context {long32['context']:.0f}")
    rep.add("attention.rows32.long_over_short", long32["step_ms"] / short32["step_ms"],
            "long / short ctx 32-row step", "×")
    for layout, what in (("4k", "4 KB pages"), ("thp", "huge pages advised, as the KV cache"),
                         ("4k_int8", "4 KB pages, the 8-bit KV format (--kv-cache-dtype int8)"),
                         ("thp_int8", "huge pages advised, the 8-bit KV format, as the KV cache")):
        r = attn.get(layout)
        if r is None:
            continue
        k = f"attention.decode_{layout}"
        shape = f"{s.attn_rows} × {s.attn_context} tokens"
        rep.add(f"{k}.ms", 1000 * r.step_s, f"decode attention {shape}, {layout}", "ms",
                f"best of {s.attn_repeats}, 30 layers; {what}"
                + (f" ({r.huge_mb:.0f} MB in huge pages)" if layout.startswith("thp") else ""))
        rep.add(f"{k}.kv_bytes", r.kv_bytes, "  K/V bytes it reads", "B",
                "layers · rows · context · kv_heads · row bytes (128, or 66 in 8 bits) · 2")
        rep.add(f"{k}.gbps", r.gbps, "  achieved read rate", "GB/s", f"read bandwidth {read_bw:.1f} GB/s")
        rep.add(f"{k}.over_floor", r.over_floor, "  time / (bytes ÷ read bandwidth)", "×",
                "target ≤ 1.5")
        rep.add(f"{k}.of_long_step", 1000 * r.step_s / long32["step_ms"],
                "  of the long-ctx 32-row step", "", "microbenchmark time / step time (contexts "
                f"{s.attn_context} vs {long32['context']:.0f})")

    # where a 32-row step goes: the production steps for the share outside the forward, the
    # Python-loop steps (same kernels, called one by one) for the split inside it
    for ctx in sweeps:
        recs, split = breakdowns[ctx], splits[ctx]
        n, n_split = len(recs), len(split)
        tot = lambda rs, key: sum(r.parts.get(key, 0.0) for r in rs)  # noqa: E731
        wall, execute, forward = sum(r.wall_s for r in recs), sum(r.step_s for r in recs), tot(recs, "forward")
        logits, sample = tot(recs, "logits"), tot(recs, "sample")
        k = f"step.{ctx}.rows32"
        ms = lambda x, count=n: 1000 * x / count  # noqa: E731
        rep.add(f"{k}.wall_ms", ms(wall), f"{ctx} ctx: Engine.step() wall", "ms", f"mean of {n}")
        rep.add(f"{k}.forward_ms", ms(forward), f"{ctx} ctx:   model forward", "ms",
                f"{forward / wall:.1%} of wall; blocks in one C++ call (decode_layers)")
        py_forward = tot(split, "forward")
        lin, att, rope = tot(split, "linear"), tot(split, "attention"), tot(split, "rope")
        dec_att = tot(split, "decode_attention")
        rep.add(f"{k}.python_loop_forward_ms", ms(py_forward, n_split),
                f"{ctx} ctx:   same forward, Python block loop", "ms",
                f"mean of {n_split}; split below")
        rep.add(f"{k}.linear_ms", ms(lin, n_split), f"{ctx} ctx:     linear (matmuls)", "ms",
                f"{lin / py_forward:.1%} of it")
        rep.add(f"{k}.attention_ms", ms(att, n_split), f"{ctx} ctx:     attention (attend)", "ms",
                f"{att / py_forward:.1%} of it")
        rep.add(f"{k}.decode_attention_ms", ms(dec_att, n_split), f"{ctx} ctx:       of which decode_attention",
                "ms", "batched decode rows; the rest is prefill pieces")
        rep.add(f"{k}.rope_ms", ms(rope, n_split), f"{ctx} ctx:     RoPE + K/V write", "ms",
                f"{rope / py_forward:.1%} of it")
        rep.add(f"{k}.forward_other_ms", ms(py_forward - lin - att - rope, n_split),
                f"{ctx} ctx:     rest of forward", "ms", "norms + residual adds, embedding, SiLU·up, Python")
        rep.add(f"{k}.logits_ms", ms(logits), f"{ctx} ctx:   logits projection", "ms", f"{logits / wall:.1%} of wall")
        rep.add(f"{k}.sample_ms", ms(sample), f"{ctx} ctx:   sampling", "ms", f"{sample / wall:.1%} of wall")
        rep.add(f"{k}.inputs_ms", ms(execute - forward - logits - sample),
                f"{ctx} ctx:   building inputs", "ms", "execute − forward − logits − sample")
        rep.add(f"{k}.scheduler_ms", ms(wall - execute), f"{ctx} ctx:   schedule + update + push",
                "ms", "step wall − execute")
        rep.add(f"{k}.outside_forward_share", 1 - (forward + logits) / wall,
                f"{ctx} ctx: share outside forward", "", "1 − (forward + logits) / step wall; target < 0.1")

    report_controls(rep, bench, s)
    report_structured(rep, bench, s)

    # end to end, and transformers on the same batches
    ours = {}
    for name, batch, plen in s.e2e_cases:
        log(f"engine end to end {name}: batch {batch} × {plen} tokens, {s.e2e_new_tokens} new")
        ours[name] = rep.add(f"e2e.ours.{name}.tok_s", bench.end_to_end(batch, plen, s.e2e_new_tokens),
                             f"genserve {batch:>2} × {plen}-token prompts", "tok/s",
                             f"{s.e2e_new_tokens} new tokens, wall incl. prefill")
    if not opts.skip_transformers:
        cases = [(name, bench.prompts(batch, plen)) for name, batch, plen in s.e2e_cases]
        del bench
        theirs = transformers_tok_s(cases, s.e2e_new_tokens, threads)
        for name, batch, plen in s.e2e_cases:
            rep.add(f"e2e.hf.{name}.tok_s", theirs[name], f"transformers {batch:>2} × {plen}-token prompts",
                    "tok/s", "generate, greedy, static batch")
        for name, batch, plen in s.e2e_cases:
            rep.add(f"e2e.ours_over_hf.{name}", ours[name] / theirs[name],
                    f"genserve / transformers, {batch:>2} × {plen}", "×")

    return finish(rep, opts, threads, started, load_start)


def finish(rep: Report, opts: argparse.Namespace, threads: int, started: float, load_start: float) -> int:
    """Print the report (and write --json); returns the exit status 0."""
    rep.meta["seconds"] = round(time.perf_counter() - started, 1)
    rep.meta["loadavg_1min"] = [load_start, os.getloadavg()[0]]
    print(f"genserve engine benchmark — {threads} threads, torch {torch.__version__}, "
          f"{'quick' if opts.quick else 'full'} sizes, {rep.meta['seconds']} s, 1-min load average "
          f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    if max(rep.meta["loadavg_1min"]) > threads + 1:
        print(f"WARNING: load average above {threads} threads + 1: other processes competed for "
              "the CPU during this run; its figures (ratios included) are unreliable")
    rep.print()
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps({"meta": rep.meta, "figures": rep.figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
