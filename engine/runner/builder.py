"""Assemble an engine from a model: weights, tokenizer, KV cache, pool, executor, loop, on a device."""

from __future__ import annotations

import logging
import os
import pathlib
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.core.cost_model import CostModel
from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams
from engine.model.config import ModelArgs
from engine.model.transformer import Transformer
from engine.model.int8_weights import attach_int8
from engine.model.gguf_blocks import attach_q4q8
from engine.model.quant import attach_q4
from engine.runner.int8_calibration import calibration_config, calibration_tokens, run_calibration
from engine.gguf_file import open_gguf
from engine.model.weights import load_gguf, load_safetensors, random_shape, random_weights
from engine.runner.kv_cache import KVCache, device_pool_size, kv_groups, model_pool_size
from engine.runner.model_runner import ModelRunner
from engine.tokenizer import ByteTokenizer, Tokenizer
from genserve.common.model_source import ModelSource, parse_model_source

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedEngine:
    """An engine ready to start, with what the service needs to talk about it.

    Attributes:
        engine: the stopped engine.
        tokenizer: the model's tokenizer.
        args: the model's shape.
        model_name: the name the service reports.
        source: the `--model` it was loaded from (None when built otherwise, e.g. in tests).
    """

    engine: Engine
    tokenizer: Tokenizer | ByteTokenizer
    args: ModelArgs
    model_name: str
    source: ModelSource | None = None


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


