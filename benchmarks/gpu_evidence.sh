#!/usr/bin/env bash
# ScaleLong and EDM2 evidence on one GPU (benchmarks/gpu_evidence.py). Needs a CUDA machine with PyTorch and this
# checkout only: no installs, no downloads.
# --stage main (the default): the main test of issue 18 at three learning rates x 8 seeds as concurrent
#   processes, and U-ViT-S at the paper's size, Org vs CS, for the remaining minutes; all under 9 minutes
#   (Fashion-MNIST from --data DIR, the idx files, or steadydiff's usual places).
# --stage edge: the edge-of-stability lr-range experiments of issue 28 item 4 at the papers' scale on the
#   CIFAR-10 store (--store DIR, default stores/cifar10): experiments/scalelong-edge-uvit-s2.yaml and
#   scalelong-edge-uvit-s2-d16.yaml (U-ViT-S/2 depth 12 and 16) and experiments/edm2-edge-cifar10.yaml (EDM2 MP
#   UNet vs no MP), side by side. Tens of GPU-hours in all: each call trains for --minutes, stops with a
#   checkpoint, and the same command resumes; the reports land in OUT/edge-NAME/lr_range.md once a file is done.
# --stage all: both at once.
#   bash benchmarks/gpu_evidence.sh [--lrs 5e-4,1e-3,2e-3] [--minutes 9] [--data DIR] [--out DIR]
#   bash benchmarks/gpu_evidence.sh --stage edge --minutes 600 [--store DIR] [--edge-workers 4] [--out DIR]
exec bash "$(dirname "$0")/run_on_cuda.sh" gpu_evidence.py "--tiny --device cpu" "$@"
