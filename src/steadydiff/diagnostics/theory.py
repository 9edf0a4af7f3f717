"""Checking the shape of ScaleLong's Theorem 3.1 (Huang et al., NeurIPS 2023) on a backbone at initialisation.

The theorem bounds the hidden feature of the decoder block that consumes long skip i by the input norm
times the energy of the skip coefficients it has seen: with outermost-first indexing (i = 0 is the
outermost long skip, consumed by the LAST decoder block), level i's output depends on the skips
i, i+1, ..., N-1, and the bound has the form

    ||h_i||^2  <~  a ||x_t||^2 S_i + b,        S_i = sum_{j >= i} kappa_j^2.

`theory_fit` measures ||h_i||^2 and ||x_t||^2 on many noised samples and fits that relation by least squares,
so the effect of a skip-scaling method (org: S_i = N - i; CS: S_i <= 1 / (1 - kappa^2)) can be compared with
what the model actually does.

"Decoder level i" is the output of the block that consumes skip i, as the backbone's own `decoder_blocks()`
method lists them (each backbone describes itself; nothing here knows a backbone by class).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..diffusion.vp import VPSDE
from ..utils.rng import draw_normal

__all__ = ["decoder_blocks", "decoder_feature_norms", "skip_energy", "theory_fit"]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The skip-consuming decoder blocks of a backbone, outermost first (block i consumes skip i), as the
    backbone's own `decoder_blocks()` method lists them; checked against its skip count."""
    own = getattr(model, "decoder_blocks", None)
    if not callable(own):
        raise NotImplementedError(
            f"decoder_blocks: {type(model).__name__} has no decoder_blocks() method; give it one returning its "
            "skip-consuming blocks outermost first"
        )
    blocks = list(own())
    n = getattr(model, "num_skips", None)
    if isinstance(n, int) and n != len(blocks):
        raise ValueError(f"{type(model).__name__} has {n} skips but {len(blocks)} decoder blocks")
    return blocks


def _sq_norm(v: Tensor) -> Tensor:
    """Per-sample squared L2 norm over the non-batch dims, (B,), float64 (float32 on MPS)."""
    dt = torch.float32 if v.device.type == "mps" else torch.float64
    return v.detach().reshape(v.shape[0], -1).to(dt).square().sum(dim=1)


def decoder_feature_norms(
    model: nn.Module, x: Tensor, t_model: Tensor, labels: Tensor | None = None
) -> list[Tensor]:
    """[||h_i||^2 for each decoder level i], outermost first; each a (B,) float64 tensor (float32 on MPS).

    h_i is the output of `decoder_blocks(model)[i]` (the block that consumes skip i), captured by forward
    hooks during one forward pass of model(x, t_model, labels) in eval mode without gradients (the previous
    train/eval mode is restored; hooks are always removed). The squared norm is over all non-batch dims
    (for U-ViT: all tokens, time/label tokens included). If a block runs more than once, its last output
    counts.
    """
    blocks = decoder_blocks(model)
    captured: dict[int, Tensor] = {}

    def make_hook(i: int):
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            captured[i] = _sq_norm(out)

        return hook

    handles = [blk.register_forward_hook(make_hook(i)) for i, blk in enumerate(blocks)]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(x, t_model, labels)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [i for i in range(len(blocks)) if i not in captured]
    if missing:
        raise RuntimeError(f"decoder blocks {missing} did not run during the forward pass")
    return [captured[i] for i in range(len(blocks))]


def skip_energy(coeffs: Sequence[float]) -> list[float]:
    """S_i = sum_{j >= i} kappa_j^2 for i = 0..N-1, coefficients outermost first (a reversed cumulative sum)."""
    out: list[float] = []
    acc = 0.0
    for c in reversed([float(c) for c in coeffs]):
        acc += c * c
        out.append(acc)
    return out[::-1]


