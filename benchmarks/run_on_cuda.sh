#!/usr/bin/env bash
# Runs benchmarks/SCRIPT.py --device cuda ARGS..., or, when no CUDA device is visible, exits 2 with one line
# naming the script's CPU smoke test. Used by gpu_check.sh and gpu_evidence.sh.
#   bash benchmarks/run_on_cuda.sh SCRIPT.py "CPU SMOKE-TEST ARGS" [ARGS ...]
set -euo pipefail
cd "$(dirname "$0")/.."
script="$1"; smoke="$2"; shift 2
PY="${PYTHON:-python}"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "${script%.py}: error: no CUDA device visible to $PY (torch.cuda.is_available() is False); run this on a" \
         "GPU machine, or try the CPU smoke test: PYTHONPATH=src $PY benchmarks/$script $smoke" >&2
    exit 2
fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" "benchmarks/$script" --device cuda "$@"
