"""Mixture-of-experts decode speed at Qwen3-30B-A3B's layer shape, random weights, on the CPU.

Run from the repository root, one mode per run (docs/benchmarks/moe.md has the runs and figures)::

    python -m benchmarks.moe step    [--layers 4] [--vocab 8192] [--rows 1,32] [--steps 60] [--json PATH]
    python -m benchmarks.moe experts [--layers 4] [--rows 32] [--distinct 8,16,32,64,128] [--steps 16]
                                     [--plot docs/benchmarks/moe_experts.png] [--json PATH]
    python -m benchmarks.moe gguf    [--layers 2] [--out /tmp/moe/f16.gguf] [--quantized /tmp/moe/q4km.gguf]
                                     [--peer-args '--rounds 2 --streams 1,32 --tokens 64 --json ...']

The shape (`Shape`, Qwen3-30B-A3B's `config.json`): width 2,048; attention of 32 query heads and 4
KV heads of 128 with per-head q/k RMSNorm; 128 SwiGLU experts of width 768, the top 8 of a softmax
router kept and renormalized; RMSNorm ε 1e-6, RoPE θ 1,000,000. Fewer layers than its 48, a small
vocabulary in the in-process modes, weights N(0, 0.02) (`engine.model.weights.random_weights`);
speed does not depend on the values.

* ``step``: the MoE model and its **dense twin** (`dense_twin`: the same attention, a dense SwiGLU
  MLP of top_k · expert width = 6,144, the width a token's experts add up to, so the two read the
  same bytes per token but the router's) as bf16 engines (`engine_from_model`, the path `genserve
  serve` runs for such a model: genserve's CPU kernel path, `KernelLayerOps` and the
  "cpu-kernels" decode attention at head_dim 128; before 2026-12-07 torch ops and SDPA). Each engine gets the same `rows` greedy requests of `--prompt-len`
  random token ids, prefills them, and then the engines take one decode step each in turn
  (`decode_in_turn`, as `benchmarks.q4` does, so load from other processes weighs on both); a
  short run first warms both up. Counted: pure-decode steps at `rows` rows, the executor's time
  (`Engine.step_listeners`: forward, logits, sampling); printed: medians and MoE / dense. Target
  (the issue): ≤ 1.3× at 1 row. At 32 rows the router, left alone, touches most of the 128
  experts per layer; that ratio is printed too (no target).
* ``experts``: `--rows` (32) row decode steps of the MoE engine with the router **steered**
  (`Steering`): the router product still runs, then each row's k expert ids are replaced by k of a
  pool of N experts drawn at random per layer and step (row r takes pool[(r·k + j) mod N], j < k),
  so every layer touches exactly N distinct experts and every expert of the pool takes r·k / N
  rows; the expert products themselves are the engine's own. N from `--distinct`, the engines
  (steered MoE, unsteered MoE, dense twin) stepping in turn per N. Printed and plotted (`--plot`):
  median step time against N, a least-squares line, and the implied read rate (layers × bytes per
  expert / slope) next to the host's `read_gbps`. Expected: linear in N, each chosen expert read
  once per step.
* ``gguf``: a qwen3moe GGUF of the shape, `--layers` (2) layers, written tensor by tensor in F16
  as llama.cpp's converter writes Qwen3-30B-A3B (`write_gguf`; router `ffn_gate_inp` in F32,
  experts stacked as `ffn_{gate,up,down}_exps` [experts, out, in], an untied `output.weight`),
  with the embedded SmolLM2 GGUF's tokenizer (49,152 tokens: the same vocabulary substitution as
  `benchmarks.llama_q4km`); then llama.cpp's own `llama-quantize` makes it Q4_K_M, and with
  `--peer-args` `benchmarks.peer --model <Q4_K_M file> <peer args>` compares genserve
  (`--weights auto`) and llama.cpp's server on it.

Other processes on the machine distort the figures: the load average is printed and recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks._measure import read_gbps, step_in_turn, submit_random_prompts
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request
from engine.model.config import ModelArgs, MoEArgs
from engine.model.mlp import MoEFeedForward
from engine.model.transformer import Transformer
from engine.model.weights import random_weights
from engine.runner.builder import engine_from_model, model_from_weights, set_threads

DTYPE = torch.bfloat16
STD = 0.02


@dataclass(frozen=True, slots=True)
class Shape:
    """One MoE layer's shape (defaults: Qwen3-30B-A3B's `config.json`) and the model's context.

    Attributes:
        hidden: model width; heads, kv_heads, head_dim: attention (q/k RMSNorm on);
        experts, top_k, expert_ffn: the MoE MLP; dense_ffn: the dense twin's MLP width, top_k ·
        expert_ffn (Qwen3-30B-A3B's `intermediate_size` is this too); theta, eps: RoPE base,
        RMSNorm ε; context: positions (the GGUF's context length; in-process engines use
        `IN_PROCESS_CONTEXT`).
    """

    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    expert_ffn: int = 768
    theta: float = 1_000_000.0
    eps: float = 1e-6
    context: int = 40960

    @property
    def dense_ffn(self) -> int:
        return self.top_k * self.expert_ffn

    @property
    def expert_params(self) -> int:
        """Weights of one expert (gate, up, down)."""
        return 3 * self.expert_ffn * self.hidden

    @property
    def attention_params(self) -> int:
        """Weights of one layer's attention products (Q, K, V, O)."""
        return 2 * (self.heads + self.kv_heads) * self.head_dim * self.hidden


QWEN3_30B_A3B = Shape()
# seconds-scale stand-in with the same structure (the tests)
TOY = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=16, top_k=4, expert_ffn=32,
            context=512)
