"""Fault injection for tests and soak runs (train.fault_*): a wrapper around the trainer's forward-backward
pass that poisons the loss or one gradient entry at chosen steps. It is installed only when faults are
configured, so the training step itself carries no fault code."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def with_faults(forward_backward: Callable[..., torch.Tensor], model: nn.Module, t) -> Callable[..., torch.Tensor]:
    """`forward_backward(k, ...) -> mean loss`, poisoned as the TrainConfig `t` asks: at each step of
    `t.fault_steps` the loss (fault_where=loss) or the first gradient entry (fault_where=grad) becomes
    `t.fault_kind` (nan / inf); `t.fault_nan_at_step` makes the loss NaN. Unchanged when no fault is set."""
    loss_faults = {k: float(t.fault_kind) for k in t.fault_steps if t.fault_where == "loss"}
    grad_faults = {k: float(t.fault_kind) for k in t.fault_steps if t.fault_where == "grad"}
    if t.fault_nan_at_step is not None:
        loss_faults.setdefault(t.fault_nan_at_step, float("nan"))
    if not loss_faults and not grad_faults:
        return forward_backward

    def faulty(k: int, *args) -> torch.Tensor:
        loss = forward_backward(k, *args)
        if k in grad_faults:
            g = next(p.grad for p in model.parameters() if p.grad is not None)
            g.view(-1)[0] = grad_faults[k]
        return loss * loss_faults[k] if k in loss_faults else loss

    return faulty
