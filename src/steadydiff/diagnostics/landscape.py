"""Loss-landscape probes and sample consistency.

* `interpolate_loss`: the loss along the straight line between two weight states (Goodfellow et al. 2015,
  "Qualitatively characterizing neural network optimization problems").
* `top_hessian_eigenvalue`: the dominant Hessian eigenvalue (sharpness) by power iteration on exact
  Hessian-vector products (Pearlmutter 1994, double backward).
* `consistency_score`: how much two sample sets generated from the same noise tape agree pair-wise, relative
  to unpaired samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from steadydiff.diffusion.vp import draw_normal

__all__ = ["consistency_score", "interpolate_loss", "top_hessian_eigenvalue"]

DEFAULT_ALPHAS = tuple(round(-0.5 + 0.1 * i, 12) for i in range(21))  # linspace(-0.5, 1.5, 21)


def _interpolated_state(
    model: nn.Module,
    state_a: Mapping[str, Tensor],
    state_b: Mapping[str, Tensor],
    alpha: float,
    interpolate_buffers: bool,
) -> dict[str, Tensor]:
    param_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    out: dict[str, Tensor] = {}
    for key, a in state_a.items():
        interp = a.is_floating_point() and (interpolate_buffers or key in param_names)
        if not interp:
            out[key] = a
            continue
        if key not in state_b:
            raise KeyError(f"state_b has no entry {key!r} (present in state_a)")
        b = state_b[key].to(device=a.device)
        if b.shape != a.shape:
            raise ValueError(f"{key}: state_a has shape {tuple(a.shape)}, state_b has {tuple(b.shape)}")
        work = torch.promote_types(a.dtype, torch.float32)
        out[key] = ((1.0 - alpha) * a.to(work) + alpha * b.to(work)).to(a.dtype)
    return out


def interpolate_loss(
    model: nn.Module,
    state_a: Mapping[str, Tensor],
    state_b: Mapping[str, Tensor],
    loss_fn: Callable[[nn.Module], Tensor | float],
    alphas: Sequence[float] | None = None,
    *,
    interpolate_buffers: bool = False,
) -> list[float]:
    """[loss_fn(model with weights (1 - alpha) a + alpha b) for alpha in alphas] as python floats.

    `alphas` defaults to linspace(-0.5, 1.5, 21). For every entry of `state_a`: floating-point PARAMETERS are
    interpolated, (1 - alpha) a + alpha b, computed in at least float32 and stored in a's dtype; every other
    entry (integer tensors, and buffers such as BatchNorm running statistics unless
    `interpolate_buffers=True`, in which case floating buffers are interpolated too) is copied from a.
    Each state is loaded with `load_state_dict(strict=True)`, so `state_a` must be a full state dict of the
    model. `loss_fn(model)` is called under `torch.no_grad()` without changing the model's train/eval mode.
    The model's own state (a copy taken on entry) is loaded back afterwards, also if loss_fn raises.
    """
    alphas = DEFAULT_ALPHAS if alphas is None else alphas
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses: list[float] = []
    try:
        with torch.no_grad():
            for alpha in alphas:
                model.load_state_dict(
                    _interpolated_state(model, state_a, state_b, float(alpha), interpolate_buffers), strict=True
                )
                val = loss_fn(model)
                losses.append(float(val.detach()) if isinstance(val, Tensor) else float(val))
    finally:
        model.load_state_dict(original, strict=True)
    return losses


def top_hessian_eigenvalue(
    loss_fn: Callable[[], Tensor],
    params: Sequence[Tensor],
    iters: int = 30,
    generator: torch.Generator | None = None,
) -> float:
    """The eigenvalue of largest MAGNITUDE of the Hessian of loss_fn() w.r.t. `params` (signed).

    Power iteration on Hessian-vector products H v = d/dp <d loss / dp, v> (one graph of the gradient built
    with `create_graph=True`, then one backward per iteration). v_0 ~ N(0, I) from `generator` (one draw per
    parameter, in order), normalised jointly over all parameters; `iters` times v <- H v / ||H v||; the
    result is the Rayleigh quotient v^T H v of the final unit v, so it carries the sign of the dominant
    eigenvalue (power iteration converges to the largest |eigenvalue|, like (|lambda_2| / |lambda_1|)^iters for
    the vector and twice that rate for the quotient). If the two largest |eigenvalues| are equal with opposite
    signs, v does not converge and the quotient is meaningless. Parameters the loss does not depend on have
    a zero Hessian block. `loss_fn` takes no arguments and returns a scalar tensor; it is called once.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    params = list(params)
    if not params:
        raise ValueError("params is empty")
    with torch.enable_grad():
        loss = loss_fn()
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        grads = torch.autograd.grad(loss.reshape(()), params, create_graph=True, allow_unused=True)
    live = [(p, g) for p, g in zip(params, grads) if g is not None and g.requires_grad]
    if not live:
        return 0.0  # the gradient does not depend on the parameters: H = 0
    ps = [p for p, _ in live]
    gs = [g for _, g in live]

    def hvp(vs: list[Tensor]) -> list[Tensor]:
        hv = torch.autograd.grad(gs, ps, grad_outputs=vs, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if h is None else h.detach() for p, h in zip(ps, hv)]

    def dot(xs: list[Tensor], ys: list[Tensor]) -> float:
        return math.fsum(float((a.double() * b.double()).sum()) for a, b in zip(xs, ys))

    # Draw for every parameter (also unused ones) so the draws do not depend on which parameters are live.
    draws = {id(p): draw_normal(p.shape, generator, p.device, dtype=p.dtype) for p in params}
    v = [draws[id(p)] for p in ps]
    nv = math.sqrt(dot(v, v))
    v = [x / nv for x in v]
    for _ in range(iters):
        w = hvp(v)
        nw = math.sqrt(dot(w, w))
        if nw == 0.0:
            return 0.0  # v lies in the null space (or H = 0 on the live parameters)
        v = [x / nw for x in w]
    return dot(v, hvp(v))


def consistency_score(samples_a: Tensor, samples_b: Tensor) -> float:
    """1 - mean_i ||a_i - b_i|| / mean_{i != j} ||a_i - b_j||, samples flattened per row (float64).

    Row i of both sets must come from the same noise x_T. The score is 1 when the paired samples are identical,
    about 0 when the pairing carries no information (the paired distance is then a typical distance between
    unrelated samples), and negative when paired samples are further apart than unpaired ones. Needs N >= 2
    rows; costs N^2 distances. If every unpaired distance is 0 the score is 1 when the paired ones are 0 too,
    else nan.
    """
    if samples_a.shape != samples_b.shape:
        raise ValueError(f"sample sets differ in shape: {tuple(samples_a.shape)} vs {tuple(samples_b.shape)}")
    n = samples_a.shape[0]
    if n < 2:
        raise ValueError(f"consistency_score needs at least 2 samples, got {n}")
    dt = torch.float32 if samples_a.device.type == "mps" else torch.float64
    a = samples_a.detach().reshape(n, -1).to(dt)
    b = samples_b.detach().reshape(n, -1).to(device=a.device, dtype=dt)
    paired = (a - b).norm(dim=1).mean()
    dist = torch.cdist(a.unsqueeze(0), b.unsqueeze(0), compute_mode="donot_use_mm_for_euclid_dist")[0]
    cross = (dist.sum() - dist.diagonal().sum()) / (n * (n - 1))
    if float(cross) == 0.0:
        return 1.0 if float(paired) == 0.0 else math.nan
    return float(1.0 - paired / cross)
