"""A fake CUDA device for running the engine's CUDA path on a machine without one (test harness).

Under `torch._subclasses.fake_tensor.FakeTensorMode` a tensor made with `device="cuda"` carries
its shape, dtype, strides and device but no storage, and every op runs its meta kernel: shapes,
dtypes and devices are checked as on the device (two devices in one op raise
`FakeTensorDeviceMismatchError`), but no number exists. `FakeCuda` wraps that mode with what the
engine needs to run whole steps on it, and with what the tests measure. Everything it changes is
undone when it exits; nothing here is product code.

What it patches, and why (each is a place where the engine asks the device something):

* the CUDA device guard (CPU-only torch builds only): a CPU build registers no guard for CUDA,
  so every Python binding that opens a `DeviceGuard` for a CUDA tensor (`t[i]`, `copy_`,
  `t.to("cuda")`) raises "not linked with support for cuda devices" before the fake mode sees the
  op. `install_cuda_guard` compiles a 10-line library (g++, ≈ 1.5 s) that registers c10's own
  `FakeGuardImpl<CUDA>` (a no-op guard) in that slot. It stays for the process: it changes nothing
  for code that never makes a CUDA tensor, and a real CUDA build already has a guard (no-op here).
* `torch.cuda.is_available` → True, `torch.cuda.mem_get_info` → (device bytes − live fake CUDA
  bytes, device bytes), `torch.cuda.empty_cache` → nothing: the builder sizes the KV pool from
  them.
* `engine.runner.builder.random_weights` → fake tensors of the same names, shapes and dtype (a
  CUDA `torch.Generator` needs the CUDA library; fake weights have no values to draw anyway).
* `engine.runner.model_runner.make_generator` → `FakeCudaGenerator`, a CPU generator whose
  `.device` says the fake device, seeded as asked; each is recorded (`generators`). Fake random
  ops ignore their generator, so this is where the test sees which seed each request got.
* `torch.cuda.get_device_capability` → (9, 0), the H200's (xformers' operators ask).
* `engine.runner.builder.model_from_weights` → the network built on the device directly
  (`_model_on_device`: `Module.to` cannot swap fake parameters the fake mode references weakly).
* `engine.attention.FlexBackend` → FlexAttention's op run eagerly (`_eager_flex`); the backend
  choice, cached per process, is forgotten on entry and exit.
* `torch.tensor(data, device="cuda")` → `torch.tensor(data).to(device)` (`_tensor_via_host`), and
  no fake tensor keeps a real constant (`CONSTANT_NUMEL_LIMIT` 0).
* pinning (`aten._pin_memory`, which fake mode does not implement) → the tensor itself, marked
  pinned (`aten.is_pinned` answers True for it).
* SDPA on CUDA → the fused kernel torch picks for the inputs (`_Ledger._sdpa_kernel`).
* `safetensors.safe_open` → each tensor read from the file for real, outside the fake mode, and
  handed on as a fake CPU tensor of its shape and dtype (`_FakeSafeOpen`): a file's bytes cannot
  become a fake tensor's storage, and the LoRA loader reads adapters this way.

Transfers. A `TorchDispatchMode` below the fake mode records every copy between the host and
the device (`aten.to` / `aten._to_copy` / `aten.copy_` across devices: `Transfer`), and
`FakeTensor.tolist` / `FakeTensor.item` are wrapped to answer reads of device values, which
fake tensors cannot give: each read is recorded as a device-to-host transfer and answered by
`reply(tensor)`, a callback the test sets. The engine's sampled ids come back in one `tolist`, so
the test chooses which ids the engine receives and checks that they land in the right requests.
Any other read of a device value (`bool(t)`, `int(t)`, `t.numpy()`) raises, as fake tensors do.

Memory. Every CUDA tensor an op returns is tracked by its storage (weak references, so a storage
counts while any tensor of it is alive); `live_bytes()` is the sum over live storages and
`peak_bytes` its maximum since `reset_peak()`. This is torch's `memory_allocated`, not what the
caching allocator reserves (no rounding to its 512-byte blocks, no fragmentation).

Ops. The ledger counts every op that reaches it (`ledger.op_calls`, by `OpOverload`), so a test
can say which kernels a step ran (the mixture-of-experts layers' `aten._grouped_mm`).

Dtypes. Meta kernels of the matrix products do not all check that both operands have one dtype;
the ledger does, for the products and attention ops (`DTYPE_CHECKED`), and raises on a mix.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import pathlib
import shutil
import subprocess
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_cuda_guard;
}
// 1 when the no-op guard was registered, 0 when CUDA already had one.
extern "C" int install_fake_cuda_guard() {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  if (slot.load() != nullptr) return 0;
  slot.store(&fake_cuda_guard);
  return 1;
}
"""

