"""The prepared device check: the engine on a GPU (or, as a dry run, the CPU), in one command.

    python -m benchmarks.device                       # on a CUDA machine: random Llama-2-7B, FP16
    python -m benchmarks.device --dry-run             # the same code on the CPU, tiny shapes (CI)
    scripts/device_check.sh                           # the GPU run, writing $OUT/device_check.json

What it does, in order (docs/benchmarks/device.md):

1. **Checks**: on the device, a random-initialised tiny model's greedy tokens through the engine
   (paged KV cache, chunked prefill, the chosen attention backend) against a dense fp32
   reference written here (plain torch: RMSNorm, rotate-half RoPE, causal attention, SwiGLU);
   the 8-bit KV cache (`check_int8_cache`: tokens against the model-dtype cache, batch
   invariance); and optionally the engine's pytest files, when pytest is importable (`--pytest`).
2. **Model**: `random:llama-2-7b` (no weights travel) in FP16 on the device; the KV pool sized
   from the device's free memory after the weights and the activation reserve, as the server
   does (`engine.runner.builder.kv_pool_blocks`).
3. **Prefill**: one 3,584-token prompt alone, at prefill chunks of 256, 512 and 2,048 tokens:
   prompt tokens / Σ step time.
4. **Decode**: R rows (1, 8, 32, 48, 64) with 1,536-token prompts, prefilled, then the median
   time of the pure-decode steps with exactly R rows (contexts ≈ 1,540–1,560), with and without
   CUDA graphs (`ModelRunner(cuda_graphs=True)`) when the executor offers them.
5. **Batch invariance** at temperature 0 (`engine.runner.invariance.check_batch_invariance`): 32
   mixed-length requests, several of them also alone.
6. **Peak memory** (`torch.cuda.max_memory_allocated`).
7. **Cost model and load test**: every measured step (its rows, prefill tokens, context and
   attention pairs, and its time with the device synchronised before and after) fitted by the
   simulator's least-squares fit, then the design's load test in virtual time (the design's
   length mix, Poisson arrivals at fixed rates, the design's engine dials with this device's pool)
   giving goodput for one device at the design's SLOs (TTFT ≤ 3 s, TPOT ≤ 70 ms, 95 %).

Every figure is printed beside the design's assumption (10,000 prefill tokens/s; a decode step of
25 ms at 1 row, 40 ms at 32) and the physical limit: bytes the step must read (the weights once,
plus each decode row's K/V) ÷ the memory bandwidth (H200: 4.8 TB/s), and for prefill also
FLOPs ÷ the tensor-core peak (H200: 989 TFLOP/s dense FP16; NVIDIA H200 datasheet). One JSON
holds it all. Needs torch, numpy, safetensors and tokenizers only (no gguf, xformers, fastapi).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import CAPS_ALONE, EngineConfig
from engine.core.cost_model import fit_step_model
from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams
from engine.core.sim_executor import SimExecutor
from engine.model.config import ModelArgs
from engine.model.transformer import Transformer
from engine.model.weights import random_shape, random_weights
from engine.runner.builder import kv_pool_blocks, load_weights, model_from_weights, resolve_device
from engine.runner.kv_cache import KVCache
from engine.runner.model_runner import ModelRunner
from genserve.common.model_source import parse_model_source

# The design's assumptions (docs/design.md, "The numbers").
DESIGN_PREFILL_TOKENS_PER_S = 10_000.0
DESIGN_DECODE_MS = {1: 25.0, 32: 40.0}
# H200 SXM (NVIDIA H200 datasheet): HBM3e bandwidth and dense FP16/BF16 tensor-core peak.
H200_BANDWIDTH_B_PER_S = 4.8e12
H200_FP16_FLOP_PER_S = 989e12
# pytest files run on the device by --pytest (those that need no GGUF, transformers or fastapi).
DEVICE_TEST_FILES = ("tests/engine/runner/test_device_generic.py", "tests/engine/attention/test_attention_backends.py",
                     "tests/engine/runner/test_kv_sizing.py", "tests/engine/model/test_checkpoints.py",
                     "tests/engine/runner/test_sampler.py", "tests/engine/core/test_scheduler.py",
                     "tests/engine/model/test_moe_device.py")


@dataclass(frozen=True, slots=True)
class CheckPlan:
    """What one run measures; `FULL` on a GPU, `DRY` on the CPU (same code, tiny shapes).

    Attributes:
        model: a `--model` value (a random shape: no weights travel).
        dtype: serving dtype.
        prefill_chunks: prefill chunk sizes to measure, tokens.
        prefill_prompt: prompt length of the prefill measurement, tokens.
        decode_rows: decode row counts to measure.
        decode_context: prompt length of each decode row, tokens.
        decode_steps: pure-decode steps measured per row count.
        invariance_batch / invariance_checked / invariance_tokens: the batch-invariance check's
            batch size, how many of it also run alone, tokens generated.
        reference_tokens: tokens the dense-reference check generates.
        sim_rates: arrival rates of the simulated load test, requests/s.
        sim_duration_s: virtual seconds per rate.
        activation_reserve_bytes: device memory left for activations when sizing the pool.
    """

    model: str
    dtype: str
    prefill_chunks: tuple[int, ...]
    prefill_prompt: int
    decode_rows: tuple[int, ...]
    decode_context: int
    decode_steps: int
    invariance_batch: int
    invariance_checked: int
    invariance_tokens: int
    reference_tokens: int
    sim_rates: tuple[float, ...]
    sim_duration_s: float
    activation_reserve_bytes: int


FULL = CheckPlan(model="random:llama-2-7b", dtype="float16", prefill_chunks=(256, 512, 2048),
                 prefill_prompt=3584, decode_rows=(1, 8, 32, 48, 64), decode_context=1536,
                 decode_steps=12, invariance_batch=32, invariance_checked=8, invariance_tokens=16,
                 reference_tokens=12, sim_rates=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0),
                 sim_duration_s=600.0, activation_reserve_bytes=12 * 10**9)
DRY = CheckPlan(model="random:tiny", dtype="float32", prefill_chunks=(64, 128), prefill_prompt=256,
                decode_rows=(1, 2, 4), decode_context=96, decode_steps=4, invariance_batch=6,
                invariance_checked=2, invariance_tokens=6, reference_tokens=6, sim_rates=(0.5, 1.0),
                sim_duration_s=60.0, activation_reserve_bytes=6 * 10**9)


# -- timing ---------------------------------------------------------------------------------------
class SyncedExecutor:
    """Wraps an executor: each step timed with the device synchronised before and after (a CUDA
    step's host time is otherwise only its launch time), its features and time recorded.

    Attributes:
        samples: one dict per step: rows, prefill, context, pairs (`StepPlan.features`)
            and ms.
    """

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.device = inner.kv.layers[0].device
        self.samples: list[dict[str, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, plan):
        sync(self.device)
        t0 = time.perf_counter()
        out = self.inner.execute(plan)
        sync(self.device)
        ms = (time.perf_counter() - t0) * 1000.0
        if not plan.empty:
            b, c, k, p = plan.features().as_tuple()
            self.samples.append({"rows": b, "prefill": c, "context": k, "pairs": p, "ms": ms})
        return out


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_over(executor: SyncedExecutor, num_blocks: int, block_size: int, **dials: Any) -> Engine:
    """A fresh engine (scheduler, pool) over a shared executor; admission never refuses, no
    prefix caching, and a step's prefill is the token caps alone (TPOT and gap targets of 1 ms,
    which no step is predicted within: nothing beyond the caps joins), so a chunk measured is the
    chunk asked for; `dials` override any of these."""
    settings = dict(num_blocks=num_blocks, block_size=block_size, queue_budget_s=1e9,
                    device=executor.device.type, prefix_caching=False, **dict(CAPS_ALONE))
    return Engine(EngineConfig(**{**settings, **dials}), executor)


def prompt(n: int, salt: int, vocab: int) -> list[int]:
    """A deterministic prompt of `n` ids in [10, vocab)."""
    return [10 + (salt * 7919 + 31 * j) % (vocab - 10) for j in range(n)]


def run(engine: Engine, prompts: Sequence[list[int]], max_tokens: int, tag: str) -> list[Request]:
    """Submit greedy requests, step until idle, return them."""
    reqs = [Request(f"{tag}-{i}", tag, list(p), max_tokens,
                    SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0)
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    engine.run_until_idle()
    engine.pool.check_all_free()
    return reqs


# -- measurements ---------------------------------------------------------------------------------
def measure_prefill(executor: SyncedExecutor, num_blocks: int, plan: CheckPlan, vocab: int) -> dict[str, Any]:
    """Prompt tokens per second of one `plan.prefill_prompt`-token prompt alone, per chunk size."""
    out = {}
    for chunk in plan.prefill_chunks:
        engine = engine_over(executor, num_blocks, 16, prefill_token_budget=chunk, prefill_token_budget_few_rows=chunk,
                             prefill_piece=min(64, chunk), max_rows=64)
        run(engine, [prompt(plan.prefill_prompt, 1, vocab)], 1, f"warm{chunk}")     # warm-up
        first = len(executor.samples)
        run(engine, [prompt(plan.prefill_prompt, 2, vocab)], 1, f"prefill{chunk}")
        steps = [s for s in executor.samples[first:] if s["prefill"]]
        total_ms = sum(s["ms"] for s in steps)
        out[str(chunk)] = {"tokens_per_s": plan.prefill_prompt / (total_ms / 1000.0),
                           "steps": len(steps), "step_ms": [round(s["ms"], 3) for s in steps]}
    return out


def measure_decode(executor: SyncedExecutor, num_blocks: int, plan: CheckPlan, vocab: int) -> dict[str, Any]:
    """Median ms of the pure-decode steps with exactly R rows of ≈ `plan.decode_context` tokens."""
    biggest = max(plan.prefill_chunks)
    engine = engine_over(executor, num_blocks, 16, max_rows=max(plan.decode_rows), prefill_token_budget=biggest,
                         prefill_token_budget_few_rows=biggest)
    run(engine, [prompt(plan.decode_context, 3, vocab)], 4, "warm-decode")
    out = {}
    for rows in plan.decode_rows:
        prefill_steps = math.ceil(rows * plan.decode_context / biggest) + 1
        first = len(executor.samples)
        reqs = run(engine, [prompt(plan.decode_context, 100 + i, vocab) for i in range(rows)],
                   prefill_steps + plan.decode_steps, f"decode{rows}")
        pure = [s for s in executor.samples[first:] if s["rows"] == rows and not s["prefill"]]
        if not pure:
            raise RuntimeError(f"no pure-decode step with {rows} rows (pool of {num_blocks} blocks too small?)")
        ms = [s["ms"] for s in pure][1:] or [pure[0]["ms"]]          # the first may capture a graph
        out[str(rows)] = {"step_ms": statistics.median(ms), "steps": len(ms),
                          "mean_context": statistics.mean(s["context"] / rows for s in pure),
                          "tokens_generated": sum(len(r.generated) for r in reqs)}
    return out


# -- the dense reference ---------------------------------------------------------------------------
def dense_logits(args: ModelArgs, state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] of a whole sequence, written from the Llama equations with plain
    torch (no cache, no paging, no chunks): RMSNorm (Zhang & Sennrich 2019), rotate-half RoPE
    (Su et al. 2021; Hugging Face's row layout, as the loaders return it), causal softmax
    attention with grouped KV heads, SwiGLU (Shazeer 2020)."""
    w = {k: v.float() for k, v in state.items()}
    device = w["norm.weight"].device
    x = w["tok_embeddings.weight"][torch.tensor(ids, device=device)]
    t, hd, h, kvh = len(ids), args.head_dim, args.n_heads, args.n_kv_heads
    inv = 1.0 / args.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

    def norm(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + args.norm_eps) * weight

    def rope(v: torch.Tensor) -> torch.Tensor:
        a, b = v[..., : hd // 2], v[..., hd // 2:]
        return v * cos + torch.cat([-b, a], -1) * sin

    mask = torch.full((t, t), float("-inf"), device=device).triu(1)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        y = norm(x, w[p + "attention_norm.weight"])
        q = rope((y @ w[p + "attention.wq.weight"].T).view(t, h, hd))
        k = rope((y @ w[p + "attention.wk.weight"].T).view(t, kvh, hd)).repeat_interleave(h // kvh, 1)
        v = (y @ w[p + "attention.wv.weight"].T).view(t, kvh, hd).repeat_interleave(h // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, h * hd)
        x = x + o @ w[p + "attention.wo.weight"].T
        y = norm(x, w[p + "ffn_norm.weight"])
        gate, up = y @ w[p + "feed_forward.w1.weight"].T, y @ w[p + "feed_forward.w3.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "feed_forward.w2.weight"].T
    return norm(x, w["norm.weight"]) @ w["output.weight"].T


def check_reference(device: torch.device, plan: CheckPlan) -> dict[str, Any]:
    """The engine's greedy tokens on `device` against the dense fp32 reference's argmax, for a
    tiny random fp32 model and three prompts (one longer than a prefill chunk)."""
    args = random_shape("tiny")
    state = random_weights(args, torch.float32, device, seed=11, std=0.1)
    model = model_from_weights(args, state, torch.float32, device)
    kv = KVCache(args, 64, 16, torch.float32, device)
    executor = SyncedExecutor(ModelRunner(model, kv))
    engine = engine_over(executor, 64, 16, prefill_token_budget=64, prefill_token_budget_few_rows=64)
    prompts = [prompt(n, s, args.vocab_size) for s, n in ((1, 5), (2, 77), (3, 150))]
    reqs = run(engine, prompts, plan.reference_tokens, "reference")
    agree = total = 0
    with torch.inference_mode():
        for p, r in zip(prompts, reqs):
            logits = dense_logits(args, state, p + r.generated[:-1])
            want = logits[len(p) - 1:].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(want, r.generated))
            total += len(want)
    return {"tokens": total, "agree": agree, "identical": agree == total,
            "backend": getattr(getattr(executor.inner, "attention", None), "name", None)}


def check_int8_cache(device: torch.device, plan: CheckPlan) -> dict[str, Any]:
    """The 8-bit KV cache (`--kv-cache-dtype int8`) on `device`, for a tiny random model in
    `plan.dtype`: the greedy tokens of three prompts with the cache in the model dtype and in 8
    bits (how many agree: the 8-bit cache rounds every key and value, so some may not), and batch
    invariance with the 8-bit cache (`engine.runner.invariance.check_batch_invariance`)."""
    from engine.runner.invariance import check_batch_invariance

    args = random_shape("tiny")
    dtype = getattr(torch, plan.dtype)
    state = random_weights(args, torch.float32, device, seed=12, std=0.1)
    model = model_from_weights(args, state, dtype, device)
    prompts = [prompt(n, s, args.vocab_size) for s, n in ((4, 9), (5, 70), (6, 140))]
    tokens = {}
    for name, kv_dtype in (("model_dtype", dtype), ("int8", torch.int8)):
        executor = SyncedExecutor(ModelRunner(model, KVCache(args, 128, 16, kv_dtype, device)))
        engine = engine_over(executor, 128, 16, prefill_token_budget=64, prefill_token_budget_few_rows=64)
        tokens[name] = [r.generated for r in run(engine, prompts, plan.reference_tokens, f"kv-{name}")]
        backend = getattr(executor.inner.attention, "name", None)
    agree = sum(a == b for x, y in zip(tokens["model_dtype"], tokens["int8"]) for a, b in zip(x, y))
    invariant = check_batch_invariance(engine_over(executor, 128, 16), batch=8, max_tokens=8,
                                       checked=2)
    return {"tokens": sum(len(t) for t in tokens["int8"]), "agree_with_model_dtype": agree,
            "invariance": invariant.identical, "backend": backend}


def run_pytest(device: torch.device, files: Sequence[str] = DEVICE_TEST_FILES,
               timeout_s: float = 150.0) -> dict[str, Any]:
    """The engine's pytest files, when pytest is importable: their CUDA cases run where torch sees
    a CUDA device (they skip, saying so, elsewhere)."""
    if importlib.util.find_spec("pytest") is None:
        return {"ran": False, "why": "pytest is not installed here"}
    present = [f for f in files if pathlib.Path(f).is_file()]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                               "--continue-on-collection-errors", *present],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"ran": True, "device": device.type, "files": present, "returncode": None,
                "summary": f"stopped after {timeout_s} s", "output_tail": out.splitlines()[-40:],
                "seconds": round(time.perf_counter() - t0, 1)}
    lines = (proc.stdout + proc.stderr).strip().splitlines() or [""]
    return {"ran": True, "device": device.type, "files": present, "returncode": proc.returncode,
            "summary": lines[-1], "output_tail": lines[-40:], "seconds": round(time.perf_counter() - t0, 1)}


# -- physical limits ------------------------------------------------------------------------------
def matrix_bytes(args: ModelArgs, elem: int) -> int:
    """Bytes of the weights a step reads in full: every block matrix and the output projection
    (the embedding table is only indexed)."""
    hd = args.head_dim
    per_layer = args.dim * (args.n_heads * hd + 2 * args.n_kv_heads * hd) + args.n_heads * hd * args.dim \
        + 3 * args.dim * args.intermediate_size
    return elem * (args.n_layers * per_layer + args.vocab_size * args.dim)


def decode_limit_ms(args: ModelArgs, elem: int, rows: int, context: float,
                    bandwidth: float = H200_BANDWIDTH_B_PER_S) -> float:
    """Fastest possible decode step: (weights + rows × context × K/V bytes per token) ÷ bandwidth."""
    kv_per_token = 2 * args.n_layers * args.n_kv_heads * args.head_dim * elem
    return 1000.0 * (matrix_bytes(args, elem) + rows * context * kv_per_token) / bandwidth


def prefill_limit_tokens_per_s(args: ModelArgs, elem: int, chunk: int, prompt_tokens: int,
                               bandwidth: float = H200_BANDWIDTH_B_PER_S,
                               flops: float = H200_FP16_FLOP_PER_S) -> dict[str, float]:
    """Prefill ceilings for a prompt in chunks: memory (weights once per chunk) and compute
    (2 FLOPs per weight per token, plus QKᵀ and PV: 4 × layers × heads × head_dim per pair)."""
    chunks = math.ceil(prompt_tokens / chunk)
    pairs = prompt_tokens * (prompt_tokens + 1) / 2
    flop = 2 * matrix_bytes(args, 1) * prompt_tokens + 4 * args.n_layers * args.n_heads * args.head_dim * pairs
    return {"memory_bound": prompt_tokens / (chunks * matrix_bytes(args, elem) / bandwidth),
            "compute_bound": prompt_tokens / (flop / flops)}


# -- load test ------------------------------------------------------------------------------------
def load_test(fields: dict[str, float], num_blocks: int, plan: CheckPlan, seed: int = 0) -> dict[str, Any]:
    """The design's load test in virtual time with the fitted cost model: per rate (ascending, up
    to the first that misses the SLOs), SLO attainment and percentiles; goodput at the design's
    SLOs."""
    from loadgen import stats as st
    from loadgen.sim import design_config, simulate
    from loadgen.workload import LengthMix, arrival_times, synthetic_workload

    config = design_config(num_blocks=num_blocks)
    runs = []
    for rate in plan.sim_rates:
        items = synthetic_workload(arrival_times(rate, duration_s=plan.sim_duration_s, seed=seed),
                                   LengthMix.design(), seed=seed)
        res = simulate(items, config, SimExecutor.from_json(fields))
        s = st.summarize(res.records, rate=rate)
        runs.append({**{k: s[k] for k in ("rate", "num_requests", "num_completed", "num_rejected_429",
                                          "ttft_ms", "tpot_ms")},
                     "slo_attainment": s["slo"]["attainment"]})
        if (s["slo"]["attainment"] or 0.0) < st.GOODPUT_QUANTILE:
            break                          # goodput cannot reach a higher rate: stop here
    points = [(r["rate"], r["slo_attainment"]) for r in runs]
    return {"slo_ttft_ms": st.DEFAULT_SLO_TTFT_MS, "slo_tpot_ms": st.DEFAULT_SLO_TPOT_MS,
            "quantile": st.GOODPUT_QUANTILE, "duration_s": plan.sim_duration_s, "num_blocks": num_blocks,
            "engine": {"max_rows": config.max_rows, "prefill_token_budget": config.prefill_token_budget},
            "runs": runs, "goodput_rps": st.goodput(points)}


# -- the run --------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    """What ran: versions, device name and memory."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": str(device), "host": platform.node(), "cpus": os.cpu_count(),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_bytes=props.total_memory,
                   capability=f"{props.major}.{props.minor}")
    return env


