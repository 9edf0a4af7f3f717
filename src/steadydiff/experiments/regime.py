"""Where an experiment ran, in the terms a paper states its regime in, and which schedules are tied to the
step budget (a "steps to reach X" read off a run whose schedule horizon is its own budget is not what a
shorter run would need)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config, config_value
from ..diffusion import build_formulation
from ..train.momentum import build_momentum
from ..train.schedules import build_lr_schedule
from ..train.timesteps import build_timesteps

# The rows of the regime table, in order, with the labels the report prints.
REGIME_ROWS = {
    "model": "model", "long_skips": "long skips", "depth": "depth", "width": "width", "params": "parameters",
    "optimizer": "optimiser", "lr": "lr", "warmup": "warm-up steps", "schedule": "lr schedule",
    "clipping": "gradient clipping", "batch": "batch", "steps": "steps", "lr_sum": "lr summed over steps",
    "data": "data",
}


def _model_facts(cfg: Config, sample_shape) -> dict[str, Any]:
    from ..nn import build_model

    with torch.device("meta"):  # shapes only: no memory, no init cost
        net = build_model(cfg.model, tuple(sample_shape))
    size = net.describe()  # the backbone's own width and depth
    return {"long_skips": net.num_skips, "width": size["width"], "depth": size["depth"],
            "params": sum(p.numel() for p in net.parameters())}


def lr_sum(cfg: Config) -> float:
    """sum over steps k of the learning rate actually applied: lr x schedule(k) x MDLRC factor(k)."""
    t = cfg.train
    sched, mom = build_lr_schedule(t), build_momentum(cfg)
    return float(sum(t.lr * sched(k) * mom.lr_factor(k) for k in range(t.steps)))


def regime(cfg: Config, sample_shape) -> dict[str, Any]:
    """The regime-table values of one run config."""
    t, m = cfg.train, cfg.model
    skip = m.skip_scaling + (f" kappa {m.kappa}" if m.skip_scaling == "cs" else "")
    return {
        "model": f"{m.backbone} ({skip})", **_model_facts(cfg, sample_shape),
        "optimizer": f"AdamW betas {tuple(t.betas)}, wd {t.weight_decay}", "lr": t.lr, "warmup": t.warmup_steps,
        "schedule": t.lr_schedule, "clipping": "none" if t.grad_clip is None else f"max norm {t.grad_clip}",
        "batch": t.batch_size, "steps": t.steps, "lr_sum": round(lr_sum(cfg), 4),
        "data": f"{cfg.data.name} {list(sample_shape)}" + (f", first {cfg.data.max_items}" if cfg.data.max_items
                                                            else ""),
    }


def tied_horizons(cfg: Config) -> list[str]:
    """The schedules of this config (noise levels, momentum, LR) whose horizon follows train.steps because no
    key of their own sets it (train/schedules.py: the horizon fields)."""
    schedules = (build_timesteps(cfg, build_formulation(cfg.diffusion)), build_momentum(cfg),
                 build_lr_schedule(cfg.train))
    return [s.horizon_name for s in schedules
            if s.horizon is not None and (s.horizon_key is None or config_value(cfg, s.horizon_key) is None)]
