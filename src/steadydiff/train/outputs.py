"""What the training loop writes besides checkpoints: the metrics.jsonl record of a log window, sample grids,
and the periodic evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..diagnostics.base import RunContext
from ..diffusion import generate, steps_for_nfe
from ..utils.images import save_samples
from .state import StepResult
from .timesteps import level_histogram


def log_record(step: int, window: list[StepResult], optimizer: torch.optim.Optimizer, flops: dict[str, float],
               n_img: int, dt: float, batch_size: int, nonfinite, model: torch.nn.Module) -> dict[str, Any]:
    """The metrics.jsonl record averaging the steps of `window` (the steps since the last record): mean loss and
    gradient norm over the steps that updated (a skipped step has no finite loss), the LR and beta1 applied,
    the noise-level histogram, throughput and MFU, the non-finite counters and the skip coefficients."""
    good = [r for r in window if not r.skipped]
    group = optimizer.param_groups[0]
    rec = {
        "step": step,
        "loss": sum(r.loss for r in good) / len(good) if good else None,
        "grad_norm": sum(r.grad_norm for r in good) / len(good) if good else None,
        "lr": group["lr"],
        "beta1": group["betas"][0],
        "level_hist": level_histogram([r.levels for r in good if r.levels is not None]),
        "images_per_sec": n_img / dt if dt > 0 else float("nan"),
    }
    if flops["flops_per_step"] and dt > 0:  # achieved FLOP/s over the peak of all processes
        rec["mfu"] = flops["flops_per_step"] * (n_img // batch_size) / dt / flops["peak_flops"]
    rec.update(nonfinite.log_fields())
    scaling = getattr(model, "skip_scaling", None)
    if scaling is not None:
        rec["skip_coeffs"] = [round(c, 6) for c in scaling.coefficients()]
    return rec


def write_sample_grid(x: torch.Tensor, run_dir: Path, step: int, dataset) -> Path:
    """RUN/samples/step-NNNNNNN.png; toy points are drawn over the data."""
    ref = dataset.items_range(0, len(dataset)) if x.ndim == 2 else None
    path = Path(run_dir) / "samples" / f"step-{step:07d}.png"
    save_samples(x, path, reference=ref)
    return path


@torch.no_grad()
def sample_run(ctx: RunContext, n: int, sampler: str, steps: int, seed: int, use_ema: bool = True,
               decode=None) -> torch.Tensor:
    """`n` samples of the run's EMA (or raw) model with the run's class cycling and clipping."""
    cfg = ctx.cfg
    return generate(ctx.ema_model if use_ema else ctx.model, ctx.formulation, ctx.dataset.sample_shape, n, sampler,
                    steps, seed, ctx.device, cfg.model.num_classes, clip=cfg.train.sample_clip, decode=decode)


def periodic_eval(ctx: RunContext, dist_info, decode=None) -> dict[str, float]:
    """Quick eval of the EMA weights (train.eval_metrics on train.eval_n samples), keys `eval/<metric>` at
    train.sample_steps, and `eval/<metric>@nfe<N>` for each budget N of train.eval_nfe, at the most steps of
    train.sample_sampler within N network evaluations (`diffusion.steps_for_nfe`), all from the same seed.
    Collective under DDP: every rank draws its share of the samples; rank 0 gets the metrics, others {}."""
    from ..metrics.evaluate import evaluate

    t = ctx.cfg.train

    def run(steps: int) -> dict[str, float]:
        return evaluate(ctx.ema_model, ctx.formulation, ctx.cfg, ctx.dataset, t.eval_metrics, t.eval_n,
                        t.sample_sampler, steps, seed=t.seed, device=ctx.device, clip=t.sample_clip,
                        batch=t.eval_batch, dist_info=dist_info, decode=decode)

    out = {f"eval/{k}": v for k, v in run(t.sample_steps).items()}
    for nfe in t.eval_nfe:
        steps = steps_for_nfe(ctx.formulation.kind, t.sample_sampler, nfe)
        out.update({f"eval/{k}@nfe{nfe}": v for k, v in run(steps).items()})
    return out