IN_PROCESS_CONTEXT = 4096


def moe_args(shape: Shape, layers: int, vocab: int, context: int = IN_PROCESS_CONTEXT) -> ModelArgs:
    """A Qwen3-MoE `ModelArgs` of `shape` with `layers` layers, every one sparse."""
    return ModelArgs(dim=shape.hidden, n_layers=layers, n_heads=shape.heads, n_kv_heads=shape.kv_heads,
                     intermediate_size=shape.dense_ffn, vocab_size=vocab, max_context=context,
                     rope_theta=shape.theta, norm_eps=shape.eps, architecture="Qwen3MoeForCausalLM",
                     head_dim=shape.head_dim, qk_norm=True,
                     moe=MoEArgs(n_experts=shape.experts, top_k=shape.top_k, expert_size=shape.expert_ffn,
                                 norm_topk_prob=True, sparse_layers=(True,) * layers))


def dense_twin(args: ModelArgs) -> ModelArgs:
    """`args` with every MLP dense, of width top_k · expert size (the active parameter count;
    the attention unchanged): Qwen3 (dense)."""
    assert args.moe is not None
    return args.replace(moe=None, intermediate_size=args.moe.top_k * args.moe.expert_size,
                        architecture="Qwen3ForCausalLM")


def step_bytes(args: ModelArgs, experts_per_layer: float) -> int:
    """Weight bytes a decode step reads once in bf16: each layer's attention products and MLP
    (`experts_per_layer` experts and the fp32 router in a MoE layer, the dense MLP otherwise),
    and the output projection."""
    hd, dim = args.head_dim, args.dim
    attention = 2 * (args.n_heads + args.n_kv_heads) * hd * dim
    if args.moe is not None:
        mlp = experts_per_layer * 3 * args.moe.expert_size * dim * 2 + args.moe.n_experts * dim * 4
    else:
        mlp = 3 * args.intermediate_size * dim * 2
    return int(args.n_layers * (attention * 2 + mlp) + args.vocab_size * dim * 2)


def build_model(args: ModelArgs, seed: int) -> Transformer:
    """The bf16 network over `random_weights(args)` (packed as the engine packs it)."""
    return model_from_weights(args, random_weights(args, DTYPE, seed=seed, std=STD), DTYPE)


