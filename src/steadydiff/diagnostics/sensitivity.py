"""Input sensitivity of a noise-prediction backbone f(x) = model(x, t_model, labels).

Two per-sample measures at a point x (batch of B samples, any sample shape):

* `perturbation_ratio`: the finite-difference gain R = ||f(x + d) - f(x)|| / ||d|| for random Gaussian
  directions d of relative size ||d|| = rel_eps ||x||. For a linear f = W x it lies in
  [sigma_min(W), sigma_max(W)], and for f = c x it is |c|.
* `jacobian_spectral_norm`: sigma_max(df/dx), the largest singular value of the per-sample Jacobian, by power
  iteration on J^T J (Jacobian-vector products with `torch.func.jvp`, vector-Jacobian products with
  `torch.func.vjp`).

Both assume that f acts on each sample independently (true for the steadydiff backbones in eval mode: no
batch statistics), so the whole batch is processed at once and the batched Jacobian is block diagonal. The
model is put in eval mode for the measurement and its previous mode is restored afterwards. Norms are
Euclidean over all non-batch dimensions, accumulated in float64 (float32 on MPS), and returned as
detached (B,) tensors of that dtype on x's device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..diffusion.vp import VPSDE
from ..utils.rng import draw_normal

__all__ = ["jacobian_spectral_norm", "perturbation_ratio", "sensitivity_vs_t"]


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _norm(v: Tensor) -> Tensor:
    """Per-sample Euclidean norm over the non-batch dims, shape (B,), in the accumulation dtype."""
    return v.reshape(v.shape[0], -1).to(_acc_dtype(v.device)).norm(dim=1)


def _bcast(s: Tensor, like: Tensor) -> Tensor:
    """A (B,) per-sample scalar as (B, 1, ..., 1) in like's dtype."""
    return s.to(like.dtype).reshape(like.shape[0], *([1] * (like.dim() - 1)))


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def perturbation_ratio(
    model: nn.Module,
    x: Tensor,
    t_model: Tensor,
    labels: Tensor | None = None,
    rel_eps: float = 1e-2,
    n_draws: int = 4,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Mean over `n_draws` Gaussian directions of R_b = ||f(x_b + d_b) - f(x_b)|| / ||d_b||, shape (B,).

    d_b = z_b * rel_eps ||x_b|| / ||z_b|| with z ~ N(0, I) drawn from `generator` (one draw of the batch
    shape per repetition); a sample with x_b = 0 gets ||d_b|| = rel_eps instead. f is evaluated in eval mode
    without gradients; t_model and labels are passed through unchanged.
    """
    if rel_eps <= 0:
        raise ValueError(f"rel_eps must be > 0, got {rel_eps}")
    if n_draws < 1:
        raise ValueError(f"n_draws must be >= 1, got {n_draws}")
    x = x.detach()
    with _eval_mode(model), torch.no_grad():
        fx = model(x, t_model, labels)
        x_norm = _norm(x)
        size = rel_eps * torch.where(x_norm > 0, x_norm, torch.ones_like(x_norm))
        total = torch.zeros_like(x_norm)
        for _ in range(n_draws):
            z = draw_normal(x.shape, generator, x.device, dtype=x.dtype)
            d = z * _bcast(size / _norm(z), z)
            diff = model(x + d, t_model, labels) - fx
            total += _norm(diff) / _norm(d)
    return total / n_draws


LinearOp = Callable[[Tensor], Tensor]


def _linearise(f: Callable[[Tensor], Tensor], x: Tensor) -> tuple[LinearOp, LinearOp, str]:
    """(v -> J v, u -> J^T u, method) for the Jacobian J of f at x (batched: block diagonal).

    Forward mode (`torch.func.jvp`) for J v and one stored `torch.func.vjp` for J^T u. A backbone with an op
    that has no forward-mode derivative falls back to autograd's double-backward trick on one stored graph:
    g(u) = J^T u is linear in u, so J v = d <g(u), v> / du.
    """
    try:
        _, vjp_fn = torch.func.vjp(f, x)

        def jv_func(v: Tensor) -> Tensor:
            return torch.func.jvp(f, (x,), (v,))[1].detach()

        def jtu_func(u: Tensor) -> Tensor:
            return vjp_fn(u)[0].detach()

        jv_func(torch.zeros_like(x))  # probe forward mode once
        return jv_func, jtu_func, "func"
    except (NotImplementedError, RuntimeError):
        pass

    xr = x.detach().requires_grad_(True)
    with torch.enable_grad():
        y = f(xr)
        u0 = torch.zeros_like(y, requires_grad=True)
        (g,) = torch.autograd.grad(y, xr, u0, create_graph=True)

    def jv_autograd(v: Tensor) -> Tensor:
        return torch.autograd.grad(g, u0, v, retain_graph=True)[0].detach()

    def jtu_autograd(u: Tensor) -> Tensor:
        return torch.autograd.grad(y, xr, u, retain_graph=True)[0].detach()

    return jv_autograd, jtu_autograd, "autograd"


def jacobian_spectral_norm(
    model: nn.Module,
    x: Tensor,
    t_model: Tensor,
    labels: Tensor | None = None,
    iters: int = 20,
    generator: torch.Generator | None = None,
) -> Tensor:
    """sigma_max of the per-sample Jacobian J_b = d f(x_b) / d x_b, shape (B,), by power iteration.

    v_0 ~ N(0, I) from `generator`, normalised per sample; then `iters` times v <- J^T J v / ||J^T J v||
    (per sample). The estimate returned is ||J v|| for the final unit v, i.e. the square root of the Rayleigh
    quotient v^T J^T J v: a lower bound on sigma_max whose relative error decays like
    (sigma_2 / sigma_1)^(2 iters). Evaluated in eval mode; the result carries no graph. A sample whose
    J^T J v vanishes (J_b = 0) keeps its previous v and reports 0.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    x = x.detach()

    def f(inp: Tensor) -> Tensor:
        return model(inp, t_model, labels)

    # The math attention kernel: the fused CPU/GPU kernels have no forward-mode or double-backward derivative.
    with _eval_mode(model), sdpa_kernel(SDPBackend.MATH):
        jv, jtu, _ = _linearise(f, x)
        v = draw_normal(x.shape, generator, x.device, dtype=x.dtype)
        v = v / _bcast(_norm(v), v)
        for _ in range(iters):
            w = jtu(jv(v))
            wn = _norm(w)
            nonzero = wn > 0
            w = w / _bcast(torch.where(nonzero, wn, torch.ones_like(wn)), w)
            v = torch.where(_bcast(nonzero, w).bool(), w, v)
        return _norm(jv(v))


def sensitivity_vs_t(
    model: nn.Module,
    sde: VPSDE,
    x0: Tensor,
    ts: Sequence[float],
    labels: Tensor | None = None,
    *,
    method: str = "ratio",
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    rel_eps: float = 1e-2,
    n_draws: int = 4,
    iters: int = 20,
) -> dict[float, float]:
    """{t: batch mean of the chosen measure at x_t = sde.perturb(x0, t, noise), t_model = 999 t}.

    One noise tensor is used for every t: `noise`, or (if None) one N(0, I) draw from `generator` made
    before anything else. `method="ratio"` uses `perturbation_ratio(rel_eps, n_draws)`, `method="jacobian"`
    uses `jacobian_spectral_norm(iters)`; both draw their directions from `generator` after the noise. t is
    float64 for float64 x0 and float32 otherwise.
    """
    if method not in ("ratio", "jacobian"):
        raise ValueError(f"unknown method {method!r}; choose ratio or jacobian")
    x0 = x0.detach()
    if noise is None:
        noise = draw_normal(x0.shape, generator, x0.device, dtype=x0.dtype)
    elif noise.shape != x0.shape:
        raise ValueError(f"noise has shape {tuple(noise.shape)}, x0 has {tuple(x0.shape)}")
    t_dtype = torch.float64 if x0.dtype == torch.float64 else torch.float32
    out: dict[float, float] = {}
    for t in ts:
        tt = torch.full((x0.shape[0],), float(t), dtype=t_dtype, device=x0.device)
        xt = sde.perturb(x0, tt, noise)
        tm = sde.model_time(tt)
        if method == "ratio":
            val = perturbation_ratio(model, xt, tm, labels, rel_eps=rel_eps, n_draws=n_draws, generator=generator)
        else:
            val = jacobian_spectral_norm(model, xt, tm, labels, iters=iters, generator=generator)
        out[float(t)] = float(val.mean())
    return out
