#!/usr/bin/env bash
# ScaleLong evidence on one GPU in one go (benchmarks/gpu_evidence.py): the main test of issue 18 at three
# learning rates x 8 seeds as concurrent processes, and U-ViT-S at the paper's size, Org vs CS, for the
# remaining minutes; all under 9 minutes. Needs a CUDA machine with PyTorch and this checkout only: no installs,
# no downloads (Fashion-MNIST from --data DIR, the idx files, or steadydiff's usual places).
#   bash benchmarks/gpu_evidence.sh [--lrs 5e-4,1e-3,2e-3] [--minutes 9] [--data DIR] [--out DIR]
exec bash "$(dirname "$0")/run_on_cuda.sh" gpu_evidence.py "--tiny --device cpu" "$@"