def graphs_supported() -> bool:
    """Whether this ModelRunner takes `cuda_graphs`."""
    return "cuda_graphs" in inspect.signature(ModelRunner).parameters


def device_check(plan: CheckPlan, device: torch.device, *, pytest_files: bool = False,
                 graphs: bool = True, out: pathlib.Path | None = None, log=print) -> dict[str, Any]:
    """Run every step of the module docstring; returns the JSON-ready result, also written to
    `out` after every stage (a run cut short keeps what it measured)."""
    t_start = time.perf_counter()
    result: dict[str, Any] = {"plan": dataclasses.asdict(plan), "environment": environment(device),
                              "complete": False}

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    log(f"device check on {result['environment'].get('device_name', device)}: {plan.model} {plan.dtype}")
    result["reference"] = check_reference(device, plan)
    log(f"  dense fp32 reference: {result['reference']['agree']}/{result['reference']['tokens']} greedy "
        "tokens agree")
    result["kv_int8"] = check_int8_cache(device, plan)
    log(f"  8-bit KV cache ({result['kv_int8']['backend']}): {result['kv_int8']['agree_with_model_dtype']}/"
        f"{result['kv_int8']['tokens']} greedy tokens as with the {plan.dtype} cache; batch invariance "
        f"{'holds' if result['kv_int8']['invariance'] else 'BROKEN'}")
    save()
    if pytest_files:
        result["pytest"] = run_pytest(device)
        log(f"  pytest on {device.type}: {result['pytest']}")
        save()

    dtype = getattr(torch, plan.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    args, state, _ = load_weights(parse_model_source(plan.model), dtype, device)
    model: Transformer = model_from_weights(args, state, dtype, device)
    state.clear()
    sync(device)
    load_s = time.perf_counter() - t0
    weights_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else matrix_bytes(args, elem)
    config = EngineConfig(device=device.type, dtype=plan.dtype, activation_reserve_bytes=plan.activation_reserve_bytes)
    num_blocks = kv_pool_blocks(config, args, dtype, device) if device.type == "cuda" else 2048
    kv = KVCache(args, num_blocks, 16, dtype, device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    result["model"] = {"shape": dataclasses.asdict(args), "load_s": round(load_s, 2),
                       "weights_bytes": weights_bytes, "kv_blocks": num_blocks,
                       "kv_tokens": num_blocks * 16, "kv_bytes": sum(t.nbytes for t in kv.layers)}
    log(f"  weights {weights_bytes / 1e9:.2f} GB in {load_s:.1f} s; KV pool {num_blocks} blocks "
        f"({num_blocks * 16} tokens)")
    save()

    variants = {"eager": False}
    if graphs and device.type == "cuda" and graphs_supported():
        variants["cuda_graphs"] = True
    result["variants"] = {}
    all_samples: list[dict[str, float]] = []
    for name, use_graphs in variants.items():
        kw = {"cuda_graphs": True} if use_graphs else {}
        executor = SyncedExecutor(ModelRunner(model, kv, **kw))
        measured: dict[str, Any] = {}
        if name == "eager":
            measured["prefill"] = measure_prefill(executor, num_blocks, plan, args.vocab_size)
        measured["decode"] = measure_decode(executor, num_blocks, plan, args.vocab_size)
        measured["invariance"] = invariance(executor, num_blocks, plan)
        if name == "eager":
            all_samples = list(executor.samples)
        measured["attention_backend"] = getattr(getattr(executor.inner, "attention", None), "name", None)
        result["variants"][name] = measured
        if device.type == "cuda":
            result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            # above the weights and the KV pool: what the activation reserve must cover
            result["activation_peak_bytes"] = result["peak_memory_bytes"] - resident
        save()
        log(f"  {name}: decode " + ", ".join(f"{r} rows {d['step_ms']:.2f} ms"
                                             for r, d in measured["decode"].items())
            + f"; batch invariance {'holds' if measured['invariance']['identical'] else 'BROKEN'}")
    fields, quality = fit_step_model(all_samples)      # the simulator's cost fields, the project's fit
    result["cost_model"] = {"sim_executor": fields, "fit": quality, "num_samples": len(all_samples)}
    result["comparison"] = comparison(result, args, elem, plan)
    save()
    result["load_test"] = load_test(fields, num_blocks, plan)
    result["complete"] = True
    save()
    return result


def invariance(executor: SyncedExecutor, num_blocks: int, plan: CheckPlan) -> dict[str, Any]:
    """Greedy alone = in a batch of mixed lengths (`engine.runner.invariance.check_batch_invariance`)."""
    from engine.runner.invariance import check_batch_invariance

    engine = engine_over(executor, num_blocks, 16, max_rows=max(32, plan.invariance_batch))
    res = check_batch_invariance(engine, batch=plan.invariance_batch, max_tokens=plan.invariance_tokens,
                                 checked=plan.invariance_checked)
    return dataclasses.asdict(res)


def comparison(result: dict[str, Any], args: ModelArgs, elem: int, plan: CheckPlan) -> list[dict[str, Any]]:
    """Each figure beside the design's assumption and the physical limit (module docstring)."""
    rows = []
    for chunk, m in result["variants"]["eager"]["prefill"].items():
        limit = prefill_limit_tokens_per_s(args, elem, int(chunk), plan.prefill_prompt)
        rows.append({"figure": f"prefill tokens/s, chunk {chunk}", "measured": m["tokens_per_s"],
                     "design": DESIGN_PREFILL_TOKENS_PER_S, "limit": min(limit.values()),
                     "limit_detail": limit})
    for name, variant in result["variants"].items():
        for r, d in variant["decode"].items():
            rows.append({"figure": f"decode step ms, {r} rows ({name})", "measured": d["step_ms"],
                         "design": DESIGN_DECODE_MS.get(int(r)),
                         "limit": decode_limit_ms(args, elem, int(r), d["mean_context"])})
    return rows


def table(result: dict[str, Any]) -> str:
    """The comparison as text."""
    lines = [f"{'figure':<42} {'measured':>12} {'design':>10} {'H200 limit':>12}"]
    for row in result["comparison"]:
        design = "" if row["design"] is None else f"{row['design']:,.1f}"
        lines.append(f"{row['figure']:<42} {row['measured']:>12,.2f} {design:>10} {row['limit']:>12,.2f}")
    lt = result["load_test"]
    lines.append(f"goodput (simulated, design load test, fitted costs, {lt['num_blocks']} blocks): "
                 f"{lt['goodput_rps']} req/s")
    if "peak_memory_bytes" in result:
        lines.append(f"peak memory: {result['peak_memory_bytes'] / 1e9:.1f} GB, of which "
                     f"{result['activation_peak_bytes'] / 1e9:.2f} GB above the weights and the KV pool")
    return "\n".join(lines)


def default_out() -> pathlib.Path:
    """$OUT/device_check.json when $OUT is set, else device_check.json here."""
    return pathlib.Path(os.environ.get("OUT") or ".") / "device_check.json"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0 when the run finished and the checks held, 1 when a check failed."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (the CI run)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="default: cpu with --dry-run, else auto (CUDA when visible)")
    p.add_argument("--model", default=None, help="override the plan's model (a --model value)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="the JSON file (default: $OUT/device_check.json)")
    p.add_argument("--pytest", action="store_true", help="also run the engine's pytest files on the device")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph variant")
    p.add_argument("--sim-duration", type=float, default=None, help="virtual seconds per load-test rate")
    args = p.parse_args(argv)
    plan = DRY if args.dry_run else FULL
    if args.model:
        plan = dataclasses.replace(plan, model=args.model)
    if args.sim_duration:
        plan = dataclasses.replace(plan, sim_duration_s=args.sim_duration)
    device = resolve_device(args.device or ("cpu" if args.dry_run else "auto"))
    if device.type == "cpu" and not args.dry_run:
        print("no CUDA device: running the CPU dry run's shapes instead (give --dry-run to say so)",
              file=sys.stderr)
        plan = DRY if not args.model else dataclasses.replace(DRY, model=args.model)
    out = args.out or default_out()
    result = device_check(plan, device, pytest_files=args.pytest, graphs=not args.no_graphs, out=out)
    print(table(result))
    print(f"wrote {out}")
    ok = result["reference"]["identical"] and all(v["invariance"]["identical"]
                                                  for v in result["variants"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