def resolve_device(name: str) -> torch.device:
    """The torch device of `EngineConfig.device`: "auto" is CUDA when torch sees a CUDA device.

    Raises:
        ValueError: "cuda" was asked for and torch sees no CUDA device (the message says why:
            a CPU-only torch build, or no device visible).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"--device cuda: {why} (torch {torch.__version__}); use --device cpu")
    return torch.device(name)


def load_weights(source: ModelSource, dtype: torch.dtype, device: torch.device
                 ) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer | ByteTokenizer]:
    """The model `source` names: its shape, its state dict on `device` in `dtype`, its tokenizer.

    The embedded or another GGUF: dequantized (`load_gguf`) with its own tokenizer; a checkpoint
    directory: `load_safetensors` and `Tokenizer.from_hf_dir`; a random model: `random_weights`
    drawn on the device and a `ByteTokenizer`. A tied model's output matrix stays the embedding's
    tensor.

    Raises:
        FileNotFoundError: the model file, `config.json`, the shards or `tokenizer.json` are missing.
        ValueError / KeyError: see the loaders.
    """
    if source.kind == "random":
        args = random_shape(source.shape)
        state = random_weights(args, dtype, device, seed=source.seed)
        return args, state, ByteTokenizer(args.vocab_size)
    if source.kind == "safetensors":
        args, state = load_safetensors(source.path, dtype, device)
        return args, state, Tokenizer.from_hf_dir(source.path, args.vocab_size)
    reader = open_gguf(source.path)    # parse the header (≈ 100k tokenizer strings) once
    args, state = load_gguf(reader)
    # fp32 as dequantized (the network casts the matrices and keeps the norms in fp32); moved by
    # identity, so a tied matrix moves once
    moved: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        if id(tensor) not in moved:
            moved[id(tensor)] = tensor.to(device)
        state[name] = moved[id(tensor)]
    return args, state, Tokenizer.from_gguf(reader)


def auto_weights(network: Transformer, source: ModelSource) -> tuple[str, str]:
    """What `EngineConfig.weights` "auto" serves `network` with, and why (for the log).

    "q4q8" (the GGUF's own blocks exact times 8-bit inputs: llama.cpp's Q4_1 x Q8_1 and
    Q4_K / Q6_K x Q8_K arithmetic) where the CPU has AVX512-VNNI and no AMX, or AVX2 alone: there
    it prefills and runs 32-row steps faster than "q4" at +0.09 % perplexity against the exact
    bf16 products, within llama.cpp's own +0.11 % for the embedded Q4_1 file
    (docs/benchmarks/int8.md), and a Q4_K_M file's products (Llama 3.2 1B's block matrices) ran
    2.84x faster than bf16 at one row and 1.61x at 32 on one Zen 4 thread
    (docs/benchmarks/kquant.md). "q4" (the GGUF's 4-bit blocks
    with the bf16 products' bits) where AMX is usable: there `q4_amx_linear` is the faster of the
    two, and exact; it takes Q4_1 files only, so a K-quant file stays "bf16" there (not measured
    on AMX: `--weights q4q8` serves it). "bf16" for a model that is not a GGUF, not bf16 on a
    CPU, or where neither kernel runs.

    Returns:
        (weights, reason): weights one of "q4q8", "q4", "bf16"; reason in words.
    """
    if source.kind not in ("embedded", "gguf"):
        return "bf16", f"--model is {source.kind}, not a GGUF with 4-bit blocks"
    if not (network.dtype == torch.bfloat16 and network.output.device.type == "cpu"):
        return "bf16", "4-bit products need a bf16 model on the CPU"
    if kernels.q4_amx_available():
        return "q4", "AMX: q4_amx_linear, the bf16 products' bits"
    if kernels.q4q8_linear_available():
        return "q4q8", ("AVX512-VNNI or AVX2 without AMX: the GGUF's Q4_1 / Q8_0 / Q4_K / Q6_K blocks "
                        "times 8-bit inputs, llama.cpp's arithmetic")
    if kernels.q4_linear_available():
        return "q4", "AVX512-BF16: q4_linear, the bf16 products' bits"
    return "bf16", "no 4-bit kernel in this build"


def attach_weights(weights: str, network: Transformer, source: ModelSource,
                   tokenizer: Tokenizer | ByteTokenizer | None = None) -> None:
    """Serve `network`'s block matrices as `weights` asks (`EngineConfig.weights`): "q4" from the
    GGUF's 4-bit blocks (`engine.model.quant.attach_q4`), "int8" on int8 arithmetic
    (`engine.model.int8_weights.attach_int8`, its outlier channels chosen on the fixed text of
    `engine.runner.int8_calibration` with `tokenizer`, none without), "q4q8" on the GGUF's Q4_1,
    Q8_0 (Q5_0 and Q4_0 as Q8_0), Q4_K and Q6_K blocks times 8-bit inputs (`engine.model.gguf_blocks.attach_q4q8`; matrices of other
    types keep bf16), "bf16" as loaded, "auto" as `auto_weights` chooses (falling back to "bf16"
    where the chosen weights cannot serve the file); the choice is logged.

    Raises:
        ValueError: "q4", "int8" or "q4q8" where it cannot run (the reason is in the message).
    """
    explicit = weights != "auto"
    if weights == "auto":
        weights, reason = auto_weights(network, source)
        log.info("weights auto: %s (%s)", weights, reason)
    if weights == "bf16":
        return
    if weights == "int8":
        attach_int8(network, None if tokenizer is None else int8_calibration(network, tokenizer))
        return
    if source.kind not in ("embedded", "gguf"):
        raise ValueError(f"--weights {weights} needs a GGUF model with "
                         f"{'Q4_1, Q8_0, Q5_0, Q4_0, Q4_K or Q6_K' if weights == 'q4q8' else 'Q4_1'} matrices; "
                         f"--model is {source.kind}")
    try:
        if weights == "q4q8":
            attach_q4q8(network, source.path)
        else:
            attach_q4(network, source.path)
    except ValueError as exc:
        if explicit:
            raise
        log.info("weights: bf16 (%s)", exc)


def int8_calibration(network: Transformer, tokenizer: Tokenizer | ByteTokenizer
                     ) -> Callable[[], None]:
    """The run `engine.model.int8_weights.attach_int8` chooses `network`'s outlier channels from:
    the fixed text of `engine.runner.int8_calibration`, by `tokenizer`, through a throwaway
    engine over `network` (freed when the run ends)."""
    def calibrate() -> None:
        ids = calibration_tokens(tokenizer.encode_text)
        run_calibration(engine_from_model(calibration_config(len(ids)), network), ids)
    return calibrate


def build_engine(config: EngineConfig, model: str | pathlib.Path | None = None,
                 model_name: str | None = None, calibrate: bool = True) -> LoadedEngine:
    """Load the model `model` names (`genserve.common.model_source`; None: the embedded SmolLM2 GGUF)
    on `config.device` and build a stopped engine.

    `config.max_context` is lowered (in place, logged) to the model's positions when above them.
    The KV pool holds `config.num_blocks` blocks; else, on CUDA, what the device's free memory
    after the weights and `config.activation_reserve_bytes` holds (`kv_cache.kv_pool_size`); else
    what `config.kv_pool_bytes` holds. The block count is logged. `config.weights` chooses how the
    block matrices are read (`attach_weights`: the GGUF's 4-bit blocks where they can be). With
    `calibrate`, a short warm-up measures the per-token costs admission control uses.

    Args:
        config: engine dials (device, dtype, pool).
        model: a `--model` value.
        model_name: the name to report; None: the model's own (`ModelSource.served_name`).
        calibrate: measure the per-token costs before returning.

    Raises:
        FileNotFoundError: the model's files are missing.
        ValueError: a bad `--model` value, CUDA asked for but absent, a pool of < 2 blocks, or
            `--weights q4` where it cannot run (not a Q4_1 GGUF, not bf16 on an AVX512-BF16 CPU).
    """
    set_threads(config)
    source = parse_model_source(model)
    device = resolve_device(config.device)
    dtype = getattr(torch, config.dtype)
    args, state, tokenizer = load_weights(source, dtype, device)
    if config.max_context > args.max_context:
        # positions past the model's RoPE table do not exist (Llama-2-7B: 4,096)
        log.warning("--max-context %d is more than %s's %d positions; serving %d", config.max_context,
                    source.served_name, args.max_context, args.max_context)
        config.max_context = args.max_context
    elif config.max_context < args.max_context:
        # the RoPE tables cover the served context, and LongRoPE picks its factors by it
        # (short ones when it fits the original context, as llama.cpp and transformers do)
        args = args.replace(max_context=config.max_context)
    network = model_from_weights(args, state, dtype, device)
    state.clear()                      # frees the unfused Q/K/V and gate/up matrices before sizing the pool
    attach_weights(config.weights, network, source, tokenizer)
    engine = engine_from_model(config, network)
    if calibrate:
        engine.scheduler.cost = measure_costs(engine)
        engine.calibrate_costs = True
    return LoadedEngine(engine, tokenizer, args, model_name or source.served_name, source)


def model_from_weights(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> Transformer:
    """The network over `state` (loader names) in `dtype` on `device`, with its buffers there too."""
    model = Transformer.from_state_dict(args, state, dtype)
    return model.to(device)


def kv_pool_blocks(config: EngineConfig, args: ModelArgs, dtype: torch.dtype,
                   device: torch.device) -> int:
    """Blocks of the KV pool: `config.num_blocks`; else on CUDA the device's free memory now minus
    `config.activation_reserve_bytes` (call it once the weights are on the device); else
    `config.kv_pool_bytes`. Logs the count and its arithmetic.

    Raises:
        ValueError: fewer than 2 blocks fit.
    """
    if config.num_blocks:
        log.info("KV pool: %d blocks of %d tokens (--num-blocks)", config.num_blocks, config.block_size)
        return config.num_blocks
    if device.type == "cuda":
        size = device_pool_size(args, config.block_size, dtype, device, config.activation_reserve_bytes)
        log.info("%s", size.describe())
        return size.num_blocks
    size = model_pool_size(args, config.block_size, dtype, config.kv_pool_bytes)
    log.info("%s (--kv-pool-gib %.2f)", size.describe(), config.kv_pool_bytes / 1024**3)
    return size.num_blocks


def engine_from_model(config: EngineConfig, model: Transformer) -> Engine:
    """A stopped engine over `model`, its KV pool on the model's device (sized by `kv_pool_blocks`)
    in the model dtype or, with `config.kv_cache_dtype` "int8", in the 8-bit format.

    Raises:
        ValueError: fewer than 2 blocks fit; the 8-bit format with a head_dim that is not a
            multiple of 32 or with an attention backend that cannot read it (ModelRunner).
    """
    device = model.output.device
    kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else model.dtype
    num_blocks = kv_pool_blocks(config, model.args, kv_dtype, device)
    groups = kv_groups(model.args)
    kv = KVCache(model.args, num_blocks, config.block_size, kv_dtype, device, groups)
    # genserve's CPU kernels take bf16 or fp32 only; fp16 on the CPU runs the torch ops
    kernels = False if model.dtype == torch.float16 else None
    runner = ModelRunner(model, kv, kernels=kernels, max_loras=config.max_loras, lora_dtype=config.lora_dtype)
    runner.adapters.max_rank = config.max_lora_rank
    return Engine(config, runner, num_blocks, kv_windows=groups.windows)


def engine_from_weights(config: EngineConfig, args: ModelArgs,
                        state: dict[str, torch.Tensor]) -> Engine:
    """A stopped engine over `state` (loader names) in `config.dtype` on `config.device`, KV pool
    sized by `kv_pool_blocks` (on CUDA, `state` still counts against the free memory)."""
    dtype = getattr(torch, config.dtype)
    device = resolve_device(config.device)
    return engine_from_model(config, model_from_weights(args, state, dtype, device))


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
    engine.scheduler.queue.forget_key("warmup")
    # The warm-up is not traffic: the prefix-cache counters start from zero for the first user.
    engine.scheduler.kv_cache.reset_stats()
    engine.pool.check_all_free()
    prefill = [s / c for b, c, s in steps if c and not b]
    fullest = max(b for b, c, _ in steps if not c)
    decode = [s / b for b, c, s in steps if b == fullest and not c]
    return CostModel(prefill_ms_per_token=1000 * statistics.median(prefill),
                     decode_ms_per_token=1000 * statistics.median(decode))