def build_engine(model: Transformer, rows: int, prompt_len: int, steps: int) -> Engine:
    """A stopped engine over `model` (`engine_from_model`), KV pool for `rows` rows of
    `prompt_len` + `steps` + a margin, a run of warm-up and one of counted steps."""
    per_row = -(-(prompt_len + 2 * steps + 64) // 16)
    config = EngineConfig(num_blocks=max(64, rows * per_row * 2), max_rows=max(rows, 1), device="cpu",
                          weights="bf16")
    return engine_from_model(config, model)


# -- timing ---------------------------------------------------------------------------------------
def submit(engine: Engine, rows: int, prompt_len: int, max_tokens: int, tag: str) -> list[Request]:
    """`rows` greedy `ignore_eos` requests of `prompt_len` random token ids (seeded by `tag`, so a
    new tag is a new prompt: no prefix-cache hit), `max_tokens` each, submitted."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rows}".encode()))
    return submit_random_prompts(engine, rows, prompt_len, max_tokens, f"moe-{tag}-{rows}", g)


def decode_in_turn(engines: dict[str, Engine], rows: int, steps: int, prompt_len: int, tag: str,
                   before_step: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Per engine, the executor's seconds of each pure-decode step at `rows` rows: each engine
    gets the same `rows` requests (`submit`) and prefills them, then the engines take one step
    each in turn, `steps` times, and run to the end (`benchmarks._measure.step_in_turn`).
    `before_step(name)` is called before each of engine `name`'s steps until the counted phase ends."""
    return step_in_turn(engines, rows, steps,
                        lambda name, engine: submit(engine, rows, prompt_len, steps + 4, f"{tag}-{name}"),
                        before_step=before_step)


def quartiles_ms(ts: Sequence[float]) -> dict[str, float]:
    """Median and quartiles of `ts` seconds, in ms, and the count."""
    q = np.percentile(np.asarray(ts) * 1e3, [25, 50, 75])
    return {"p25": float(q[0]), "median": float(q[1]), "p75": float(q[2]), "n": len(ts)}


# -- steering the router --------------------------------------------------------------------------
def pooled_ids(n_rows: int, top_k: int, pool: torch.Tensor) -> torch.Tensor:
    """int64 [n_rows, top_k]: row r takes pool[(r·top_k + j) mod len(pool)], j < top_k — k
    distinct experts per row (top_k ≤ len(pool)), every pool expert taken by about
    n_rows·top_k / len(pool) rows, and exactly min(len(pool), n_rows·top_k) distinct in all."""
    n = len(pool)
    if top_k > n:
        raise ValueError(f"a pool of {n} experts cannot give {top_k} distinct per row")
    slots = torch.arange(n_rows)[:, None] * top_k + torch.arange(top_k)[None, :]
    return pool[slots % n]


class Steering:
    """Wraps every MoE layer's `route` of a model: the router's own product and top-k run as
    always, then, while `distinct` is set, each row's ids are replaced by `pooled_ids` over a
    pool of `distinct` experts drawn at random (`randperm`, seeded) for each call, i.e. per layer
    and step; the routing weights stay the router's. With `distinct` None the ids are the
    router's. Every call's distinct expert count is appended to `seen` (with its row count)."""

    def __init__(self, model: Transformer, seed: int = 0) -> None:
        self.layers = model.moe_layers
        self.distinct: int | None = None
        self.generator = torch.Generator().manual_seed(seed)
        self.seen: list[tuple[int, int]] = []            # (rows, distinct experts) per call
        for moe in self.layers:
            moe.route = self._wrap(moe, moe.route)       # an instance attribute over the method

    def _wrap(self, moe: MoEFeedForward, route):
        def steered(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = route(x)
            if self.distinct is not None:
                pool = torch.randperm(len(moe.experts), generator=self.generator)[:self.distinct]
                ids = pooled_ids(ids.shape[0], ids.shape[1], pool).to(ids.device)
            self.seen.append((ids.shape[0], int(ids.unique().numel())))
            return weights, ids
        return steered

    def remove(self) -> None:
        for moe in self.layers:
            del moe.route


# -- modes ----------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _header(opts: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]
    print(f"# load average {load:.2f} on {os.cpu_count()} CPUs (others' load distorts the figures); "
          f"torch threads {torch.get_num_threads()}", flush=True)
    return {"mode": opts.mode, "load_average_start": load, "threads": torch.get_num_threads(),
            "layers": opts.layers, "vocab": opts.vocab, "shape": dataclasses.asdict(opts.shape_obj),
            "prompt_len": opts.prompt_len, "steps": opts.steps, "commit": _commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run_step(opts: argparse.Namespace) -> dict:
    """`step` mode (module docstring): MoE and dense twin, decode steps at each of `--rows`."""
    result = _header(opts)
    args = moe_args(opts.shape_obj, opts.layers, opts.vocab)
    t0 = time.perf_counter()
    models = {"moe": build_model(args, opts.seed), "dense": build_model(dense_twin(args), opts.seed)}
    log(f"# models built in {time.perf_counter() - t0:.0f} s")
    rows_list = opts.rows
    engines = {name: build_engine(m, max(rows_list), opts.prompt_len, opts.steps) for name, m in models.items()}
    steering = Steering(models["moe"])                   # routes untouched; counts distinct experts
    decode_in_turn(engines, max(rows_list), opts.warmup, opts.prompt_len, "warm")
    result["bytes_per_step_1_row"] = {"moe": step_bytes(args, args.moe.top_k),
                                      "dense": step_bytes(dense_twin(args), 0)}
    result["rows"] = {}
    print(f"{'rows':>4} {'moe ms':>9} {'dense ms':>9} {'moe/dense':>9} {'experts/layer':>13}")
    for rows in rows_list:
        steering.seen.clear()
        times = decode_in_turn(engines, rows, opts.steps, opts.prompt_len, "run")
        med = {name: quartiles_ms(ts) for name, ts in times.items()}
        decode_calls = [d for r, d in steering.seen if r == rows]
        touched = statistics.mean(decode_calls) if decode_calls else float("nan")
        ratio = med["moe"]["median"] / med["dense"]["median"]
        result["rows"][str(rows)] = {"ms": med, "ratio": ratio, "distinct_experts_per_layer": touched,
                                     "moe_bytes": step_bytes(args, touched)}
        print(f"{rows:>4} {med['moe']['median']:>9.2f} {med['dense']['median']:>9.2f} {ratio:>8.2f}x "
              f"{touched:>13.1f}", flush=True)
    steering.remove()
    if "1" in result["rows"]:
        r = result["rows"]["1"]["ratio"]
        print(f"1 row: MoE / dense twin {r:.2f}x (target <= 1.3x: {'met' if r <= 1.3 else 'missed'})")
    return result


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least squares y = intercept + slope·x, and R²."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    slope, intercept = np.polyfit(x, y, 1)
    pred = intercept + slope * x
    ss = float(((y - y.mean()) ** 2).sum())
    return {"slope": float(slope), "intercept": float(intercept),
            "r2": 1.0 - float(((y - pred) ** 2).sum()) / ss if ss else 1.0}


def run_experts(opts: argparse.Namespace) -> dict:
    """`experts` mode (module docstring): steered 32-row steps against distinct experts."""
    result = _header(opts)
    shape = opts.shape_obj
    rows = opts.rows[0]
    for n in opts.distinct:
        if not shape.top_k <= n <= min(shape.experts, rows * shape.top_k):
            raise SystemExit(f"--distinct {n}: needs top_k ({shape.top_k}) <= N <= "
                             f"min(experts, rows·top_k) = {min(shape.experts, rows * shape.top_k)}")
    args = moe_args(shape, opts.layers, opts.vocab)
    t0 = time.perf_counter()
    moe = build_model(args, opts.seed)
    dense = build_model(dense_twin(args), opts.seed)
    log(f"# models built in {time.perf_counter() - t0:.0f} s")
    engines = {"moe": build_engine(moe, rows, opts.prompt_len, opts.steps),
               "dense": build_engine(dense, rows, opts.prompt_len, opts.steps)}
    steering = Steering(moe, seed=opts.seed)
    decode_in_turn(engines, rows, opts.warmup, opts.prompt_len, "warm")
    result["read_gbps"] = read_gbps(256, 5)
    result["rows_per_step"] = rows
    result["expert_mb"] = shape.expert_params * 2 / 1e6
    points: dict[str, dict] = {}
    dense_ms: list[float] = []
    print(f"{'N':>5} {'moe ms':>9} {'p25-p75':>15} {'dense ms':>9} {'distinct seen':>13}")
    for n in [*opts.distinct, None]:
        steering.distinct = n
        steering.seen.clear()
        times = decode_in_turn(engines, rows, opts.steps, opts.prompt_len, f"n{n}")
        seen = sorted({d for r, d in steering.seen if r == rows})
        q = quartiles_ms(times["moe"])
        dense_ms += times["dense"]
        key = str(n) if n is not None else "router"
        touched = statistics.mean(d for r, d in steering.seen if r == rows)
        points[key] = {"ms": q, "distinct_seen": seen, "distinct_mean": touched,
                       "dense_ms": quartiles_ms(times["dense"])}
        if n is not None and seen != [n]:
            raise AssertionError(f"steered to {n} experts per layer, saw {seen}")
        print(f"{key:>5} {q['median']:>9.2f} {q['p25']:>7.2f}-{q['p75']:<7.2f} "
              f"{points[key]['dense_ms']['median']:>9.2f} {touched:>13.1f}", flush=True)
    steering.remove()
    fit = line_fit(opts.distinct, [points[str(n)]["ms"]["median"] for n in opts.distinct])
    # slope: ms per distinct expert per layer; a step reads `layers` of them per unit of N
    fit["implied_gbps"] = (opts.layers * result["expert_mb"] / 1e3) / (fit["slope"] / 1e3) if fit["slope"] > 0 else float("nan")
    result.update(points=points, fit=fit, dense_32_rows=quartiles_ms(dense_ms))
    print(f"fit: {fit['intercept']:.1f} ms + {fit['slope']:.3f} ms per distinct expert per layer "
          f"(R² {fit['r2']:.4f}); {opts.layers} × {result['expert_mb']:.2f} MB per unit of N → "
          f"{fit['implied_gbps']:.1f} GB/s against read_gbps {result['read_gbps']:.1f} GB/s")
    if opts.plot:
        plot_experts(result, opts.plot)
        print(f"plot: {opts.plot}")
    return result


def plot_experts(result: dict, path: pathlib.Path) -> None:
    """Median step time (quartile bars) against distinct experts per layer, the line fit, the
    router's own choice and the dense twin's 32-row step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = {k: v for k, v in result["points"].items() if k != "router"}
    xs = [int(k) for k in pts]
    med = [v["ms"]["median"] for v in pts.values()]
    lo = [v["ms"]["median"] - v["ms"]["p25"] for v in pts.values()]
    hi = [v["ms"]["p75"] - v["ms"]["median"] for v in pts.values()]
    fit = result["fit"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.errorbar(xs, med, yerr=[lo, hi], fmt="o", capsize=3, label="MoE, router steered (median, quartiles)")
    grid = np.linspace(0, max(xs) * 1.05, 50)
    ax.plot(grid, fit["intercept"] + fit["slope"] * grid, "--",
            label=f"fit {fit['intercept']:.1f} ms + {fit['slope']:.2f} ms·N (R² {fit['r2']:.3f})")
    router = result["points"].get("router")
    if router:
        ax.plot([router["distinct_mean"]], [router["ms"]["median"]], "s",
                label=f"MoE, router's own choice ({router['distinct_mean']:.0f} experts)")
    ax.axhline(result["dense_32_rows"]["median"], color="grey", lw=1,
               label="dense twin (active width), same rows")
    s = result["shape"]
    ax.set_xlabel("distinct experts per layer in the step (N)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"{result['rows_per_step']}-row decode step, {result['layers']} layers of "
                 f"{s['experts']} experts (top {s['top_k']}, width {s['expert_ffn']}), bf16, "
                 f"{result['threads']} thread(s), {result['date']}", fontsize=9)
    ax.set_xlim(0, None)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the GGUF -------------------------------------------------------------------------------------
ARCH = "qwen3moe"


def tensor_plan(shape: Shape, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) in llama.cpp's file order for a qwen3moe model; kind is 'norm'
    (F32 ones), 'router' (F32) or 'matrix' (F16)."""
    h, hd, e, f = shape.hidden, shape.head_dim, shape.experts, shape.expert_ffn
    q, kv = shape.heads * hd, shape.kv_heads * hd
    plan = [("token_embd.weight", (vocab, h), "matrix")]
    for i in range(layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), "norm"),
                 (b + "attn_q.weight", (q, h), "matrix"),
                 (b + "attn_k.weight", (kv, h), "matrix"),
                 (b + "attn_v.weight", (kv, h), "matrix"),
                 (b + "attn_output.weight", (h, q), "matrix"),
                 (b + "attn_q_norm.weight", (hd,), "norm"),
                 (b + "attn_k_norm.weight", (hd,), "norm"),
                 (b + "ffn_norm.weight", (h,), "norm"),
                 (b + "ffn_gate_inp.weight", (e, h), "router"),
                 (b + "ffn_gate_exps.weight", (e, f, h), "matrix"),
                 (b + "ffn_up_exps.weight", (e, f, h), "matrix"),
                 (b + "ffn_down_exps.weight", (e, h, f), "matrix")]
    plan += [("output_norm.weight", (h,), "norm"), ("output.weight", (vocab, h), "matrix")]
    return plan


def tensor_data(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "norm":
        return np.ones(shape, dtype=np.float32)
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= STD
    return w if kind == "router" else w.astype(np.float16)


def write_gguf(out: pathlib.Path, shape: Shape, layers: int, tokenizer_source: pathlib.Path,
               seed: int = 0, progress: bool = True) -> pathlib.Path:
    """A qwen3moe F16 GGUF of `shape` and `layers` layers at `out`, random weights, the
    tokenizer metadata of `tokenizer_source`; tensors generated and written one at a time."""
    import gguf

    from benchmarks.llama_q4km import tokenizer_fields

    fields = tokenizer_fields(tokenizer_source)
    vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_name("Qwen3-30B-A3B-shape random (genserve benchmark)")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(shape.dense_ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.theta)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.top_k)
    w.add_expert_feed_forward_length(shape.expert_ffn)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub)
    plan = tensor_plan(shape, layers, vocab)
    for name, dims, kind in plan:
        dtype = np.dtype(np.float16 if kind == "matrix" else np.float32)
        w.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for n, (name, dims, kind) in enumerate(plan):
        w.write_tensor_data(tensor_data(dims, kind, rng))
        if progress and name.endswith("exps.weight"):
            log(f"  {name} ({n + 1}/{len(plan)})")
    w.close()
    return out


