"""Distributed data parallel under `torchrun`: process group, rank bookkeeping, and replica checks.

`steadydiff train` joins a process group by itself when the launcher's environment says there is more than
one process (WORLD_SIZE > 1, with RANK, LOCAL_RANK, MASTER_ADDR/PORT set by torchrun). The backend follows
the training device: NCCL for CUDA (each process drives the GPU LOCAL_RANK), gloo for CPU.

The division of labour (see `Trainer`):
- every rank draws the whole global batch's data indices, flips, noise levels and noise from the same
  (seed, step) generators and takes its contiguous slice, so the trajectory does not depend on the number
  of processes (beyond the order of floating-point reductions);
- gradients are averaged by DDP; the logged loss is all-reduced;
- rank 0 alone writes files (checkpoints, metrics.jsonl, curves, samples, post-hoc EMA snapshots); the
  other ranks wait for it at a barrier after each checkpoint;
- the periodic evaluation is shared: each rank draws its chunks of the samples and extracts their
  features, rank 0 gathers them (`gather_to_main`) and computes the metrics.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError

# Rank 0 alone computes the eval metrics (and, the first time, their reference statistics) while the others
# wait in a collective; the default NCCL timeout (10 minutes) is too short for that. Override with
# STEADYDIFF_DIST_TIMEOUT (seconds).
DEFAULT_TIMEOUT_S = 3600


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: `world_size` 1 means no process group (plain single-process training)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # True when steadydiff created the group (and must destroy it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer; launch with torchrun") from e


def init_distributed(device: torch.device) -> tuple[DistInfo, torch.device]:
    """Join (or reuse) the process group when WORLD_SIZE > 1; returns the rank info and the device to use
    (CUDA: `cuda:LOCAL_RANK`)."""
    if dist.is_available() and dist.is_initialized():  # the caller set it up: use it, leave it to them
        info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), False)
        return info, _rank_device(device, info)
    world = env_world_size()
    if world <= 1:
        return DistInfo(), device
    if not dist.is_available():
        raise ConfigError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed; run one process")
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} are not set; launch with torchrun "
                          "(e.g. torchrun --nproc_per_node=2 -m steadydiff.cli train ...)")
    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]), True)
    device = _rank_device(device, info)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds each communicator to the current device
    timeout = datetime.timedelta(seconds=float(os.environ.get("STEADYDIFF_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)))
    # After a worker failure, torchrun --max-restarts starts a new attempt against the same agent store; the
    # old attempt's keys (e.g. gloo's peer addresses) are still in it, so a bare env:// init can try to reach
    # a dead peer ("connectFullMesh failed ... Connection refused"). Keys prefixed by the attempt keep the
    # attempts apart.
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", info.rank, world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"steadydiff/attempt-{attempt}", store),
                            rank=info.rank, world_size=world, timeout=timeout)
    return info, device


def _rank_device(device: torch.device, info: DistInfo) -> torch.device:
    if device.type != "cuda" or info.world_size <= 1:
        return device
    if info.local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={info.local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                          "visible; use --nproc_per_node <= the GPU count")
    return torch.device("cuda", info.local_rank)


def shutdown_distributed(info: DistInfo) -> None:
    """Destroy the process group if steadydiff created it."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if not info.enabled:
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])  # no guessing which GPU the barrier uses
    else:
        dist.barrier()


@contextmanager
def local_main_first(info: DistInfo):
    """The first process of each node runs the body first (e.g. a dataset download into the node's cache),
    the others after it: no two processes fetch the same file at once."""
    if info.enabled and info.local_rank != 0:
        barrier(info)
    yield
    if info.enabled and info.local_rank == 0:
        barrier(info)


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if not info.enabled:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / info.world_size


def all_reduce_sum(value: float, info: DistInfo, device: torch.device) -> float:
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t)


def gather_to_main(obj: Any, info: DistInfo) -> list[Any] | None:
    """Every rank's `obj` (picklable; CPU tensors) as a list in rank order on rank 0, None on the others.

    Pickled, so meant for modest payloads such as evaluation features (n x d floats), not model weights.
    """
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def same_on_all_ranks(value: int, info: DistInfo, device: torch.device) -> bool:
    """Whether every rank passed the same integer (one all-reduce of (max, -min); every rank gets the answer)."""
    if not info.enabled:
        return True
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0]) == -int(t[1])


def fingerprint(module: torch.nn.Module) -> torch.Tensor:
    """Per-tensor float64 (sum, sum of squares, weighted sum) of every parameter and buffer: equal across
    replicas in sync, and changed by any single-element difference (the weighted sum sees swaps too)."""
    rows = []
    for t in list(module.parameters()) + list(module.buffers()):
        v = t.detach().reshape(-1).double()
        w = torch.arange(1, v.numel() + 1, device=v.device, dtype=torch.float64).mul_(1.0 / max(v.numel(), 1))
        rows.append(torch.stack([v.sum(), v.square().sum(), (v * w).sum()]))
    return torch.stack(rows) if rows else torch.zeros(1, 3, dtype=torch.float64)


def check_replicas_in_sync(module: torch.nn.Module, info: DistInfo, device: torch.device) -> None:
    """Raise if any rank's weights differ from rank 0's (a desynchronised run would train garbage silently).

    One small all-gather of per-tensor fingerprints; run at checkpoints, where it also acts as the barrier.
    """
    if not info.enabled:
        return
    fp = fingerprint(module).to(device)
    gathered = [torch.empty_like(fp) for _ in range(info.world_size)]
    dist.all_gather(gathered, fp)
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if bad:
        raise RuntimeError(f"model replicas diverged: rank(s) {bad} hold weights different from rank 0's; this is a "
                           "steadydiff bug (please report it with the config)")
