"""Exponential moving average of the weights, with the usual decay warm-up."""

from __future__ import annotations

import copy

import torch
from torch import nn


class EMA:
    """theta_ema <- d_k theta_ema + (1 - d_k) theta, d_k = min(decay, (1 + k) / (10 + k)) with warm-up.

    The warm-up keeps early EMA weights from being dominated by the random init. Buffers are copied.
    The EMA copy is kept in eval mode and never trained.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        self.decay = decay
        self.warmup = warmup
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    def decay_at(self, step: int) -> float:
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        d = self.decay_at(step)
        ema_p = list(self.model.parameters())
        src_p = [p.detach() for p in model.parameters()]
        torch._foreach_lerp_(ema_p, src_p, 1.0 - d)
        for b_ema, b in zip(self.model.buffers(), model.buffers()):
            b_ema.copy_(b)