def llama_binary(name: str, llama_server: pathlib.Path | None = None) -> pathlib.Path:
    """llama.cpp's `name` beside `llama_server` (default: `benchmarks.peer.default_llama_server`)."""
    from benchmarks.peer import INSTALL_SCRIPT, default_llama_server

    server = llama_server or default_llama_server()
    if server is None or not (server.parent / name).exists():
        raise SystemExit(f"llama.cpp's {name} not found (install it with {INSTALL_SCRIPT}, or pass --llama-server)")
    return server.parent / name


def run_gguf(opts: argparse.Namespace) -> dict:
    """`gguf` mode (module docstring): write the F16 file, quantize it with llama-quantize to
    Q4_K_M, then (with --peer-args) run benchmarks.peer on it."""
    result = {"mode": "gguf", "layers": opts.layers, "shape": dataclasses.asdict(opts.shape_obj),
              "commit": _commit()}
    tokenizer = opts.tokenizer_from
    if tokenizer is None:
        from engine.gguf_file import default_gguf_path
        tokenizer = pathlib.Path(default_gguf_path())
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    if opts.out.exists() and not opts.rewrite:
        log(f"# {opts.out} exists, kept (--rewrite writes it again)")
    else:
        t0 = time.perf_counter()
        write_gguf(opts.out, opts.shape_obj, opts.layers, tokenizer, opts.seed)
        result["write_s"] = time.perf_counter() - t0
        print(f"wrote {opts.out} ({opts.out.stat().st_size / 1e9:.2f} GB) in {result['write_s']:.0f} s", flush=True)
    result["f16_bytes"] = opts.out.stat().st_size
    if opts.quantized is None:
        return result
    if opts.quantized.exists() and not opts.rewrite:
        log(f"# {opts.quantized} exists, kept")
    else:
        quantize = llama_binary("llama-quantize", opts.llama_server)
        argv = [str(quantize), str(opts.out), str(opts.quantized), "Q4_K_M", str(opts.quantize_threads)]
        print("$ " + shlex.join(argv), flush=True)
        t0 = time.perf_counter()
        subprocess.run(argv, check=True)
        result["quantize_s"] = time.perf_counter() - t0
    result["q4km_bytes"] = opts.quantized.stat().st_size
    result["q4km_types"] = tensor_types(opts.quantized)
    for kind, (count, size) in sorted(result["q4km_types"].items()):
        print(f"  {kind:>5}: {count:>3} tensors, {size / 1e6:9.1f} MB", flush=True)
    if opts.peer_args is not None:
        from benchmarks import peer

        argv = ["--model", str(opts.quantized), *shlex.split(opts.peer_args)]
        if opts.llama_server and "--llama-server" not in argv:
            argv += ["--llama-server", str(opts.llama_server)]
        print("$ python -m benchmarks.peer " + shlex.join(argv), flush=True)
        result["peer_rc"] = peer.main(argv)
    return result


