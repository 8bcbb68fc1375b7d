"""`ModelRunner`: runs a `StepPlan` through the real model over the paged KV cache.

It implements `engine.core.executor.Executor`, as does the virtual-time cost model
(`engine.core.sim_executor.SimExecutor`); the engine cannot tell them apart: both take a plan and
return one token per draw (`SampledTokens`). A step is: the plan's host integers
(`engine.runner.inputs.StepInputs`), the block copies, the attention metadata and those integers
on the device in one copy, the forward pass by one of three paths chosen here (a captured CUDA
graph, the C++ decode loop, or the model's Python block loop), the logits of the sampled rows,
and sampling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
from torch.autograd import _profiler_enabled

from engine import kernels as genserve_kernels
from engine.attention import BACKENDS, AttentionBackend, CpuBackend, choose_backend
from engine.attention import ENV as ATTENTION_ENV
from engine.attention.base import GatherBuffer, build_metadata
from engine.attention.kv_quant import quantized
from engine.attention.paged_sdpa import window_kernel_serves
from engine.core.outputs import SampledTokens
from engine.core.plan import StepPlan
from engine.core.request import Request
from engine.model.layer_ops import KernelLayerOps, TorchLayerOps
from engine.model.config import ModelArgs
from engine.model.mlp import MoEFeedForward
from engine.model.transformer import Transformer, layer_spec
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.decode_loop import DecodeLoop
from engine.runner.inputs import StepInputs
from engine.runner.kv_cache import KVCache
from engine.runner.logits_processors import process_logits
from engine.runner.lora import LoraRegistry, LoraSlots, lora_batch
from engine.runner.prompt_logprobs import prompt_logprobs
from engine.runner.request_state import CachedRequestState, RequestStates
from engine.runner.sampler import make_generator, sample
from engine.structured.masks import GrammarMasks

log = logging.getLogger(__name__)


def request_generator(req: Request, state: CachedRequestState,
                      device: torch.device | str = "cpu") -> torch.Generator:
    """The request's own generator on `device` (where sampling runs), kept in its runner `state`:
    created on first use from its seed and kept across preemption. Raises ValueError if it was
    made for another device."""
    if state.generator is None:
        state.generator = make_generator(req.sampling.seed, device)
    elif state.generator.device != torch.device(device):
        raise ValueError(f"request {req.request_id}'s generator is on {state.generator.device}, "
                         f"sampling runs on {device}")
    return state.generator


# The block products that round their inputs to 8 bits (`engine.model.linear` method names).
EIGHT_BIT_METHODS = frozenset({"q4q8", "q8q8", "qk", "int8", "q8_amx"})


def eight_bit_products(model: Transformer) -> bool:
    """Whether `model`'s first layer's Q | K | V product rounds its inputs to 8 bits (`q4q8`,
    the GGUF's K-quant or Q8_0 products, int8 weights): where "auto" serves adapters 8-bit."""
    packed = model.layers[0].attention.wqkv_packed
    return packed is not None and packed.method.name in EIGHT_BIT_METHODS


class ModelRunner:
    """The real model over the paged KV cache.

    Args:
        model: the network (its dtype is the serving dtype).
        kv: the paged K/V tensors.
        kernels: run genserve's CPU kernels (`engine.kernels`: decode and prefill attention, the
            fused per-token steps of each block, the C++ decode loop for pure-decode steps);
            None: when they build here (CPU) and serve every layer (`kernel_layers`), else torch
            SDPA and plain torch ops. Never on another device.
        attention: force an attention backend (a key of `engine.attention.BACKENDS`: "cpu",
            "sdpa", "flex", "xformers"); None: the process's choice
            (`engine.attention.choose_backend`).
        cuda_graphs: replay decode-only steps of up to 64 rows from CUDA graphs captured per
            row bucket (`engine.runner.cuda_graphs.DecodeGraphs`); CUDA only, off by default.
        max_loras: LoRA adapters kept resident between steps (`engine.runner.lora.LoraSlots`).
        lora_dtype: `EngineConfig.lora_dtype` ("auto" resolved by `eight_bit_products`).
    Raises:
        ValueError: the weights and the KV pools are on different devices, `attention` is
            not a backend name, or the pools are in the 8-bit format (int8) with a backend that
            does not read it or with `cuda_graphs` (capabilities declared on each backend class).
        RuntimeError: the forced `attention` backend cannot run on this device.

    Attributes:
        kernels: settable; switches the attention backend, the layer ops and the decode loop
            together (tests compare the two paths on one engine).
        attention: the backend every step's layers call.
        states: each request's runner state (`RequestStates`: generator, logits processors'
            state, grammar matcher), dropped the step after the request finished.
        adapters: the LoRA adapters served by name (`engine.runner.lora.LoraRegistry`: load,
            unload, each new request's `LoraRequest`).
        loras: the resident LoRA adapters (`LoraSlots`); each dense projection of a step with
            adapter rows adds the rows' deltas (`engine.model.lora`): in the C++ decode loop for
            a pure-decode step where the adapters have `lora_delta_`'s tables
            (`DecodeLoop.accepts`), else in the model's Python block loop (no CUDA graph adds
            them).
        decode_loop: the C++ decode loop (`engine.runner.decode_loop.DecodeLoop`) that runs
            pure-decode steps, or None (then the model's Python block loop runs them; set it to
            None to compare the two).

    The device is the one the model's weights and the KV pools are on (they must agree). Every
    step's integers (token ids, positions, rows to sample and all attention metadata) reach it in
    one copy (`engine.attention.base.build_metadata`; on the CPU no copy at all), the forward
    runs there with the chosen backend, and sampling runs there with each request's generator on
    that device.

    One step builds the flat batch `token_ids[B + C]`, `positions[B + C]` (the tokens of each
    segment, in plan order), runs the forward pass, projects to logits only the last position
    of each sampling segment (`logits[R, vocab]`), and samples.
    """

    def __init__(self, model: Transformer, kv: KVCache, kernels: bool | None = None,
                 attention: str | None = None, cuda_graphs: bool = False, max_loras: int = 8,
                 lora_dtype: str = "auto") -> None:
        self.model = model
        self.kv = kv
        self.device = kv.layers[0].device
        if model.output.device != self.device:
            raise ValueError(f"model weights on {model.output.device}, KV cache on {self.device}")
        on_cpu = self.device.type == "cpu"
        if not on_cpu and model.output_packed is not None:
            model.pack()                  # moved after packing: drop the CPU-only copies
        if kernels is None:
            kernels = on_cpu and genserve_kernels.available()
        if kernels and not kernel_layers(model.args, model.dtype):
            log.info("%s: head_dim %d, %d query heads per KV head or an attention softcap: the torch "
                     "ops and SDPA run, not genserve's fused CPU kernels", model.args.architecture,
                     model.args.head_dim, model.args.n_heads // max(model.args.n_kv_heads, 1))
            kernels = False
        if quantized(kv.layers[0].dtype):
            # a backend forced by $GENSERVE_ATTENTION is checked too, not replaced by the default
            attention = attention or os.environ.get(ATTENTION_ENV) or ("cpu" if on_cpu else "sdpa")
            backend = BACKENDS.get(attention)
            if backend is not None and not backend.int8_kv:
                readers = " or ".join(n for n, b in BACKENDS.items() if b.int8_kv)
                raise ValueError(f"the 8-bit KV cache runs with the {readers} attention backend, "
                                 f"not {attention!r}")
            if cuda_graphs:
                raise ValueError("CUDA graphs are not captured for the 8-bit KV cache")
            # genserve's decode kernel reads the 8-bit rows with bf16 queries on AVX512-BF16
            kernels = (kernels and model.dtype == torch.bfloat16
                       and genserve_kernels.int8_kv_decode_available())
        self._preferred = attention
        self.kernels = kernels
        if cuda_graphs and kv.groups.num_groups > 1:
            log.info("%s: KV groups of sliding-window and global layers: decode runs eagerly, "
                     "no CUDA graphs are captured", model.args.architecture)
            cuda_graphs = False
        self.graphs = DecodeGraphs(model, kv) if cuda_graphs else None
        self.grammar = GrammarMasks()        # constrained rows' token masks (engine/structured)
        self.states = RequestStates()        # generators, processor and grammar state per request
        self.loras = LoraSlots(self.device, model.dtype, max_loras,
                               int8=lora_dtype == "int8" or (lora_dtype == "auto" and eight_bit_products(model)))
        self.adapters = LoraRegistry(model.args, model.dtype)   # the served adapters, by name

    def expert_load(self) -> list[tuple[int, list[int]]]:
        """Routing of the mixture-of-experts layers since the model was built: (layer index,
        tokens each expert took, in expert order) per sparse layer; empty for a dense model.
        A prefill token counts once per expert it ran on (top_k per token in all)."""
        return [(i, layer.feed_forward.expert_rows.tolist()) for i, layer in enumerate(self.model.layers)
                if isinstance(layer.feed_forward, MoEFeedForward)]

    @property
    def kernels(self) -> bool:
        """Whether genserve's CPU kernels run (False on any other device)."""
        return self._kernels

    @kernels.setter
    def kernels(self, on: bool) -> None:
        args = self.model.args
        self._kernels = bool(on) and self.device.type == "cpu" and kernel_layers(args, self.model.dtype)
        specs = any(layer.attention.spec is not None for layer in self.model.layers)
        self.attention: AttentionBackend = choose_backend(
            self.device, self.model.dtype, self.kv.block_size, args.n_heads, args.n_kv_heads,
            args.head_dim, self._kernels, self._preferred, layer_specs=specs)
        kernel_path = self._kernels and isinstance(self.attention, CpuBackend)
        self.layer_ops: type[TorchLayerOps] = KernelLayerOps if kernel_path else TorchLayerOps
        self.gather = None if kernel_path else GatherBuffer()   # the SDPA decode path's keys, values
        self.decode_loop = DecodeLoop.from_model(self.model, self.kv.layers[0].dtype) if kernel_path else None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> SampledTokens:
        """Forward + sample; raises whatever the model raises (the loop turns it into errors).

        The step's stages are `torch.profiler.record_function` ranges, so a profiler run sees
        them (benchmarks/engine.py reads them): "genserve.inputs" (flat batch, block copies,
        attention metadata), "genserve.forward" (`model(...)`), "genserve.logits" (the output
        projection of the sampling rows) and "genserve.sample". With no profiler running, no range
        is opened (`stage`).
        """
        t0 = time.perf_counter()
        self.states.prune()
        masks = self.grammar.start(plan.draws, self.states.of)     # on a worker while the forward runs
        with stage("genserve.inputs"):
            inputs = StepInputs.from_plan(plan, self.kv.block_size)
            for src, dst in plan.block_copies:      # copy-on-write of shared prompt blocks
                self.kv.copy_block(src, dst)
            lora = lora_batch(plan, self.loras, self.device)
            graph_rows = self.graphs.bucket(plan) if self.graphs is not None and lora is None else None
            if graph_rows is None:
                meta, (token_ids, positions, *sampling) = build_metadata(
                    self.attention, inputs.layout, self.model.dtype, self.device,
                    self.kv.num_blocks, self.gather,
                    (inputs.token_ids, inputs.positions, *inputs.sampling_ints), inputs.group_layouts)
                if inputs.group_layouts:       # KV groups: each layer reads its group's tables
                    meta = [meta[g] for g in self.kv.groups.layer_group]
        with stage("genserve.forward"):
            if graph_rows is not None:
                hidden, sampling = self.graphs.run(graph_rows, inputs)
            elif self.decode_loop is not None and inputs.decode_only and self.decode_loop.accepts(lora):
                # A pure-decode step: the model's block loop, run in C++ (adapter rows' deltas too).
                hidden = self.decode_loop.run(self.model, token_ids, positions, self.kv.layers, meta, lora)
            else:
                hidden = self.model(token_ids, positions, self.kv.layers, meta, self.layer_ops, lora)
        sample_index, draw_index, greedy_index, drawn_index = sampling
        prompt = prompt_logprobs(plan, hidden, self.model.logits) if plan.wants_prompt_logprobs else ()
        if not inputs.sample_rows:
            return SampledTokens([], [], [], time.perf_counter() - t0, prompt)
        with stage("genserve.logits"):
            logits = self.model.logits(hidden[sample_index])              # [R, vocab] fp32
        if inputs.draws_share_rows:                    # n > 1: several draws share a row
            logits = logits[draw_index]
        draws = plan.draws
        with stage("genserve.sample"):
            if masks is not None:
                # Grammar masks first, in place: the reported logprobs see them, as vLLM's do
                # (a masked entry stays -inf through every processor below).
                masks.apply(logits)
            requests = [r for _, r in draws]
            params = [r.sampling for r in requests]
            keep_raw = any(p.logprobs for p in params)
            states = [self.states.of(r) for r in requests]
            processed = process_logits(logits, requests, copy=keep_raw, states=states)
            tokens, logprobs, top = sample(processed, params,
                                           [request_generator(r, s, self.device) for r, s in zip(requests, states)],
                                           raw_logits=logits if processed is not logits else None,
                                           split=(greedy_index, drawn_index), kernel=self.kernels)
        return SampledTokens(tokens, logprobs, top, time.perf_counter() - t0, prompt)


def kernel_layers(args: ModelArgs, dtype: torch.dtype) -> bool:
    """Whether genserve's CPU kernel path (`KernelLayerOps` and the "cpu-kernels" decode
    attention) serves every layer of a model with `args` in `dtype`: the plain head_dim-64
    attention (`paged_decode`, as before), or every layer's decode attention in
    `paged_decode_window` (head_dim 64, 128 or 256, 1-4 or 8 query heads per KV head, any score
    scale and sliding window, no softcap: Qwen3, Qwen3-MoE, Gemma 3). The options outside attention
    (biases, q/k norms, sandwich norms, GELU, embedding scale, mixtures of experts) run in the
    Python block loop for prefill and mixed steps, their elementwise steps in `KernelLayerOps`,
    and in the C++ decode loop for pure-decode steps where it serves the model
    (`DecodeLoop.from_model`)."""
    specs = [layer_spec(args, i) for i in range(args.n_layers)]
    if args.head_dim == 64 and all(spec is None for spec in specs):
        return True
    return all(window_kernel_serves(args.n_heads, args.n_kv_heads, args.head_dim, dtype, dtype, spec)
               for spec in specs)


def stage(name: str) -> contextlib.AbstractContextManager:
    """`torch.profiler.record_function(name)` while a profiler runs, else a no-op: opening a range
    costs ≈ 7 µs even with none running (a call into torch's profiler op), four times a step."""
    return torch.profiler.record_function(name) if _profiler_enabled() else contextlib.nullcontext()
