"""genserve's own CPU kernels, built on first use.

* `engine/kernels/csrc/decode_attention.cpp`: paged decode attention, `torch.ops.genserve.paged_decode`
  (head_dim 64), and `paged_decode_window` (head_dim 64, 128 or 256, bf16 or fp32 pools, another
  score scale, optionally a sliding window: Qwen3's and Gemma 3's layers).
* `engine/kernels/csrc/prefill_attention.cpp`: causal prefill attention of one piece over its paged
  context, `torch.ops.genserve.paged_prefill` (bf16, head_dim 64), and of every piece of a step
  in one call, `paged_prefill_pieces` (the same bits per piece) — where the compiler targets
  AVX512-BF16 (vdpbf16ps) or, without it, AVX2 and FMA (fp32 FMAs); `prefill_kernel_available()`
  says whether this build has it.
* `engine/kernels/csrc/layer_ops.cpp`: the fused per-token steps of a block — `rms_norm`,
  `add_rms_norm_` (residual add + norm), `rope_store_kv` (RoPE on Q and K, K and V written to
  their cache slots), `norm_rope_store_kv` (the same after per-head q/k RMS norms), `silu_mul` and
  `gelu_tanh_mul` — used through `engine.model.layer_ops.KernelLayerOps`.
* `engine/kernels/csrc/packed_linear.cpp`: x @ Wᵀ read from a weight packed in oneDNN's AB16b64a2b layout
  (oneDNN's own copy, bit for bit oneDNN's result, or genserve's `linear.vnni_pack`),
  `torch.ops.genserve.packed_linear` — AVX512-BF16 builds only; `packed_linear_available()` says
  whether this build has it.
* `engine/kernels/csrc/q4_linear.cpp`: x @ Wᵀ read from W's 4-bit Q4_1 blocks of the GGUF (re-interleaved
  at load by `engine.model.quant.q4_pack`), decoded in registers to the bf16 values the bf16 engine
  loads and summed exactly as `packed_linear` sums them, so with `packed_linear`'s bits;
  `torch.ops.genserve.q4_linear` — AVX512-BF16 builds only; `q4_linear_available()` says whether
  this build has it.
* `engine/kernels/csrc/amx_linear.cpp` (AMX builds, `q4_amx_available()`): x @ Wᵀ from W's Q4_1 blocks
  (`torch.ops.genserve.q4_amx_linear`) or Q8_0 blocks (`q8_amx_linear`), re-grouped at load by
  `engine.model.quant.amx_pack`, decoded to the bf16 engine's values and summed with AMX tiles as
  oneDNN's AMX kernel sums, so with its bits.
* `engine/kernels/csrc/int8_linear.cpp`: x @ Wᵀ on int8 arithmetic (`torch.ops.genserve.int8_linear`,
  `engine.model.int8`): per-row quantization, oneDNN's exact int8 sums, fp32 scaling, in one call.
* `engine/kernels/csrc/q4q8_linear.cpp`: x @ Wᵀ from W's Q4_1 blocks (re-grouped at load by
  `engine.model.quant.q4q8_pack`) with x rounded to int8 per row and block of 32 (ggml's Q8_1,
  fused), on exact u8 × s8 integer sums (AVX512-VNNI's vpdpbusd, or AVX2's vpmaddubsw and
  vpmaddwd, the same bits): llama.cpp's arithmetic, not the bf16 engine's bits;
  `torch.ops.genserve.q4q8_linear` — the op always exists but raises where the build targets
  neither; `q4q8_linear_available()` says whether it runs. `--weights q4q8`
  (`engine.model.gguf_blocks.attach_q4q8`) runs every block matrix on it. The same file's
  `torch.ops.genserve.q8q8_linear` takes Q8_0 weights (`engine.model.quant.q8q8_pack`) times the
  same 8-bit rows: llama.cpp's Q8_0 x Q8_0, for the output projection under `--weights q4q8`.
* `engine/kernels/csrc/qk_linear.cpp`: x @ Wᵀ from W's Q4_K and Q6_K blocks (a Q4_K_M GGUF's
  types; re-grouped at load by `engine.model.kquant.q4_k_pack` / `q6_k_pack`, a matrix as row
  segments of one type each) with x rounded to Q8_K inside the call (int8 per row and block of
  256, ggml's `quantize_row_q8_K_ref`), exact integer sums per sub-block scaled in fp32:
  llama.cpp's arithmetic for these types, `torch.ops.genserve.qk_linear`. Every build has its
  three paths (AVX512-VNNI, AVX2, scalar; each compiled with its own target attribute), the best
  one this CPU runs picked at run time (`qk_paths()`; the op's `path` argument or
  GENSERVE_QK_PATH forces one), all with the same bits. `--weights q4q8`
  (`engine.model.gguf_blocks.attach_q4q8`) runs the GGUF's Q4_K / Q6_K matrices on it.
* `engine/kernels/csrc/fma_linear.cpp`: x @ Wᵀ with the bf16 weights in 16-column panels widened to
  fp32 in registers, one fp32 FMA chain over k per output (`torch.ops.genserve.fma_linear`): the
  products on CPUs without bf16 arithmetic (AVX2 alone); built where the compiler targets AVX2
  and FMA, `fma_linear_available()`.
* `engine/kernels/csrc/decode_layers.cpp`: all blocks of a pure-decode step in one call
  (`torch.ops.genserve.decode_layers`), the same ops in the same order as the Python loop.
* `engine/kernels/csrc/lora_delta.cpp`: a step's LoRA deltas on one fused projection in one call
  (`torch.ops.genserve.lora_delta_`: every adapter row's shrink and expand added in place, each
  adapter's matrices read from one buffer, `engine.model.lora.kernel_tables`) — AVX512-BF16 builds
  only; `lora_delta_available()` says whether this build has it. `decode_layers` runs it too.
* `engine/kernels/csrc/greedy.cpp`: greedy sampling's argmax (`torch.ops.genserve.argmax_rows`):
  per row of fp32 logits the first index of its maximum (NaN counting as the maximum), the indices
  `torch.max(x, dim=-1)` gives, in two vectorized passes instead of a scalar loop.

Built with `torch.utils.cpp_extension.load` (g++ and ninja; once per CPU kind and kernel source,
then cached under torch's extension directory, ~/.cache/torch_extensions). Where they cannot be
built (no compiler, another architecture, `GENSERVE_KERNELS=0`), `available()` is False and the
engine runs the same steps as plain torch ops (`TorchLayerOps`) and attention through torch's
fused SDPA; the engine logs which one it runs.

Why each kernel exists, with what it measured against torch's ops: docs/benchmarks/kernels.md.

The kernels are compiled with `-ffast-math`, which lets the compiler reassociate floating-point
sums. Their batch invariance and their bit-equality with oneDNN do not rest on the source order:
they rest on what is checked — the load-time probes (`engine.model.linear.onednn_k_chunk`,
`pack_weights`' checks, `engine.attention.probe`) and the bitwise tests of every kernel against a
batch of one and against oneDNN (tests/engine/kernels/) — and every row's reduction is computed
by one loop whose shape does not depend on the batch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import pathlib
import platform
import sys
import zlib

import torch

log = logging.getLogger(__name__)

SOURCES = [pathlib.Path(__file__).with_name("csrc") / name
           for name in ("decode_attention.cpp", "prefill_attention.cpp", "layer_ops.cpp",
                        "packed_linear.cpp", "q4_linear.cpp", "amx_linear.cpp",
                        "int8_linear.cpp", "q4q8_linear.cpp", "fma_linear.cpp", "decode_layers.cpp",
                        "greedy.cpp", "qk_linear.cpp", "lora_delta.cpp")]
OPS = ("paged_decode", "paged_decode_window", "rms_norm", "add_rms_norm_", "rope_store_kv",
       "norm_rope_store_kv", "silu_mul", "gelu_tanh_mul", "int8_linear",
       "decode_layers", "argmax_rows", "qk_linear", "qk_linear_grouped")
AVX512_BF16_OPS = ("packed_linear", "q4_linear", "lora_delta_")     # built only where the CPU has AVX512-BF16
PREFILL_OPS = ("paged_prefill", "paged_prefill_pieces")   # built where the compiler targets AVX512-BF16, or AVX2 and FMA
AMX_OPS = ("q4_amx_linear", "q8_amx_linear")   # built only where the compiler targets AMX-BF16
FMA_OPS = ("fma_linear",)      # built only where the compiler targets AVX2 and FMA
# q4q8_linear and q8q8_linear are always registered, but raise unless the build targets
# AVX512-VNNI (with AVX512-BF16 and AVX512BW) or AVX2, FMA and F16C: see q4q8_linear_available(), which
# runs a product to find out, when the weights are chosen.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (/proc/cpuinfo's first "flags" line, e.g.
    "avx2", "avx512_bf16", "amx_tile"); empty where that file cannot be read (not Linux)."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in lines
                           if line.startswith("flags")), []))


def put_ninja_on_path() -> None:
    """Put this interpreter's bin directory on PATH (once): ninja, which torch's extension builds
    run, comes from the `ninja` wheel there, and the virtual environment need not be activated.
    Every build of a C++ source here (the kernels, the benchmarks' variants) calls it first."""
    bin_dir = str(pathlib.Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _build_name() -> str:
    """Extension name keyed by this CPU, the kernel code and the checkout: the build uses
    -march=native, and torch's cache is keyed by name, listed sources and flags only, so a home
    directory shared across CPU kinds must not reuse another CPU's binary, nor a build from older
    headers; and torch writes each checkout's absolute source paths into the build's ninja file,
    so two checkouts of the same code sharing one build would rebuild it whenever the other had
    loaded it."""
    cpu = platform.machine()
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
        cpu += "".join(line for line in info.splitlines()
                       if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        cpu += platform.processor()
    # torch keys its cache by the listed sources only; the headers they include count too.
    code = b"".join(f.read_bytes() for f in sorted(SOURCES[0].parent.iterdir()) if f.is_file())
    code += str(SOURCES[0].parent.resolve()).encode()
    return f"genserve_kernels_{zlib.crc32(cpu.encode()):08x}_{zlib.crc32(code):08x}"


def _build_directory(name: str) -> pathlib.Path:
    """Where the extension `name` is built: torch's own place for a CPU build
    ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py<major><minor>_cpu), created."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        cpp_extension.get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    directory = pathlib.Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def build_lock(directory: pathlib.Path):
    """Hold an exclusive lock on `directory`'s build for the `with` body, and clear torch's own
    lock file if a dead process left it.

    torch's `cpp_extension.load` serializes builders with a lock *file* (`directory/lock`) that
    it removes when its build ends; a builder killed mid-build (a timeout, Ctrl-C, the OOM killer)
    leaves it behind and every later load waits for it for ever. The lock here is an `flock` on
    `directory/genserve.flock`, which the kernel releases when its holder dies. Every genserve
    builder takes it first, so while one is held no other genserve builder is running, and a
    `lock` file found then is stale: it is removed (with a warning) before torch looks.

    Raises:
        OSError: the lock file cannot be created.
    """
    with open(directory / "genserve.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)          # waits while another process builds
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels once per process; True if usable.

    Never raises: a failed build is logged and the torch paths are used instead.
    """
    if os.environ.get("GENSERVE_KERNELS", "1") == "0":
        log.info("genserve kernels disabled by GENSERVE_KERNELS=0; using torch ops and SDPA")
        return False
    try:
        from torch.utils import cpp_extension

        put_ninja_on_path()
        name = _build_name()
        directory = _build_directory(name)
        with build_lock(directory):
            cpp_extension.load(name=name, sources=[str(src) for src in SOURCES], extra_cflags=CFLAGS,
                               build_directory=str(directory), is_python_module=False, verbose=False)
        built = [op for op in (*OPS, *AVX512_BF16_OPS, *PREFILL_OPS, *AMX_OPS, *FMA_OPS) if hasattr(torch.ops.genserve, op)]
        log.info("genserve kernels ready: torch.ops.genserve.%s (the 8-bit products q4q8_linear "
                 "and q8q8_linear are probed when the weights are chosen)", ", ".join(built))
        return all(hasattr(torch.ops.genserve, op) for op in OPS)
    except Exception as exc:        # noqa: BLE001 — any build failure means: use the fallback
        log.warning("genserve kernels unavailable (%s: %s); using torch ops and SDPA",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False


@functools.cache
def prefill_kernel_available() -> bool:
    """True if the kernels built and this CPU's build includes `paged_prefill` (the compiler
    targets AVX512-BF16, or AVX2 and FMA)."""
    return available() and hasattr(torch.ops.genserve, "paged_prefill")


@functools.cache
def int8_kv_decode_available() -> bool:
    """True if the kernels built and `paged_decode` reads KV pools in the 8-bit format
    (`engine.attention.kv_quant`): its AVX512-BF16 build only (elsewhere the op raises for them),
    the build that has `packed_linear` (decode_attention.cpp and packed_linear.cpp check the same
    compiler target; `paged_prefill` no longer tells, it has an AVX2 build too). Elsewhere the
    engine reads such pools through SDPA."""
    return packed_linear_available()


@functools.cache
def prefill_kernel_preferred() -> bool:
    """True where prefill pieces should run `paged_prefill` rather than torch's flash attention:
    the kernel is built (`prefill_kernel_available`) and AMX is not usable (`q4_amx_available`).
    Where AMX is usable, torch's CPU flash kernel (its products through oneDNN's brgemm, on the
    AMX tiles) was the faster, 2.2-2.4x per 64-query piece over 512-2,048 keys; without AMX the
    AVX512-BF16 kernel was 4-7x faster than it (docs/benchmarks/kernels.md, the "prefill
    attention" entry), and on an AVX2-only CPU the AVX2 build 1.5-3.4x
    (benchmarks/results/kernels/history.md, "Prefill attention on CPUs with AVX2 alone")."""
    return prefill_kernel_available() and not q4_amx_available()


@functools.cache
def packed_linear_available() -> bool:
    """True if the kernels built and this CPU's build includes `packed_linear` (AVX512-BF16)."""
    return available() and hasattr(torch.ops.genserve, "packed_linear")


def packed_linear_grouped_available() -> bool:
    """True if this build has `packed_linear_grouped` (packed_linear.cpp, AVX512-BF16): several
    weights' products over consecutive row groups in one call (a mixture of experts' step)."""
    return available() and hasattr(torch.ops.genserve, "packed_linear_grouped")


@functools.cache
def lora_delta_available() -> bool:
    """True if the kernels built and this CPU's build includes `lora_delta_` (lora_delta.cpp,
    AVX512-BF16): a step's LoRA deltas on one fused projection in one call."""
    return available() and hasattr(torch.ops.genserve, "lora_delta_")


@functools.cache
def fma_linear_available() -> bool:
    """True if the kernels built and this CPU's build includes `fma_linear` (AVX2 and FMA)."""
    return available() and hasattr(torch.ops.genserve, "fma_linear")


@functools.cache
def q4_linear_available() -> bool:
    """True if the kernels built and this CPU's build includes `q4_linear` (AVX512-BF16)."""
    return available() and hasattr(torch.ops.genserve, "q4_linear")


@functools.cache
def q4_amx_available() -> bool:
    """True if the kernels built with AMX (`q4_amx_linear`) and Linux grants this process the
    AMX tile state (checked with an 1-row product)."""
    if not (q4_linear_available() and hasattr(torch.ops.genserve, "q4_amx_linear")):
        return False
    try:
        torch.ops.genserve.q4_amx_linear(torch.zeros(1, 32, dtype=torch.bfloat16),
                                         torch.zeros(64, 20, dtype=torch.uint8))
    except RuntimeError as exc:
        log.warning("q4_amx_linear unusable (%s); 4-bit products use q4_linear", exc)
        return False
    return True


@functools.cache
def q4q8_linear_available() -> bool:
    """True if the kernels built and `q4q8_linear` runs in this build (the compiler targeted
    AVX512-VNNI, AVX512-BF16 and AVX512BW, or AVX2, FMA and F16C; elsewhere the op exists but
    raises), checked with a 1-row product over zero weights (20 bytes per column and 32 k:
    `engine.model.quant.Q4Q8_BLOCK_BYTES`)."""
    if not available() or not hasattr(torch.ops.genserve, "q4q8_linear"):
        return False
    try:
        torch.ops.genserve.q4q8_linear(torch.zeros(1, 32, dtype=torch.bfloat16),
                                       torch.zeros(32, 20, dtype=torch.uint8), 32)
    except RuntimeError as exc:
        log.info("q4q8_linear unavailable in this build (%s)", str(exc).splitlines()[0])
        return False
    return True


QK_PATH_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}   # `qk_linear`'s `path` argument


@functools.cache
def qk_paths() -> list[int]:
    """The code paths of `torch.ops.genserve.qk_linear` (engine/kernels/csrc/qk_linear.cpp) this
    CPU runs, ascending (0 scalar, 1 AVX2 with FMA and F16C, 2 AVX512-VNNI with BW and VL; each
    build has all three and picks at run time, so every CPU runs the scalar one and an AVX512-VNNI
    CPU all three), each checked with a 1-row product over zero Q4_K weights; empty where the
    kernels did not build."""
    if not available():
        return []
    runs = []
    for path in QK_PATH_NAMES:
        try:
            torch.ops.genserve.qk_linear(torch.zeros(1, 256, dtype=torch.bfloat16),
                                         [torch.zeros(16, 148, dtype=torch.uint8)], [12], path)
        except RuntimeError:
            continue
        runs.append(path)
    return runs
