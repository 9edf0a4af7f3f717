#!/usr/bin/env bash
# GPU check (benchmarks/gpu_check.py): CUDA vs CPU numerics of a training step, then bf16 images/s, peak
# memory, FLOPs/step and MFU of the main configs, in one table. Under 5 minutes on one GPU.
# Needs a CUDA machine with PyTorch and this checkout only: no installs, no downloads, random data.
#   bash benchmarks/gpu_check.sh [--channels-last] [--compile] [--optimizer fused] [--batch N] ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: error: no CUDA device visible to $PY (torch.cuda.is_available() is False); run this on a" \
         "GPU machine, or try the CPU smoke test: PYTHONPATH=src $PY benchmarks/gpu_check.py --device cpu --tiny" >&2
    exit 2
fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" benchmarks/gpu_check.py --device cuda "$@"