def tensor_types(path: pathlib.Path) -> dict[str, tuple[int, int]]:
    """GGML type name -> (tensors, bytes) of a GGUF."""
    import gguf

    out: dict[str, list[int]] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        entry = out.setdefault(t.tensor_type.name, [0, 0])
        entry[0] += 1
        entry[1] += int(t.n_bytes)
    return {k: (v[0], v[1]) for k, v in out.items()}


# -- command line ---------------------------------------------------------------------------------
def _commit() -> str:
    from benchmarks.peer import _commit as commit
    return commit()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("step", "experts", "gguf"))
    p.add_argument("--toy", action="store_true", help="the seconds-scale shape (TOY), for tests")
    p.add_argument("--layers", type=int, default=None, help="layers (default: 4 in process, 2 for gguf)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the in-process models")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all usable cores)")
    p.add_argument("--rows", type=_ints, default=None, help="decode rows (step: 1,32; experts: 32)")
    p.add_argument("--steps", type=int, default=None, help="counted steps per engine and setting "
                   "(step: 60, experts: 16)")
    p.add_argument("--warmup", type=int, default=4, help="decode steps of the warm-up run")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--distinct", type=_ints, default=None, help="experts: N values (default 8,16,32,64,128)")
    p.add_argument("--plot", type=pathlib.Path, default=None, help="experts: write the plot here")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the figures here")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/moe/f16.gguf"), help="gguf: F16 file")
    p.add_argument("--quantized", type=pathlib.Path, default=None,
                   help="gguf: Q4_K_M file llama-quantize writes (default: q4km.gguf beside --out; "
                   "'none' skips quantizing)")
    p.add_argument("--quantize-threads", type=int, default=2)
    p.add_argument("--rewrite", action="store_true", help="gguf: write / quantize even if the files exist")
    p.add_argument("--tokenizer-from", type=pathlib.Path, default=None,
                   help="gguf: GGUF whose tokenizer.* metadata is copied (default: the embedded SmolLM2)")
    p.add_argument("--llama-server", type=pathlib.Path, default=None,
                   help="llama.cpp's server (llama-quantize is taken beside it; default: peer's)")
    p.add_argument("--peer-args", default=None,
                   help="gguf: run benchmarks.peer --model <Q4_K_M file> with these arguments")
    return p


