"""Momentum schedules: Adam's beta1 and an LR factor per optimiser step k.

MDLRC (Xu et al., arXiv 2404.07946; reconstruction in shared/papers/clts-mdlrc-notes.md §2): beta1 decays by
the Demon rule (Chen & Kyrillidis 2019)
    beta1(tau) = beta0 (1 - tau) / ((1 - beta0) + beta0 (1 - tau)),   tau = min(1, k / K_m),
floored at `beta_end` (default 0), and the LR is multiplied by (1 - beta0) / (1 - beta1(tau)), so that
lr * (1 - beta1), the weight of each fresh gradient in Adam's step, stays constant. Control arms separate
the two effects: `momentum_decay_only` (no compensation) and `lr_decay_only` (beta1 fixed at beta0, the same
LR factor as mdlrc). The factor multiplies whatever LR schedule is configured; works with Adam and AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..utils.registry import Registry


@dataclass
class MomentumSchedule:
    beta0: float
    decay_beta: bool = False
    compensate_lr: bool = False
    steps: int = 1
    beta_end: float = 0.0
    name: str = "constant"

    def tau(self, step: int) -> float:
        return min(1.0, step / max(1, self.steps))

    def demon_beta1(self, step: int) -> float:
        b0, rest = self.beta0, 1.0 - self.tau(step)
        return max(self.beta_end, b0 * rest / ((1 - b0) + b0 * rest))

    def beta1(self, step: int) -> float:
        return self.demon_beta1(step) if self.decay_beta else self.beta0

    def lr_factor(self, step: int) -> float:
        return (1 - self.beta0) / (1 - self.demon_beta1(step)) if self.compensate_lr else 1.0

    horizon_key = "train.momentum_steps"  # see schedules.py for the horizon fields

    @property
    def horizon(self) -> int | None:
        """K_m, where tau reaches 1 and beta1 / the LR factor stop changing; None when neither changes."""
        return self.steps if self.decay_beta or self.compensate_lr else None

    @property
    def horizon_name(self) -> str:
        return f"{self.name} horizon train.momentum_steps"


# train.momentum -> what decays (beta1 by the Demon rule) and what compensates (the LR).
MOMENTUM_PRESETS = Registry("momentum schedule", key="train.momentum")
MOMENTUM_PRESETS.add("constant", dict(decay_beta=False, compensate_lr=False))
MOMENTUM_PRESETS.add("mdlrc", dict(decay_beta=True, compensate_lr=True))
MOMENTUM_PRESETS.add("momentum_decay_only", dict(decay_beta=True, compensate_lr=False))
MOMENTUM_PRESETS.add("lr_decay_only", dict(decay_beta=False, compensate_lr=True))


def build_momentum(cfg) -> MomentumSchedule:
    """From a Config: train.momentum names a preset; K_m = train.momentum_steps or train.steps."""
    t = cfg.train
    return MomentumSchedule(beta0=t.betas[0], steps=t.momentum_steps or t.steps, beta_end=t.momentum_beta_end,
                            name=t.momentum, **MOMENTUM_PRESETS.choose(t.momentum))
