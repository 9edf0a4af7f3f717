"""The optimiser and the loss module the training step runs."""

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