def resolve(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill the mode-dependent defaults."""
    opts.shape_obj = TOY if opts.toy else QWEN3_30B_A3B
    if opts.layers is None:
        opts.layers = 2 if opts.mode == "gguf" else 4
    if opts.rows is None:
        opts.rows = [1, 32] if opts.mode == "step" else [32]
    if opts.steps is None:
        opts.steps = 60 if opts.mode == "step" else 16
    if opts.distinct is None:
        top, e = opts.shape_obj.top_k, opts.shape_obj.experts
        opts.distinct = [n for n in (top, 2 * top, 4 * top, 8 * top, e) if n <= e]
        opts.distinct = sorted(set(opts.distinct))
    if opts.mode == "gguf":
        if opts.quantized is None:
            opts.quantized = opts.out.with_name("q4km.gguf")
        elif str(opts.quantized) == "none":
            opts.quantized = None
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = resolve(parser().parse_args(argv))
    set_threads(EngineConfig(num_threads=opts.threads))
    run = {"step": run_step, "experts": run_experts, "gguf": run_gguf}[opts.mode]
    result = run(opts)
    result["load_average_end"] = os.getloadavg()[0]
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"json: {opts.json}")
    return int(result.get("peer_rc", 0) or 0)


if __name__ == "__main__":
    sys.exit(main())
