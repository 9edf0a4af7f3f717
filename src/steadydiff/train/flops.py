"""FLOP accounting and model FLOP utilisation (MFU).

`count_train_flops` runs one training step's forward and backward (the formulation's loss at the global
batch) under `torch.utils.flop_counter.FlopCounterMode` on a copy of the model whose tensors live on the
`meta` device: shapes only, so it costs no compute and no memory however large the batch, and the real
model (and its EDM2 forced weight normalisation, which rewrites weights in training mode) is untouched.
FlopCounterMode counts matrix multiplies, convolutions and attention (2 FLOPs per multiply-add); element-wise
work, normalisation and the optimiser are not counted, which is the usual MFU convention. With activation
checkpointing the recomputed forward is counted too (hardware FLOPs rather than model FLOPs).

`measure_peak_flops` times a square matmul in the training dtype for ~0.2 s: the achievable dense matmul
rate of this device, not its datasheet peak. MFU against it answers "how far is the step from the matmul
roofline of this machine"; pass `train.peak_flops` (per device, FLOP/s) to report MFU against a datasheet
number instead (e.g. 989e12 for an H100 SXM in bf16).
"""

from __future__ import annotations

import copy
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

_PEAK_CACHE: dict[tuple[str, torch.dtype], float] = {}


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are meta tensors (the real storage is never duplicated)."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def count_train_flops(model: nn.Module, formulation, cfg, sample_shape: tuple[int, ...],
                      batch: int | None = None) -> int:
    """FLOPs of one training step (forward + backward of the loss over `batch` samples; default: the
    configured global batch `cfg.train.batch_size`). bf16 autocast does not change the count.

    Raises RuntimeError when the model cannot run on meta tensors (e.g. it reads tensor values in forward).
    """
    b = int(batch if batch is not None else cfg.train.batch_size)
    meta = _meta_copy(model).train()
    x = torch.empty((b, *sample_shape), device="meta")
    t = torch.empty((b,), device="meta").uniform_(0.1, 0.9)
    noise = torch.empty_like(x)
    labels = torch.zeros((b,), dtype=torch.long, device="meta") if cfg.model.num_classes else None
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            loss = formulation.loss(meta, x, labels, t=t, noise=noise).float().mean()
            loss.backward()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise RuntimeError(f"cannot count FLOPs of {type(model).__name__} on meta tensors ({e})") from e
    return int(counter.get_total_flops())


def measure_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       seconds: float = 0.2, n: int | None = None) -> float:
    """Achievable dense matmul FLOP/s of `device` in `dtype`: n x n @ n x n repeated for ~`seconds`.

    Cached per (device, dtype) for the process: a run measures once, however many trainers it builds.
    """
    device = torch.device(device)
    key = (str(device), dtype)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b  # warm-up: kernel selection, lazy initialisation
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        if reps % 4 == 0 or device.type != "cuda":  # sync rarely on GPUs: launches are asynchronous
            sync()
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
    peak = 2.0 * n**3 * reps / dt
    _PEAK_CACHE[key] = peak
    return peak


def format_flops(x: float) -> str:
    """1.23e12 -> '1.23 TFLOP'."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}FLOP"
    return f"{x:.3g} FLOP"




def bf16_slowdown(device: torch.device | str) -> str | None:
    """One line when bf16 matmuls are slower than fp32 ones on `device` (both measured now), else None.

    bf16 autocast pays on GPUs and on CPUs with native bf16 (AVX-512 BF16, AMX); on a CPU without it (e.g. AMD
    Zen 3, AVX2 only) PyTorch emulates the bf16 matmul and the demo UNet trained ~10x slower than in fp32
    (7.1 vs 72.6 images/s, issue 30). The line gives both measured rates and the fix."""
    fp32, bf16 = measure_peak_flops(device, torch.float32), measure_peak_flops(device, torch.bfloat16)
    if bf16 >= fp32:
        return None
    return (f"train.bf16: on this {torch.device(device).type} a bf16 matmul runs at {format_flops(bf16)}/s against "
            f"{format_flops(fp32)}/s in fp32 (measured now), so bf16 autocast makes training ~{fp32 / bf16:.1f}x "
            "slower here; set train.bf16=false (bf16 pays on GPUs and on CPUs with AVX-512 BF16 or AMX)")


def flop_report(model: nn.Module, formulation, cfg, sample_shape: tuple[int, ...], dist_info,
                device: torch.device) -> dict[str, float]:
    """{"flops_per_step": training FLOPs of one step at the global batch (0 when the model cannot be counted;
    counted on rank 0 only), "peak_flops": peak FLOP/s of all processes together}.

    The peak is train.peak_flops x processes, or else each rank's measured matmul rate summed over ranks
    (measured concurrently, so processes sharing one CPU share its peak). Collective under DDP. With
    train.bf16 on a device where bf16 is slower than fp32, rank 0 prints one warning line (`bf16_slowdown`).
    """
    from ..utils.distributed import all_reduce_sum

    t = cfg.train
    flops = 0
    if dist_info.is_main:
        try:
            flops = count_train_flops(model, formulation, cfg, sample_shape)
        except RuntimeError as e:
            warnings.warn(f"no FLOP count, so no MFU in the log: {e}", stacklevel=2)
    if t.peak_flops:
        peak = t.peak_flops * dist_info.world_size
    else:
        peak = all_reduce_sum(measure_peak_flops(device, torch.bfloat16 if t.bf16 else torch.float32), dist_info,
                              device)
    if t.bf16 and dist_info.is_main:
        slow = bf16_slowdown(device)
        if slow:
            print(f"steadydiff: warning: {slow}", file=sys.stderr, flush=True)
    return {"flops_per_step": float(flops), "peak_flops": float(peak)}


__all__ = ["bf16_slowdown", "count_train_flops", "flop_report", "format_flops", "measure_peak_flops"]