DEVICE = torch.device("cuda", 0)
H200_CAPABILITY = (9, 0)             # sm_90 (Hopper)
H200_BYTES = 141 * 10**9            # the H200's memory, decimal bytes
DESIGN_DEVICE_BYTES = 80 * 10**9    # the design's 80 GB device (docs/design.md)

aten = torch.ops.aten
DTYPE_CHECKED = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
                 aten.linear.default, aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_flash_attention.default,
                 aten._scaled_dot_product_cudnn_attention.default,
                 aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten.scaled_dot_product_attention.default, aten._efficient_attention_forward.default,
                 aten._flash_attention_forward.default, aten.index_copy_.default,
                 aten.index_copy.default, aten.index_put_.default, aten._grouped_mm.default})


def install_cuda_guard(build_dir: pathlib.Path) -> str | None:
    """Make CUDA tensors' device guards work in this process (see the module docstring).

    Returns None when a guard is in place (the CUDA build's own, or the no-op one built into
    `build_dir`), else why not (no g++, the build failed): the caller skips with that reason.
    """
    if torch.version.cuda is not None:
        return None                                # a CUDA build registers its own guard
    compiler = shutil.which("g++")
    if compiler is None:
        return "no g++ to build the no-op CUDA device guard"
    root = pathlib.Path(torch.__file__).parent
    source, lib = build_dir / "fake_cuda_guard.cpp", build_dir / "fake_cuda_guard.so"
    source.write_text(GUARD_SOURCE)
    proc = subprocess.run([compiler, "-O1", "-std=c++17", "-shared", "-fPIC",
                           f"-I{root / 'include'}", str(source), f"-L{root / 'lib'}", "-lc10",
                           f"-Wl,-rpath,{root / 'lib'}", "-o", str(lib)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return f"building the no-op CUDA device guard failed: {proc.stderr[-500:]}"
    ctypes.CDLL(str(lib)).install_fake_cuda_guard()
    return None


def _eager_flex() -> type:
    from engine.attention.flex import FlexBackend

    class EagerFlex(FlexBackend):
        """`FlexBackend` running FlexAttention's higher-order op eagerly even on CUDA: its
        compiled kernel (Inductor, Triton) cannot be built for fake tensors; the eager op reads the
        same block mask and `mask_mod` and checks the same shapes, dtypes and devices."""

        def __init__(self, compiled: bool) -> None:
            super().__init__(compiled=False)

    return EagerFlex


class FakeCudaGenerator(torch.Generator):
    """A CPU generator that reports the fake CUDA device (fake random ops never read it)."""

    @property
    def device(self) -> torch.device:       # type: ignore[override]
        return DEVICE


@dataclass(frozen=True, slots=True)
class Transfer:
    """One copy between host and device.

    Attributes:
        direction: "h2d" or "d2h".
        dtype: the copied tensor's dtype; numel: its elements; nbytes: numel × element size.
        pinned: for "h2d", whether the host tensor was pinned (a non-blocking copy needs it).
        how: the op ("aten._to_copy", "aten.copy_") or the read ("tolist", "item").
        where: the innermost engine line that asked for it ("engine/runner/sampler.py:92").
    """

    direction: str
    dtype: torch.dtype
    numel: int
    nbytes: int
    pinned: bool
    how: str
    where: str = field(default_factory=lambda: _engine_line())


def _engine_line() -> str:
    """The innermost frame of the stack inside the engine package, as "path:line"."""
    for frame in reversed(traceback.extract_stack()):
        path = pathlib.PurePath(frame.filename)
        if "engine" in path.parts and "tests" not in path.parts:
            return f"{'/'.join(path.parts[path.parts.index('engine'):])}:{frame.lineno}"
    return "?"


def _is_cuda(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


@dataclass(eq=False)
class _Ledger(TorchDispatchMode):
    """The dispatch-level half of `FakeCuda`: transfers, pinning, memory, dtype checks, op counts."""

    transfers: list[Transfer] = field(default_factory=list)
    op_calls: collections.Counter = field(default_factory=collections.Counter)   # OpOverload → calls
    live: dict[int, int] = field(default_factory=dict)          # storage key → nbytes
    total: int = 0
    peak_bytes: int = 0
    pinned: dict[int, torch.UntypedStorage] = field(default_factory=dict)   # kept: keys stay unique

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.op_calls[func] += 1
        if func in (aten.pin_memory.default, aten._pin_memory.default):
            storage = args[0].untyped_storage()
            self.pinned[storage._cdata] = storage
            return args[0]
        if func is aten.is_pinned.default:
            return self.is_pinned(args[0])
        if func is aten.scaled_dot_product_attention.default and _is_cuda(args[0]):
            return self._sdpa_kernel(*args, **kwargs)
        if func in DTYPE_CHECKED:
            floats = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
            if len(floats) > 1:
                raise TypeError(f"{func}: operands of dtypes {sorted(map(str, floats))}")
        out = func(*args, **kwargs)
        if func.overloadpacket in (aten.to, aten._to_copy, aten.copy_):
            # under inference mode `Tensor.to` arrives as aten.to, else as aten._to_copy
            src, dst = (args[1], args[0]) if func.overloadpacket is aten.copy_ else (args[0], out)
            if _is_cuda(src) != _is_cuda(dst):
                self.transfers.append(Transfer("h2d" if _is_cuda(dst) else "d2h", src.dtype,
                                               src.numel(), src.numel() * src.element_size(),
                                               self.is_pinned(src), str(func.overloadpacket)))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if _is_cuda(t):
                self._track(t)
        return out

    def _sdpa_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
        """`F.scaled_dot_product_attention` on CUDA as the kernel torch picks on an H200 for
        these inputs: FlashAttention without a mask, the memory-efficient kernel with one (the
        choice is C++ CUDA code, absent from a CPU build, where the fake mode would decompose
        the call into the math path on every new shape). Both have meta kernels; their outputs
        are tracked. Grouped heads with a mask (no fused kernel takes them) go to the math path."""
        if attn_mask is None:
            out = aten._scaled_dot_product_flash_attention.default(
                q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        elif enable_gqa and q.shape[-3] != k.shape[-3]:
            return aten.scaled_dot_product_attention.default(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        else:
            for t in (k, v, attn_mask):
                if t.dtype != q.dtype:
                    raise TypeError(f"scaled_dot_product_attention: {t.dtype} beside {q.dtype} queries")
            bias = attn_mask.expand(*q.shape[:-1], k.shape[-2])
            out = aten._scaled_dot_product_efficient_attention.default(
                q, k, v, bias, False, dropout_p, is_causal, scale=scale)[0]
        self._track(out)
        return out

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self.pinned

    def _track(self, t: torch.Tensor) -> None:
        # A storage's Python object lives as long as the storage (torch preserves it), so a
        # weak reference to it says when the last tensor viewing it went. (Not to the tensor:
        # a weakly referenced parameter cannot be swapped by `Module.to`.)
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.live:
            self.live[key] = storage.nbytes()
            self.total += self.live[key]
            self.peak_bytes = max(self.peak_bytes, self.total)
            weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.total -= self.live.pop(key)


def default_reply(t: torch.Tensor) -> Any:
    """What a device read returns when the test set no `reply`: zeros (False for booleans) of
    the tensor's shape, as nested lists (`tolist`) or a number (`item`)."""
    zero: Any = False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
    return _nested(zero, t.shape)


def _nested(value: Any, shape: torch.Size) -> Any:
    return value if not len(shape) else [_nested(value, shape[1:]) for _ in range(shape[0])]


@dataclass(eq=False)
class FakeCuda:
    """The fake CUDA device as a context manager (see the module docstring).

    Attributes:
        device_bytes: the memory `torch.cuda.mem_get_info` reports (bytes).
        reply: answers a device read: tensor → list (`tolist`) or number (`item`).
        ledger: transfers (`ledger.transfers`) and memory (`live_bytes`, `peak_bytes`).
        generators: every generator the model runner made: (seed, generator), in order.
    """

    device_bytes: int = DESIGN_DEVICE_BYTES
    reply: Callable[[torch.Tensor], Any] = default_reply
    ledger: _Ledger = field(default_factory=_Ledger)
    generators: list[tuple[int | None, torch.Generator]] = field(default_factory=list)
    _stack: contextlib.ExitStack | None = None

    def live_bytes(self) -> int:
        """Bytes of every live fake CUDA tensor's storage (each storage once)."""
        return self.ledger.total

    @property
    def peak_bytes(self) -> int:
        """Most `live_bytes` since the last `reset_peak`."""
        return self.ledger.peak_bytes

    def reset_peak(self) -> None:
        self.ledger.peak_bytes = self.ledger.total

    def transfers_since(self, mark: int) -> list[Transfer]:
        """Transfers recorded after the first `mark` (a `len(ledger.transfers)` taken before)."""
        return self.ledger.transfers[mark:]

    def make_generator(self, seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
        """`engine.runner.sampler.make_generator` on the fake device (records the seed)."""
        assert torch.device(device) == DEVICE, f"generator asked on {device}, sampling runs on {DEVICE}"
        g = FakeCudaGenerator()
        g.manual_seed(seed if seed is not None else 0)
        self.generators.append((seed, g))
        return g

    def random_weights(self, args, dtype: torch.dtype = torch.bfloat16,
                       device: torch.device | str = "cpu", seed: int = 0,
                       std: float = 0.02) -> dict[str, torch.Tensor]:
        """`engine.model.weights.random_weights` as fake tensors (same names, shapes, dtype)."""
        from engine.model.weights import expected_shapes

        state: dict[str, torch.Tensor] = {}
        for name, shape in expected_shapes(args):
            if name == "output.weight" and args.tie_embeddings:
                state[name] = state["tok_embeddings.weight"]
            else:
                state[name] = torch.empty(shape, dtype=dtype, device=device)
        return state

    def _read(self, method: Callable[..., Any], how: str) -> Callable[..., Any]:
        """`Tensor.tolist` / `Tensor.item` that, on a CUDA tensor, record one device-to-host
        transfer and return `reply(tensor)` (a fake tensor has no values to read)."""
        def read(t: torch.Tensor) -> Any:
            if not _is_cuda(t):
                return method(t)
            self.ledger.transfers.append(Transfer("d2h", t.dtype, t.numel(),
                                                  t.numel() * t.element_size(), False, how))
            return self.reply(t)
        return read

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self.device_bytes - self.live_bytes(), self.device_bytes

    def __enter__(self) -> "FakeCuda":
        import engine.attention as attention
        import engine.runner.builder as builder
        import torch.nn.attention.flex_attention as flex_attention
        from torch._higher_order_ops.flex_attention import flex_attention as flex_op

        if _Ledger not in flex_op.python_key_table:
            # A higher-order op needs a rule per dispatch mode: the ledger's lets it through
            # to the fake mode (which has one) and tracks its output.
            @flex_op.py_impl(_Ledger)
            def _flex_through_ledger(mode: _Ledger, *args: Any, **kwargs: Any) -> Any:
                out = flex_op(*args, **kwargs)
                for t in out:
                    if _is_cuda(t):
                        mode._track(t)
                return out
        import engine.runner.model_runner as model_runner

        stack = contextlib.ExitStack()
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        patch.setattr(torch.cuda, "empty_cache", lambda: None)
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200_CAPABILITY)
        patch.setattr(builder, "random_weights", self.random_weights)
        patch.setattr(model_runner, "make_generator", self.make_generator)
        patch.setattr(builder, "model_from_weights", _model_on_device)
        patch.setattr(attention, "FlexBackend", _eager_flex())
        patch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
        mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
        import safetensors
        patch.setattr(safetensors, "safe_open", _FakeSafeOpen.opener(safetensors.safe_open, mode))
        stack.enter_context(self.ledger)
        patch.setattr(torch, "tensor", _tensor_via_host(torch.tensor))
        # torch's device contexts (`with torch.device(...)`) redirect the constructors they list
        # in a cache filled on first use: filled while `torch.tensor` is the wrapper above, it
        # would leave the real one unredirected for the rest of the process (a `torch.tensor`
        # under `with torch.device("meta")` made on the CPU). Emptied now and on exit.
        device_constructors = torch.utils._device._device_constructors
        device_constructors.cache_clear()
        stack.callback(device_constructors.cache_clear)
        # no fake tensor keeps a real constant: under inference mode `Tensor.to` reaches the fake
        # mode as aten.to, which it would run for real on a one-element constant (CUDA: absent)
        patch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 0)
        patch.setattr(FakeTensor, "tolist", self._read(FakeTensor.tolist, "tolist"))
        patch.setattr(FakeTensor, "item", self._read(FakeTensor.item, "item"))
        # backends are chosen once per process and shape: forget those chosen here on exit
        # (harness-made, e.g. the eager FlexAttention) and any chosen before
        attention._choose.cache_clear()
        stack.callback(attention._choose.cache_clear)
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None


def _tensor_via_host(tensor: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`torch.tensor(data, device="cuda")` as the host tensor then `.to(device)`: what CUDA does
    (a synchronous copy), in steps the fake mode can run (it cannot make a CUDA tensor from
    Python data directly under inference mode) and the ledger records."""
    def make(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            return tensor(data, *args, **kwargs).to(device)
        return tensor(data, *args, device=device, **kwargs)
    return make


class _FakeSafeOpen:
    """`safetensors.safe_open(path, framework="pt")` under the fake mode: the file opened and
    each tensor read outside it, then converted to a fake CPU tensor of the same shape and dtype
    (`FakeTensorMode.from_tensor`)."""

    def __init__(self, handle: Any, mode: FakeTensorMode) -> None:
        self.handle, self.mode = handle, mode

    @classmethod
    def opener(cls, safe_open: Callable[..., Any], mode: FakeTensorMode) -> Callable[..., "_FakeSafeOpen"]:
        def open_(*args: Any, **kwargs: Any) -> "_FakeSafeOpen":
            with fake_tensor.unset_fake_temporarily():
                return cls(safe_open(*args, **kwargs), mode)
        return open_

    def __enter__(self) -> "_FakeSafeOpen":
        with fake_tensor.unset_fake_temporarily():
            self.handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        with fake_tensor.unset_fake_temporarily():
            self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        with fake_tensor.unset_fake_temporarily():
            real = self.handle.get_tensor(name)
        return self.mode.from_tensor(real)


def _model_on_device(args: Any, state: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device | str = "cpu") -> Any:
    """`engine.runner.builder.model_from_weights` without its final `Module.to(device)`: the
    network is built on `device` already (`Transformer.from_state_dict` moves every tensor and
    the RoPE table there), and `Module.to` swaps each fake parameter (`torch.utils.swap_tensors`),
    which refuses a tensor the fake mode's converter still references weakly."""
    from engine.model.transformer import Transformer

    return Transformer.from_state_dict(args, state, dtype, device)


@contextlib.contextmanager
def fake_cuda(**kwargs: Any) -> Iterator[FakeCuda]:
    """`FakeCuda(**kwargs)` entered."""
    with FakeCuda(**kwargs) as fake:
        yield fake
