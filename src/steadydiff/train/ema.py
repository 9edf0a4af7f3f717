"""Exponential moving average of the weights, with the usual decay warm-up.

The trainer keeps a list of weight averagers (this EMA, and the power-function EMAs of `train/phema.py`
when train.ema_sigma_rels is set) with one interface: `update(model, step)` after every optimiser step, with
`step` the 1-based number of the step just taken; `state_dict()` and `load_state_dict(state)` for checkpoints
(`train/state.py`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class EMA:
    """theta_ema <- d theta_ema + (1 - d) theta after optimiser step `step` (1-based), with the warm-up
    d = min(decay, step / (9 + step)), i.e. min(decay, (1 + k) / (10 + k)) for the 0-based step k.

    The warm-up keeps early EMA weights from being dominated by the random init. Buffers are copied.
    The EMA copy is kept in eval mode and never trained.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        self.decay = decay
        self.warmup = warmup
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    def decay_at(self, step: int) -> float:
        """The decay applied by the update after optimiser step `step` (1-based)."""
        k = step - 1
        return min(self.decay, (1 + k) / (10 + k)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        d = self.decay_at(step)
        ema_p = list(self.model.parameters())
        src_p = [p.detach() for p in model.parameters()]
        torch._foreach_lerp_(ema_p, src_p, 1.0 - d)
        for b_ema, b in zip(self.model.buffers(), model.buffers()):
            b_ema.copy_(b)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights (the checkpoint's ema.safetensors)."""
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
