"""Attention backends behind one interface (`engine.attention.base`), one chosen per process.

Every backend computes the same thing for a step: each token of the flat batch `[T = B + C]`
attends, causally, over its own request's context, read from the paged KV cache through the
request's block table (tests/engine/attention_oracle.py writes that mask out densely; it is the
definition the tests hold every backend to). They differ in how, one module each:

* `cpu.CpuBackend` ("cpu-kernels" / "cpu-sdpa"): genserve's CPU kernels when they built
  (`engine.kernels`), else torch SDPA per decode batch and per prefill piece
  (`paged_sdpa`). Batch-invariant bit for bit (tests/engine/attention/test_attention.py).
* `sdpa.SdpaBackend` ("sdpa"): the same SDPA functions on any torch device.
* `flex.FlexBackend` ("flex"): PyTorch FlexAttention over the flat batch against the whole pool
  with a block mask built from the step's segments and block tables.
* `xformers.XformersBackend` ("xformers", "xformers-gathered"): xformers
  `memory_efficient_attention` with a paged (or gathered) block-diagonal bias. CUDA only.

Choice (`choose_backend`, once per process for a given device and shape, logged): on the CPU the
`CpuBackend`; on CUDA the first of xformers (paged, then gathered), FlexAttention, SDPA that
imports and passes a probe step against SDPA on the device (so a missing or mismatched xformers
build, or a Triton that cannot compile, falls through). `GENSERVE_ATTENTION=cpu|sdpa|flex|xformers`
(or the runner's `attention` argument) forces one; a forced backend that fails its probe raises.
The chosen backend's `name` is exported as `genserve_attention_backend_info`. What each backend
can do (the 8-bit KV cache, CUDA graphs, per-layer `AttentionSpec`s: sliding windows, softcaps,
other score scales) is declared on its class (`BACKENDS`); a model whose layers need specs is
served only by a backend that declares them (today "cpu" and "sdpa").

Every backend gets its metadata from the same builder (`base.build_metadata`): the step's
integers, the backend's own (`host_ints`) among them, reach the device in one copy, and
`step_state` turns the uploaded views into the backend's per-step object
(`AttentionMetadata.state`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from engine.attention.base import (AttentionBackend, GatherBuffer, SegmentInts, StepLayout,
                                   build_metadata)
from engine.attention.cpu import CpuBackend
from engine.attention.flex import FlexBackend
from engine.attention.sdpa import SdpaBackend
from engine.attention.xformers import XformersBackend

log = logging.getLogger(__name__)

ENV = "GENSERVE_ATTENTION"            # forces a backend: cpu, sdpa, flex or xformers
PROBE_TOLERANCE = 2e-2                # |probe output − SDPA| allowed in bf16/fp16 (2^-6 ≈ 1.6e-2)
BACKENDS: dict[str, type] = {"cpu": CpuBackend, "sdpa": SdpaBackend, "flex": FlexBackend,
                             "xformers": XformersBackend}
"""Backend classes by the name `--attention` / `$GENSERVE_ATTENTION` take (read-only)."""


def attend_step(backend: AttentionBackend, q: torch.Tensor, cache: torch.Tensor,
                segments: list[SegmentInts], block_size: int) -> torch.Tensor:
    """One attention call of a step whose K/V are already in `cache` (tests and probes).

    Args:
        q: [T, n_heads, head_dim] on the cache's device; cache: [2, num_blocks, block_size,
            n_kv_heads, head_dim]; segments: the step's (decode rows first).
    Returns:
        [T, n_heads, head_dim] in q's dtype.
    """
    layout = StepLayout.from_segments(segments, block_size)
    meta, _ = build_metadata(backend, layout, q.dtype, cache.device, cache.shape[1], GatherBuffer())
    return backend.attend(q, cache, meta)


def probe(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, block_size: int,
          n_heads: int, n_kv_heads: int, head_dim: int) -> str | None:
    """Run a small step (a decode row over two blocks, a prefill piece over two blocks, shuffled
    block ids) through `backend` and through `SdpaBackend` on `device`; None when they agree
    within PROBE_TOLERANCE, else why not (the exception, or the difference). Never raises."""
    try:
        g = torch.Generator().manual_seed(0)
        cache = torch.randn(2, 6, block_size, n_kv_heads, head_dim, generator=g).to(device, dtype)
        spans: list[SegmentInts] = [(block_size + 2, 1, [3, 1], True), (0, block_size + 3, [5, 2], False)]
        q = torch.randn(block_size + 4, n_heads, head_dim, generator=g).to(device, dtype)
        out = attend_step(backend, q, cache, spans, block_size)
        want = attend_step(SdpaBackend(), q, cache, spans, block_size)
        err = (out.float() - want.float()).abs().max().item()
        if not err <= PROBE_TOLERANCE:
            return f"differs from SDPA by {err:.3g}"
        return None
    except Exception as exc:        # noqa: BLE001 — any failure means: try the next backend
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {first[:200]}"


def choose_backend(device: torch.device | str, dtype: torch.dtype, block_size: int, n_heads: int,
                   n_kv_heads: int, head_dim: int, kernels: bool = False,
                   preferred: str | None = None, layer_specs: bool = False) -> AttentionBackend:
    """The attention backend for a model on `device` (see the module docstring for the order).

    Made once per process for each (device type, dtype, shape, kernels, preferred, layer_specs):
    later calls return the same object. `preferred` (else `$GENSERVE_ATTENTION`, else automatic)
    is a key of BACKENDS. `layer_specs`: the model's layers pass `AttentionSpec`s (sliding
    windows, softcaps, another scale), so only backends declaring `layer_specs` are candidates.

    Raises:
        ValueError: `preferred` is not a key of BACKENDS.
        RuntimeError: the preferred backend cannot run here, or cannot serve the layers' specs
            (the message says why).
    """
    preferred = preferred or os.environ.get(ENV) or None
    if preferred is not None and preferred not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}; got {preferred!r}"
                         f" (from the executor's attention argument or ${ENV})")
    return _choose(torch.device(device).type, dtype, block_size, n_heads, n_kv_heads, head_dim,
                   kernels, preferred, layer_specs)


@functools.cache
def _choose(device_type: str, dtype: torch.dtype, block_size: int, n_heads: int, n_kv_heads: int,
            head_dim: int, kernels: bool, preferred: str | None, layer_specs: bool = False) -> AttentionBackend:
    device = torch.device(device_type)
    if layer_specs and preferred is not None and not BACKENDS[preferred].layer_specs:
        able = ", ".join(n for n, b in BACKENDS.items() if b.layer_specs)
        raise RuntimeError(f"attention backend {preferred!r} has no sliding windows, softcaps or other "
                           f"score scales, which this model's layers need; use one of {able}")
    shape = (device, dtype, block_size, n_heads, n_kv_heads, head_dim)
    if preferred is None:
        preferred = "cpu" if device_type == "cpu" else "auto"
    if preferred == "cpu":
        if device_type != "cpu":
            raise RuntimeError(f"attention backend 'cpu' runs on the CPU only, not {device_type}")
        backend: AttentionBackend = CpuBackend(kernels)
        log.info("attention backend: %s", backend.name)
        return backend
    candidates: list[tuple[str, Any]] = []
    if preferred in ("auto", "xformers"):
        candidates += [("xformers", lambda: XformersBackend(True)),
                       ("xformers", lambda: XformersBackend(False))]
    if preferred in ("auto", "flex"):
        candidates.append(("flex", lambda: FlexBackend(compiled=device_type == "cuda")))
    if preferred in ("auto", "sdpa"):
        candidates.append(("sdpa", SdpaBackend))
    skipped = []
    if layer_specs:
        skipped += [f"{n}: no sliding windows, softcaps or other scales" for n, _ in candidates
                    if not BACKENDS[n].layer_specs]
        candidates = [(n, make) for n, make in candidates if BACKENDS[n].layer_specs]
    for name, make in candidates:
        if name != "sdpa" and device_type != "cuda" and preferred == "auto":
            continue                                   # fused backends: CUDA only, unless forced
        try:
            backend = make()
        except ImportError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        why = probe(backend, *shape)
        if why is None:
            if skipped:
                log.info("attention backends skipped: %s", "; ".join(skipped))
            log.info("attention backend: %s", backend.name)
            return backend
        skipped.append(f"{backend.name}: {why}")
    raise RuntimeError(f"attention backend {preferred!r} cannot run on {device_type}: "
                       + "; ".join(skipped))
