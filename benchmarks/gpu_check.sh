#!/usr/bin/env bash
# GPU check (benchmarks/gpu_check.py): CUDA vs CPU numerics of a training step, then bf16 images/s, peak
# memory, FLOPs/step and MFU of the main configs, in one table. Under 5 minutes on one GPU.
# Needs a CUDA machine with PyTorch and this checkout only: no installs, no downloads, random data.
#   bash benchmarks/gpu_check.sh [--channels-last] [--compile] [--optimizer fused] [--batch N] ...
exec bash "$(dirname "$0")/run_on_cuda.sh" gpu_check.py "--device cpu --tiny" "$@"
