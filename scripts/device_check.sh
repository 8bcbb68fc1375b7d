#!/usr/bin/env bash
# The prepared GPU check: the engine on the CUDA device, one JSON out (docs/benchmarks/device.md).
#
#   scripts/device_check.sh [ARGS...]        # ARGS go to `python -m benchmarks.device`
#
# Needs Python with torch (CUDA), numpy, safetensors and tokenizers; nothing is downloaded and no
# model files are read (the model is random-initialised Llama-2-7B in FP16). Writes
# $OUT/device_check.json (./device_check.json without $OUT). When pytest is importable it first
# runs the fake-device check (tests/engine/runner/test_fake_cuda.py, about a minute, on the CPU), and the
# engine's pytest files on the CUDA device too. Sized for well under 8 minutes on an H200; the
# benchmark is stopped at 8.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# pytest for the device, installed beside the code (docs/benchmarks/device.md)
if [ -d build/device-site ]; then PYTHONPATH="$PYTHONPATH:$PWD/build/device-site"; fi
export PYTHONUNBUFFERED=1
extra=()
if "$PYTHON" -c "import pytest, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    extra+=(--pytest)
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
# First the fake-device check (docs/gpu.md, "The CUDA path on a fake device"): the engine's CUDA
# steps, transfers and memory on fake tensors, no device time. A failure stops here, so the loan
# is not spent on a path already known to be inconsistent; GENSERVE_SKIP_FAKE_CHECK=1 skips it.
if [ -z "${GENSERVE_SKIP_FAKE_CHECK:-}" ] && "$PYTHON" -c "import pytest" 2>/dev/null; then
    echo "fake-device check: tests/engine/runner/test_fake_cuda.py"
    if ! timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/engine/runner/test_fake_cuda.py; then
        echo "fake-device check failed; fix it on the CPU first (GENSERVE_SKIP_FAKE_CHECK=1 skips it)" >&2
        exit 1
    fi
fi
exec timeout 480 "$PYTHON" -m benchmarks.device "${extra[@]}" "$@"
