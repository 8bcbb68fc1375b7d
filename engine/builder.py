"""Assemble an engine from a model file: weights, tokenizer, KV cache, pool, executor, loop."""

from __future__ import annotations

import logging
import os
import pathlib
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.executor import ModelExecutor
from engine.kv_cache import KVCache
from engine.loop import Engine
from engine.model.llama import ModelArgs, Transformer
from engine.model.weights import default_gguf_path, load_gguf, open_gguf
from engine.request import Request, SamplingParams
from engine.scheduler import CostModel
from engine.tokenizer import Tokenizer
from genserve.model_name import DEFAULT_MODEL_NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedEngine:
    """An engine ready to start, with what the service needs to talk about it."""

    engine: Engine
    tokenizer: Tokenizer
    args: ModelArgs
    model_name: str


def set_threads(config: EngineConfig) -> int:
    """Set torch's intra-op threads to `config.num_threads`, or to the usable cores when 0.

    Logs a warning when OpenMP pins its threads (`threads_bound`): the service's event loop and
    the bridge run on the same cores, and a pinned engine thread cannot move away from them while
    they run. 32 live streams on the 2-core dev machine, A/B in one run: 1,010–1,050 tokens/s
    with OMP_PROC_BIND=true against 1,415–1,490 without.
    """
    n = config.num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    bound = threads_bound(os.environ)
    if bound:
        log.warning("%s pins the engine's threads to cores the bridge and the event loop share; "
                    "unset it (live throughput ≈ 30 %% lower with it on 2 cores)", bound)
    return n


def threads_bound(env: Mapping[str, str]) -> str | None:
    """The setting that makes OpenMP (libgomp) bind threads to places, as "NAME=value", or None.

    libgomp binds when OMP_PROC_BIND is set to anything but "false", and, when OMP_PROC_BIND is
    unset, when OMP_PLACES or GOMP_CPU_AFFINITY is set (libgomp manual, "OMP_PROC_BIND").
    """
    bind = env.get("OMP_PROC_BIND", "").strip()
    if bind:
        return None if bind.lower() == "false" else f"OMP_PROC_BIND={bind}"
    for name in ("OMP_PLACES", "GOMP_CPU_AFFINITY"):
        if env.get(name, "").strip():
            return f"{name}={env[name].strip()}"
    return None


def build_engine(config: EngineConfig, gguf_path: str | pathlib.Path | None = None,
                 model_name: str = DEFAULT_MODEL_NAME, calibrate: bool = True) -> LoadedEngine:
    """Load the GGUF model (the embedded SmolLM2 by default) and build a stopped engine.

    The pool holds `config.num_blocks` blocks, or as many as `config.kv_pool_bytes` allows.
    With `calibrate`, a short warm-up measures the per-token costs admission control uses.
    Raises FileNotFoundError when the model file is missing.
    """
    set_threads(config)
    path = pathlib.Path(gguf_path) if gguf_path else default_gguf_path()
    reader = open_gguf(path)          # parse the header (≈ 100k tokenizer strings) once
    args, state = load_gguf(reader)
    engine = engine_from_weights(config, args, state)
    del state
    tokenizer = Tokenizer.from_gguf(reader)
    if calibrate:
        engine.scheduler.cost = measure_costs(engine)
        engine.executor.cost_model = engine.scheduler.cost
        engine.calibrate_costs = True
    return LoadedEngine(engine, tokenizer, args, model_name)


def engine_from_weights(config: EngineConfig, args: ModelArgs,
                        state: dict[str, torch.Tensor]) -> Engine:
    """A stopped engine over `state` (loader names) in `config.dtype`, KV pool sized by config."""
    dtype = getattr(torch, config.dtype)
    model = Transformer.from_state_dict(args, state, dtype)
    num_blocks = config.num_blocks or KVCache.num_blocks_for_budget(
        args, config.block_size, dtype, config.kv_pool_bytes)
    kv = KVCache(args, num_blocks, config.block_size, dtype)
    return Engine(config, ModelExecutor(model, kv), BlockPool(num_blocks, config.block_size))


def measure_costs(engine: Engine, rows: int = 32, prompt_len: int = 16,
                  new_tokens: int = 8) -> CostModel:
    """Warm up and measure per-token device costs on the stopped engine (ms per token).

    Runs `rows` requests (at most the row cap) of `prompt_len` tokens generating `new_tokens`
    each: prefill cost is prefill step time / prompt tokens in it; decode cost is the median time
    of the fullest pure-decode steps / their rows (docs/design.md's 40 ms / 32 rows = 1.25 ms per
    output token, measured here). The fullest steps may hold fewer than `rows` rows when the pool
    is too small for all of them at once.
    """
    rows = min(rows, engine.config.max_rows)
    engine.submit(Request("warmup-first", "warmup", list(range(10, 10 + prompt_len)), 2,
                          SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
    engine.run_until_idle()                       # first passes allocate and pick kernels
    steps: list[tuple[int, int, float]] = []
    engine.step_listeners.append(
        lambda plan, ev, s: steps.append((plan.num_decode_rows, plan.num_prefill_tokens, s)))
    for i in range(rows):
        engine.submit(Request(f"warmup-{i}", "warmup", [(7 * i + j) % 1000 + 10 for j in range(prompt_len)],
                              new_tokens, SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
    engine.run_until_idle()
    engine.step_listeners.pop()
    engine.scheduler.usage.pop("warmup", None)
    engine.pool.check_all_free()
    prefill = [s / c for b, c, s in steps if c and not b]
    fullest = max(b for b, c, _ in steps if not c)
    decode = [s / b for b, c, s in steps if b == fullest and not c]
    return CostModel(prefill_ms_per_token=1000 * statistics.median(prefill),
                     decode_ms_per_token=1000 * statistics.median(decode))
