"""`ModelExecutor`: runs a `StepPlan` through the real model over the paged KV cache.

It implements `engine.step.Executor`, as does the virtual-time cost model
(`engine.sim_executor.SimExecutor`); the scheduler cannot tell them apart: both take a plan and
return one token per draw (`SampledTokens`).
"""

from __future__ import annotations

import time

import torch

from engine import kernels as genserve_kernels
from engine.attention import AttentionMetadata, GatherBuffer
from engine.attention_backends import AttentionBackend, CpuBackend, choose_backend
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.kv_quant import quantized
from engine.model.llama import Transformer
from engine.request import Request
from engine.sampler import make_generator, sample
from engine.scheduler import CostModel
from engine.step import SampledTokens, StepPlan


def request_generator(req: Request, device: torch.device | str = "cpu") -> torch.Generator:
    """The request's own generator on `device` (where sampling runs), created on first use from
    its seed and kept across preemption. Raises ValueError if it was made for another device."""
    if req.generator is None:
        req.generator = make_generator(req.sampling.seed, device)
    elif req.generator.device != torch.device(device):
        raise ValueError(f"request {req.request_id}'s generator is on {req.generator.device}, "
                         f"sampling runs on {device}")
    return req.generator


class ModelExecutor:
    """The real model over the paged KV cache.

    Args:
        model: the network (its dtype is the serving dtype).
        kv: the paged K/V tensors.
        cost_model: initial per-token costs; `calibrate()` measures real ones.
        kernels: run genserve's CPU kernels (`engine/kernels.py`: decode attention and the fused
            per-token steps of each block); None: when they build here (CPU, head_dim 64), else
            torch SDPA and plain torch ops. Never on another device.
        attention: force an attention backend ("cpu", "sdpa", "flex", "xformers"); None: the
            process's choice (`engine.attention_backends.choose_backend`).
        cuda_graphs: replay decode-only steps of up to 64 rows from CUDA graphs captured per
            row bucket (`engine.cuda_graphs.DecodeGraphs`); CUDA only, off by default.
    Raises:
        ValueError: the weights and the KV pools are on different devices, `attention` is
            not a backend name, or the pools are in the 8-bit format (int8) with `attention`
            other than "cpu" or "sdpa" or with `cuda_graphs`.
        RuntimeError: the forced `attention` backend cannot run on this device.

    The device is the one the model's weights and the KV pools are on (they must agree). On the
    CPU the step's metadata is built on the host as before (`CpuBackend`); elsewhere, and for any
    other backend, the token ids, positions, rows to sample and all attention metadata reach
    the device in one host-to-device copy (`AttentionMetadata.build_on_device`), the forward runs
    torch ops (`TorchLayerOps`, `F.linear`) and the chosen backend, and sampling runs there
    with each request's generator on that device.

    One step builds the flat batch `token_ids[B + C]`, `positions[B + C]` (the tokens of each
    segment, in plan order), runs the forward pass, projects to logits only the last position
    of each sampling segment (`logits[R, vocab]`), and samples.
    """

    def __init__(self, model: Transformer, kv: KVCache, cost_model: CostModel | None = None,
                 kernels: bool | None = None, attention: str | None = None,
                 cuda_graphs: bool = False) -> None:
        self.model = model
        self.kv = kv
        self.cost_model = cost_model or CostModel()
        self.device = kv.layers[0].device
        if model.output.device != self.device:
            raise ValueError(f"model weights on {model.output.device}, KV cache on {self.device}")
        on_cpu = self.device.type == "cpu"
        if not on_cpu and model.output_packed is not None:
            model.pack()                  # moved after packing: drop the CPU-only copies
        if kernels is None:
            kernels = (model.args.head_dim == 64 and on_cpu and genserve_kernels.available())
        eight_bit = quantized(kv.layers[0].dtype)
        if eight_bit:
            # The 8-bit cache is read by genserve's bf16 kernels and by the torch SDPA path (on
            # any device); the other backends read the pools as numbers.
            if attention not in (None, "cpu", "sdpa"):
                raise ValueError(f"the 8-bit KV cache runs with the cpu or sdpa attention backend, "
                                 f"not {attention!r}")
            if cuda_graphs:
                raise ValueError("CUDA graphs are not captured for the 8-bit KV cache")
            attention = attention or ("cpu" if on_cpu else "sdpa")
            # genserve's decode kernel reads the 8-bit rows with bf16 queries on AVX512-BF16
            kernels = (kernels and model.dtype == torch.bfloat16
                       and genserve_kernels.prefill_kernel_available())
        self.kernels = kernels and on_cpu
        args = model.args
        self.attention: AttentionBackend = choose_backend(
            self.device, model.dtype, kv.block_size, args.n_heads, args.n_kv_heads, args.head_dim,
            self.kernels, attention)
        kernel_decode = type(self.attention) is CpuBackend and self.kernels
        self.gather = None if kernel_decode else GatherBuffer()   # the SDPA decode path's keys, values
        self.graphs = DecodeGraphs(model, kv) if cuda_graphs else None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> SampledTokens:
        """Forward + sample; raises whatever the model raises (the loop turns it into errors).

        The step's stages are `torch.profiler.record_function` ranges, so a profiler run sees
        them (benchmarks/engine.py reads them): "genserve.inputs" (flat batch, block copies,
        attention metadata), "genserve.forward" (`model(...)`), "genserve.logits" (the output
        projection of the sampling rows) and "genserve.sample". With no profiler running, a range
        records nothing.
        """
        t0 = time.perf_counter()
        host_meta = type(self.attention) is CpuBackend      # today's CPU path: host metadata
        with torch.profiler.record_function("genserve.inputs"):
            token_ids: list[int] = []
            positions: list[int] = []
            sample_rows: list[int] = []
            for seg in plan.segments:
                req = seg.request
                token_ids.extend(req.token_at(p) for p in range(seg.start, seg.end))
                positions.extend(range(seg.start, seg.end))
                if seg.samples:
                    sample_rows.append(len(token_ids) - 1)
            for src, dst in plan.block_copies:      # copy-on-write of shared prompt blocks
                self.kv.copy_block(src, dst)
            spans = [(s.start, s.length, s.block_table, s.decode) for s in plan.segments]
            draws = plan.draws
            rows = [row for row, _ in draws]
            graph_rows = self.graphs.bucket(plan) if self.graphs is not None else None
            if graph_rows is None and host_meta:
                meta = AttentionMetadata.build(spans, self.kv.block_size, self.model.dtype,
                                               self.kernels, self.gather)
                token_tensor = torch.tensor(token_ids, dtype=torch.long)
                position_tensor = torch.tensor(positions, dtype=torch.long)
                sample_index: torch.Tensor | list[int] = sample_rows
                draw_index = None
            elif graph_rows is None:
                meta = AttentionMetadata.build(
                    spans, self.kv.block_size, self.model.dtype, backend=self.attention,
                    device=self.device, num_blocks=self.kv.num_blocks, gather=self.gather,
                    inputs=(token_ids, positions, sample_rows, rows))
                token_tensor, position_tensor, sample_index, draw_index = meta.inputs
        with torch.profiler.record_function("genserve.forward"):
            if graph_rows is not None:
                hidden, sample_index, draw_index = self.graphs.run(
                    graph_rows, token_ids, positions, spans, sample_rows, rows)
            else:
                hidden = self.model(token_tensor, position_tensor, self.kv.layers, meta)
        if not sample_rows:
            return SampledTokens([], [], [], time.perf_counter() - t0)
        with torch.profiler.record_function("genserve.logits"):
            logits = self.model.logits(hidden[sample_index])              # [R, vocab] fp32
        if rows != list(range(logits.shape[0])):       # n > 1: several draws share a row
            logits = logits[torch.tensor(rows, dtype=torch.long) if draw_index is None
                            else draw_index]
        with torch.profiler.record_function("genserve.sample"):
            tokens, logprobs, top = sample(logits, [r.sampling for _, r in draws],
                                           [request_generator(r, self.device) for _, r in draws])
        return SampledTokens(tokens, logprobs, top, time.perf_counter() - t0)