def _ols(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares y ~ slope x + intercept (float64, closed form) and R^2 = corr(x, y)^2 in [0, 1].

    R^2 = 1 - SS_res / SS_tot, which for least squares with an intercept equals the squared correlation.
    Degenerate cases: constant x gives slope 0, intercept mean(y); constant y gives R^2 = 1 (perfect fit).
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    xm, ym = float(x.mean()), float(y.mean())
    dx, dy = x - xm, y - ym
    sxx, syy, sxy = float(dx @ dx), float(dy @ dy), float(dx @ dy)
    if sxx == 0.0:
        return 0.0, ym, 1.0 if syy == 0.0 else 0.0
    slope = sxy / sxx
    if syy == 0.0:
        return slope, ym - slope * xm, 1.0
    r2 = min(1.0, max(0.0, sxy * sxy / (sxx * syy)))
    return slope, ym - slope * xm, r2


def _batches(x0_batches: Tensor | Iterable[Any]) -> Iterable[Any]:
    return [x0_batches] if isinstance(x0_batches, Tensor) else x0_batches


def theory_fit(
    model: nn.Module,
    sde: VPSDE,
    x0_batches: Tensor | Iterable[Tensor | tuple[Tensor, Tensor | None]],
    n_samples: int,
    generator: torch.Generator | None = None,
    *,
    coeffs: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Fit ||h_i||^2 = a ||x_t||^2 S_i + b over all (sample, level) pairs; per level, ||h_i||^2 = a_i ||x_t||^2 + b_i.

    Data: `x0_batches` is one tensor (re-used, with fresh t and noise, until `n_samples` are drawn) or an
    iterable of tensors or (x0, labels) pairs (a list is cycled; a one-shot iterator is consumed once and may
    yield fewer than n_samples). For each batch, in this order from `generator`: t ~ U(t_eps, 1)
    (`sde.sample_t`; float64 for float64 x0), noise ~ N(0, I); x_t = sde.perturb(x0, t, noise); the last
    batch is truncated to reach exactly n_samples. ||x_t||^2 and ||h_i||^2 (`decoder_feature_norms` at
    t_model = 999 t) are per-sample squared L2 norms.

    S_i = `skip_energy(coeffs)`, where `coeffs` defaults to `model.skip_scaling.coefficients()` read after the
    last batch (so LS gates report their mean on that batch), or all ones without a scaling object.

    Returns a dict with python floats / lists of floats:
      slope, intercept, r2          the joint fit (a, b, R^2) over n * N pairs, in float64;
      level_slope, level_intercept, level_r2   the per-level fits (a_i, b_i, R^2_i) against ||x_t||^2;
      level_mean_norm_sq            mean_n ||h_i||^2 per level (outermost first);
      mean_xt_norm_sq, coefficients, skip_energy, n_samples, num_levels.
    R^2 = 1 - SS_res / SS_tot of a least-squares fit with intercept, always in [0, 1].
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    xt_sq: list[np.ndarray] = []
    h_sq: list[np.ndarray] = []
    collected = 0
    batches = _batches(x0_batches)
    while collected < n_samples:
        progressed = False
        for item in batches:
            x0, labels = (item if isinstance(item, (tuple, list)) else (item, None))
            take = min(x0.shape[0], n_samples - collected)
            if take <= 0:
                continue
            x0 = x0[:take]
            labels = labels[:take] if labels is not None else None
            t = sde.sample_t(take, generator, x0.device)
            if x0.dtype == torch.float64:
                t = t.to(torch.float64)
            noise = draw_normal(x0.shape, generator, x0.device, dtype=x0.dtype)
            xt = sde.perturb(x0, t, noise)
            norms = decoder_feature_norms(model, xt, sde.model_time(t), labels)
            xt_sq.append(_sq_norm(xt).cpu().double().numpy())
            h_sq.append(torch.stack(norms, dim=1).cpu().double().numpy())
            collected += take
            progressed = True
            if collected >= n_samples:
                break
        if not progressed:
            break
    if collected == 0:
        raise ValueError("theory_fit: x0_batches yielded no samples")

    xs = np.concatenate(xt_sq)  # (n,)
    hs = np.concatenate(h_sq, axis=0)  # (n, N)
    num_levels = hs.shape[1]
    if coeffs is None:
        scaling = getattr(model, "skip_scaling", None)
        coeffs = [1.0] * num_levels if scaling is None else scaling.coefficients()
    coeffs = [float(c) for c in coeffs]
    if len(coeffs) != num_levels:
        raise ValueError(f"{len(coeffs)} skip coefficients for {num_levels} decoder levels")
    if not all(math.isfinite(c) for c in coeffs):
        raise ValueError(f"skip coefficients must be finite, got {coeffs}")
    energy = skip_energy(coeffs)

    design = (xs[:, None] * np.asarray(energy)[None, :]).reshape(-1)
    slope, intercept, r2 = _ols(design, hs.reshape(-1))
    level_fits = [_ols(xs, hs[:, i]) for i in range(num_levels)]
    return {
        "slope": slope,
        "intercept": intercept,
        "r2": r2,
        "level_slope": [f[0] for f in level_fits],
        "level_intercept": [f[1] for f in level_fits],
        "level_r2": [f[2] for f in level_fits],
        "level_mean_norm_sq": [float(v) for v in hs.mean(axis=0)],
        "mean_xt_norm_sq": float(xs.mean()),
        "coefficients": coeffs,
        "skip_energy": energy,
        "n_samples": int(collected),
        "num_levels": int(num_levels),
    }
