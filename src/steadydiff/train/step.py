"""The pieces a training step runs: the optimiser, and the loss module wrapped for DDP and torch.compile."""

from __future__ import annotations

import torch
from torch import nn

from ..utils.errors import ConfigError


def build_optimizer(params, t, device: torch.device) -> torch.optim.AdamW:
    """AdamW with the kernel train.optimizer_impl asks for: auto (PyTorch's default choice), foreach
    (multi-tensor), fused (one kernel per step; CUDA, and CPU in PyTorch >= 2.4) or plain (a Python loop)."""
    kw = {"auto": {}, "foreach": {"foreach": True}, "plain": {"foreach": False}, "fused": {"fused": True}}
    try:
        return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                 **kw[t.optimizer_impl])
    except (RuntimeError, ValueError) as e:  # e.g. fused on a device this PyTorch has no fused kernel for
        raise ConfigError(f"train.optimizer_impl={t.optimizer_impl} is not available on {device.type} with "
                          f"torch {torch.__version__} ({e}); use auto or foreach") from e


class TrainLoss(nn.Module):
    """The per-sample training loss as one module, so that DDP and torch.compile wrap all parameter use of a
    step (the backbone and, for EDM, the learned u(sigma)) inside a single forward."""

    def __init__(self, model: nn.Module, formulation):
        super().__init__()
        self.model = model
        self.formulation = formulation

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None, t: torch.Tensor,
                noise: torch.Tensor) -> torch.Tensor:
        return self.formulation.loss(self.model, x, labels, t=t, noise=noise)


def wrap_loss_module(loss_module: TrainLoss, dist_info, device: torch.device, compile: bool):
    """(the callable a training step runs, the DDP module or None): the loss module, wrapped in DDP under
    torchrun and/or in torch.compile."""
    ddp, forward = None, loss_module
    if dist_info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        # Broadcasts rank 0's weights once here; afterwards DDP averages gradients in backward.
        ddp = forward = DistributedDataParallel(loss_module,
                                                device_ids=[device.index] if device.type == "cuda" else None)
    if compile:
        # Compiling the DDP module lets Dynamo split the graph at DDP's gradient buckets, so the all-reduce
        # still overlaps the backward.
        forward = torch.compile(forward)
    return forward, ddp
