"""Power-function EMA and post-hoc EMA reconstruction (EDM2: Karras et al. 2024, arXiv 2312.02696, App. C).

Written from the paper's formulas. Summary of the maths (t is training time, gamma > 0 the exponent):

* Power-function average: ``theta_hat(t) = (gamma+1)/t^(gamma+1) * int_0^t tau^gamma theta(tau) dtau``, i.e.
  the response (weight profile) ``p_{t,gamma}(tau) = (gamma+1) tau^gamma / t^(gamma+1)`` on ``[0, t]``.
  Its relative width is ``sigma_rel = sqrt((gamma+1) / ((gamma+2)^2 (gamma+3)))`` (Eq. 123), always below
  ``1/sqrt(12) ~ 0.2887``.
* Incremental form (Eq. 127): ``theta_hat <- beta theta_hat + (1-beta) theta``, ``beta = (1 - dt/t)^(gamma+1)``.
  **Time is counted in optimiser steps here** (the k-th update happens at t = k, dt = 1), whereas the official
  code counts images (t = k * batch, dt = batch). With a constant batch size the two are identical, because
  beta only depends on dt/t and sigma_rel is relative to the training length.
* Post-hoc reconstruction: a target profile ``p_r`` is approximated by ``sum_i x_i p_i`` over stored snapshot
  profiles by least squares on ``int (p* - p_r)^2``; the Gram matrix has the closed form Eq. 151
  (:func:`profile_inner`). Coefficients are applied to the stored averaged parameters.

Public API: :func:`sigma_rel_to_gamma`, :func:`gamma_to_sigma_rel`, :func:`power_ema_beta`,
:func:`profile_inner`, :func:`solve_phema`, :class:`PowerEMA`, :class:`Snapshot`, :func:`list_snapshots`,
:func:`reconstruct`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ..config import SIGMA_REL_MAX  # 1/sqrt(12), the supremum of sigma_rel (Eq. 123)
from ..utils.errors import SteadydiffError
from ..utils.io import atomic_write

__all__ = [
    "SIGMA_REL_MAX", "PowerEMA", "Snapshot", "gamma_to_sigma_rel", "list_snapshots", "power_ema_beta",
    "profile_inner", "reconstruct", "sigma_rel_to_gamma", "snapshot_name", "solve_phema",
]


_NAME_RE = re.compile(r"^phema-(\d+)-(\d+(?:\.\d+)?)\.safetensors$")
_FORMAT = "steadydiff-phema-1"


# ----------------------------------------------------------------------------------------------------------
# Scalar maths (float64)
# ----------------------------------------------------------------------------------------------------------

def gamma_to_sigma_rel(gamma: float) -> float:
    """Relative standard deviation of the power-function profile with exponent ``gamma >= 0`` (Eq. 123)."""
    g = float(gamma)
    if not (math.isfinite(g) and g >= 0):
        raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
    return math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3)))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """Exponent gamma of the power-function EMA with relative width ``sigma_rel`` (inverse of Eq. 123).

    gamma is the largest real root of ``g^3 + 7 g^2 + (16 - s^-2) g + (12 - s^-2) = 0`` (Eq. 126), refined
    with Newton steps. Valid for ``0 < sigma_rel < 1/sqrt(12) ~ 0.2887``; ValueError otherwise.
    """
    s = float(sigma_rel)
    if not (math.isfinite(s) and 0.0 < s < SIGMA_REL_MAX):
        raise ValueError(f"sigma_rel must lie in the open interval (0, {SIGMA_REL_MAX:.4f}) i.e. (0, 1/sqrt(12)), "
                         f"got {sigma_rel!r}")
    c = s ** -2
    coeffs = [1.0, 7.0, 16.0 - c, 12.0 - c]
    roots = np.roots(coeffs)
    real = roots[np.abs(roots.imag) <= 1e-7 * np.maximum(1.0, np.abs(roots))].real
    g = float(real.max())
    for _ in range(3):  # Newton polish on the cubic (simple root, so this only removes eigenvalue round-off)
        f = ((g + 7.0) * g + (16.0 - c)) * g + (12.0 - c)
        df = (3.0 * g + 14.0) * g + (16.0 - c)
        if df == 0.0:
            break
        g -= f / df
    if not g > 0:  # cannot happen for s in range; guard against silent nonsense
        raise ValueError(f"no positive gamma for sigma_rel={sigma_rel!r}")
    return g


def power_ema_beta(step: int, gamma: float, dt: int = 1) -> float:
    """EMA decay for the update that brings time to ``step``: ``beta = (1 - dt/step)^(gamma+1)`` (Eq. 127).

    Time is measured in optimiser steps: the k-th update happens at ``t = k`` with ``dt = 1`` (the official code
    uses images, ``t = k * batch``, ``dt = batch``: the same beta for a constant batch size). The first update
    (``step == dt``) has beta = 0, so the average starts at the current weights and the initial weights get zero
    weight. ``dt`` > 1 is for updates made only every ``dt`` steps.
    """
    t, d, g = int(step), int(dt), float(gamma)
    if t != step or d != dt or d < 1 or t < d:
        raise ValueError(f"need integers step >= dt >= 1, got step={step!r}, dt={dt!r}")
    if not (math.isfinite(g) and g >= 0):
        raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
    return (1.0 - d / t) ** (g + 1.0)


def _inner(t_a, g_a, t_b, g_b) -> np.ndarray:
    """Vectorised Eq. 151 (broadcasting); every input must already be positive / >= 0 float64."""
    t_a, g_a, t_b, g_b = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (t_a, g_a, t_b, g_b)))
    a_first = t_a <= t_b
    t_lo = np.where(a_first, t_a, t_b)
    t_hi = np.where(a_first, t_b, t_a)
    g_hi = np.where(a_first, g_b, g_a)  # exponent belongs to the profile that ends later
    # ratio form: (t_lo/t_hi)^g_hi <= 1 never overflows (t^gamma for t ~ 1e9 images and gamma ~ 100 would)
    return (g_a + 1.0) * (g_b + 1.0) * (t_lo / t_hi) ** g_hi / ((g_a + g_b + 1.0) * t_hi)


def profile_inner(t_a: float, g_a: float, t_b: float, g_b: float) -> float:
    """``<p_a, p_b> = int_0^inf p_{t_a,g_a}(tau) p_{t_b,g_b}(tau) dtau`` in closed form (Eq. 151).

    For ``t_a <= t_b``: ``(g_a+1)(g_b+1) (t_a/t_b)^g_b / ((g_a+g_b+1) t_b)``; the other order swaps the roles.
    Symmetric in (a, b); written with the ratio of times so it cannot overflow.
    """
    for name, t in (("t_a", t_a), ("t_b", t_b)):
        if not (math.isfinite(float(t)) and float(t) > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {t!r}")
    for name, g in (("g_a", g_a), ("g_b", g_b)):
        if not (math.isfinite(float(g)) and float(g) >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {g!r}")
    return float(_inner(t_a, g_a, t_b, g_b))


def solve_phema(in_times: Sequence[float], in_gammas: Sequence[float], out_times: Sequence[float],
                out_gammas: Sequence[float]) -> np.ndarray:
    """Least-squares post-hoc EMA coefficients, shape ``(n_in, n_out)`` (Eqs. 128-151, Algorithm 3).

    Column r minimises ``int (sum_i x_ir p_i - p_r)^2`` over the inputs usable for target r, i.e. those with
    ``0 < t_i <= t_r`` (the others get coefficient exactly 0, as in the paper: a snapshot from after the target
    time cannot be used). The normal equations ``A x = b`` (``A_ij = <p_i, p_j>``, ``b_i = <p_i, p_r>``) are
    solved in float64 (A is ill-conditioned, coefficients alternate in sign) and each column is then divided by
    its sum so the coefficients sum to exactly 1 (the reconstruction of a constant trajectory is exact).
    Identical duplicate inputs make A singular; then the minimum-norm least-squares solution is used.
    Raises ValueError when a target has no usable input.
    """
    ti = np.asarray(in_times, dtype=np.float64).reshape(-1)
    gi = np.asarray(in_gammas, dtype=np.float64).reshape(-1)
    tr = np.asarray(out_times, dtype=np.float64).reshape(-1)
    gr = np.asarray(out_gammas, dtype=np.float64).reshape(-1)
    if ti.shape != gi.shape or tr.shape != gr.shape:
        raise ValueError(f"times and gammas must have equal lengths: in {ti.shape} vs {gi.shape}, "
                         f"out {tr.shape} vs {gr.shape}")
    if not (np.all(np.isfinite(ti)) and np.all(np.isfinite(gi)) and np.all(gi >= 0)):
        raise ValueError("input times must be finite and input gammas finite and >= 0")
    if not (np.all(np.isfinite(tr)) and np.all(tr > 0) and np.all(np.isfinite(gr)) and np.all(gr >= 0)):
        raise ValueError("target times must be finite and > 0, target gammas finite and >= 0")
    x = np.zeros((ti.size, tr.size), dtype=np.float64)
    for r in range(tr.size):
        use = np.flatnonzero((ti > 0) & (ti <= tr[r]))
        if use.size == 0:
            raise ValueError(f"target (t={tr[r]:g}, gamma={gr[r]:g}) has no usable input (need 0 < t_i <= t_r)")
        t, g = ti[use], gi[use]
        a = _inner(t[:, None], g[:, None], t[None, :], g[None, :])
        b = _inner(t, g, tr[r], gr[r])
        try:
            sol = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            sol = np.linalg.lstsq(a, b, rcond=None)[0]
        total = sol.sum()
        if not (np.all(np.isfinite(sol)) and np.isfinite(total) and total != 0):
            raise ValueError(f"post-hoc EMA system for target (t={tr[r]:g}, gamma={gr[r]:g}) is degenerate")
        x[use, r] = sol / total
    return x


# ----------------------------------------------------------------------------------------------------------
# Tracking EMAs during training
# ----------------------------------------------------------------------------------------------------------

def snapshot_name(step: int, sigma_rel: float) -> str:
    """File name of one snapshot: ``phema-{step:09d}-{sigma_rel:.3f}.safetensors``."""
    return f"phema-{int(step):09d}-{float(sigma_rel):.3f}.safetensors"


class PowerEMA:
    """Several power-function EMAs of a model's floating-point parameters, updated after each optimiser step.

    Each EMA is a dict ``name -> tensor`` (not a module copy) with dtype at least float32 (float32 for
    fp16/bf16/fp32 parameters, float64 kept for float64 parameters), on the parameter's device. **Buffers are not
    averaged**: pass the live model's buffers to :meth:`snapshot` (or copy them yourself) when exporting.
    Time is counted in optimiser steps (see :func:`power_ema_beta`); ``update(model, step)`` is called with the
    1-based number of the optimiser step just taken. Keep the step count continuous across resumes
    (sigma_rel is relative to the time since step 0).
    """

    def __init__(self, model: nn.Module, sigma_rels: Iterable[float] = (0.05, 0.10),
                 snapshot_dir: str | os.PathLike | None = None, snapshot_every: int = 0):
        self.sigma_rels: tuple[float, ...] = tuple(float(s) for s in sigma_rels)
        if not self.sigma_rels:
            raise ValueError("need at least one sigma_rel")
        if len({f"{s:.3f}" for s in self.sigma_rels}) != len(self.sigma_rels):
            raise ValueError(f"sigma_rels must be distinct at 3 decimals (file names use {{:.3f}}): {self.sigma_rels}")
        self.gammas: tuple[float, ...] = tuple(sigma_rel_to_gamma(s) for s in self.sigma_rels)
        self.names: list[str] = [n for n, p in model.named_parameters() if p.is_floating_point()]
        if not self.names:
            raise ValueError("model has no floating-point parameters")
        params = dict(model.named_parameters())
        self.emas: list[dict[str, torch.Tensor]] = [
            {n: params[n].detach().to(dtype=_ema_dtype(params[n].dtype), copy=True) for n in self.names}
            for _ in self.sigma_rels
        ]
        self.step = 0
        # With a directory: `update` also writes snapshots every `snapshot_every` steps (the trainer's way).
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir)
        self.snapshot_every = snapshot_every

    # -- training ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Fold the current parameters in: ``theta_hat <- beta theta_hat + (1 - beta) theta`` for every EMA.

        ``step`` is the 1-based index of the optimiser step just taken and must increase; consecutive calls use
        ``beta = power_ema_beta(step, gamma)``; a gap (updates every k steps) uses ``dt = step - previous step``.
        With a ``snapshot_dir``, every ``snapshot_every``-th step also writes a snapshot (with the model's
        persistent buffers).
        """
        step = int(step)
        if step <= self.step:
            raise ValueError(f"step must increase: got {step} after {self.step}")
        params = dict(model.named_parameters())
        missing = [n for n in self.names if n not in params]
        if missing:
            raise KeyError(f"model lacks tracked parameters: {missing[:5]}")
        first = self.emas[0]
        src = [params[n].detach() for n in self.names]
        src = [s if s.dtype == first[n].dtype and s.device == first[n].device else s.to(first[n])
               for s, n in zip(src, self.names)]
        dt = step - self.step
        for ema, gamma in zip(self.emas, self.gammas):
            beta = power_ema_beta(step, gamma, dt)
            torch._foreach_lerp_([ema[n] for n in self.names], src, 1.0 - beta)
        self.step = step
        if self.snapshot_dir is not None and self.snapshot_every and step % self.snapshot_every == 0:
            sd = model.state_dict()  # persistent buffers only: what load_state_dict expects
            self.snapshot(self.snapshot_dir, step, {k: b for k, b in model.named_buffers() if k in sd})

    # -- access ----------------------------------------------------------------------------------------------
    def _index(self, sigma_rel: float) -> int:
        for i, s in enumerate(self.sigma_rels):
            if math.isclose(s, float(sigma_rel), rel_tol=0, abs_tol=5e-7):
                return i
        raise KeyError(f"sigma_rel {sigma_rel!r} is not tracked (tracked: {self.sigma_rels})")

    def averaged(self, sigma_rel: float) -> dict[str, torch.Tensor]:
        """The EMA with this sigma_rel: ``{parameter name: tensor}`` (parameters only; the live tensors)."""
        return self.emas[self._index(sigma_rel)]

    def state_dict(self) -> dict:
        """Plain tensors and python numbers only, loadable with ``torch.load(..., weights_only=True)``."""
        return {"format": _FORMAT, "sigma_rels": list(self.sigma_rels), "gammas": list(self.gammas),
                "step": self.step, "names": list(self.names), "emas": [dict(e) for e in self.emas]}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict` (same sigma_rels and parameter names); values copied exactly."""
        sig = [float(s) for s in state["sigma_rels"]]
        if len(sig) != len(self.sigma_rels) or any(not math.isclose(a, b, rel_tol=0, abs_tol=1e-12)
                                                   for a, b in zip(sig, self.sigma_rels)):
            raise ValueError(f"state has sigma_rels {sig}, this PowerEMA tracks {list(self.sigma_rels)}")
        if list(state["names"]) != self.names:
            raise ValueError("state was saved for a model with different parameter names")
        emas = state["emas"]
        for ema, saved in zip(self.emas, emas):
            for n in self.names:
                if saved[n].shape != ema[n].shape:
                    raise ValueError(f"shape mismatch for {n}: saved {tuple(saved[n].shape)}, "
                                     f"model {tuple(ema[n].shape)}")
        for ema, saved in zip(self.emas, emas):
            for n in self.names:
                ema[n].copy_(saved[n])
        self.step = int(state["step"])

    # -- export ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, directory: str | os.PathLike, step: int, buffers: Mapping[str, torch.Tensor] | None = None,
                 dtype: torch.dtype = torch.float16) -> list[Path]:
        """Write one safetensors file per EMA, ``phema-{step:09d}-{sigma_rel:.3f}.safetensors``; return the paths.

        Contents: the averaged parameters and the given ``buffers`` (e.g. ``dict(model.named_buffers())``), floating
        tensors cast to ``dtype`` (fp16 by default). Metadata: ``step``, ``sigma_rel``, ``gamma`` (as strings) and
        the JSON list of buffer names. Each file is written atomically (`utils.io.atomic_write`: a temporary name,
        fsync, rename), so readers never see a partial file and a crash never leaves one.
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        buffers = dict(buffers or {})
        clash = sorted(set(buffers) & set(self.names))
        if clash:
            raise ValueError(f"buffer names collide with parameter names: {clash[:5]}")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        buf = {n: _export(b, dtype).clone() for n, b in buffers.items()}
        paths = []
        for sigma_rel, gamma, ema in zip(self.sigma_rels, self.gammas, self.emas):
            tensors = {n: _export(ema[n], dtype) for n in self.names}
            tensors.update(buf)
            meta = {"format": _FORMAT, "step": str(step), "sigma_rel": repr(sigma_rel), "gamma": repr(gamma),
                    "buffers": json.dumps(sorted(buf))}
            path = directory / snapshot_name(step, sigma_rel)
            atomic_write(path, lambda p, tensors=tensors, meta=meta: save_file(tensors, str(p), metadata=meta))
            paths.append(path)
        return paths


def _ema_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _export(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach()
    if t.is_floating_point():
        t = t.to(dtype=dtype)
    return t.to("cpu").contiguous()


# ----------------------------------------------------------------------------------------------------------
# Reading snapshots and reconstructing
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Snapshot:
    """One stored EMA snapshot file."""

    path: Path
    step: int
    sigma_rel: float
    gamma: float


class SnapshotError(SteadydiffError):
    """A post-hoc EMA snapshot file is unreadable; the message names it and the fix."""


@contextlib.contextmanager
def _open_snapshot(path: Path):
    """safe_open(path), with a damaged file (truncated by a full disk, overwritten) as one `SnapshotError`."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (OSError, SafetensorError) as e:
        raise SnapshotError(f"post-hoc EMA snapshot {path} is unreadable ({e}); delete it (the reconstruction "
                            "then uses the other snapshots) or retrain to regenerate it") from e


def list_snapshots(directory: str | os.PathLike) -> list[Snapshot]:
    """All ``phema-*.safetensors`` files in ``directory``, sorted by (step, sigma_rel).

    step / sigma_rel / gamma come from the file metadata, falling back to the file name (and gamma computed from
    sigma_rel) when a field is missing. Temporary files of interrupted writes are ignored.
    """
    out = []
    for path in Path(directory).iterdir():
        m = _NAME_RE.match(path.name)
        if m is None or not path.is_file():
            continue
        with _open_snapshot(path) as f:
            meta = f.metadata() or {}
        step = int(meta["step"]) if "step" in meta else int(m.group(1))
        sigma_rel = float(meta["sigma_rel"]) if "sigma_rel" in meta else float(m.group(2))
        gamma = float(meta["gamma"]) if "gamma" in meta else sigma_rel_to_gamma(sigma_rel)
        out.append(Snapshot(path=path, step=step, sigma_rel=sigma_rel, gamma=gamma))
    out.sort(key=lambda s: (s.step, s.sigma_rel, s.path.name))
    return out


def _buffer_names(meta: Mapping[str, str] | None) -> set[str]:
    if meta and "buffers" in meta:
        return set(json.loads(meta["buffers"]))
    return set()


def reconstruct(snapshots: Sequence[Snapshot] | str | os.PathLike, targets: Iterable[tuple[int, float]],
                batch_size: int = 8) -> Iterator[tuple[tuple[int, float], dict[str, torch.Tensor]]]:
    """Post-hoc EMA: yield ``((step, sigma_rel), state_dict)`` for every target, in the order given.

    Coefficients come from :func:`solve_phema` with times = snapshot steps and the snapshots' gammas (snapshots at
    step 0 or after a target's step get coefficient 0). The weights are then **streamed**: targets are processed
    in batches of ``batch_size``; per batch every snapshot file with a non-zero coefficient is opened once and read
    one tensor at a time, accumulating ``sum_i x_i theta_i`` in float32. Peak memory is ``batch_size`` float32
    model copies plus one tensor, independent of the number of snapshots. Buffers are copied from the latest
    usable snapshot (largest step <= target step). Yielded tensors are float32 (non-float buffers keep their
    dtype). ``snapshots`` may also be a directory (see :func:`list_snapshots`).
    """
    if isinstance(snapshots, (str, os.PathLike)):
        snapshots = list_snapshots(snapshots)
    snaps = list(snapshots)
    tgts = [(int(s), float(r)) for s, r in targets]
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not snaps:
        raise ValueError("no snapshots given")
    if not tgts:
        return
    x = solve_phema([s.step for s in snaps], [s.gamma for s in snaps],
                    [t for t, _ in tgts], [sigma_rel_to_gamma(r) for _, r in tgts])
    for lo in range(0, len(tgts), batch_size):
        cols = list(range(lo, min(lo + batch_size, len(tgts))))
        # snapshot providing the buffers for each target: the latest usable one
        buf_src = {}
        for c in cols:
            best, best_key = -1, None
            for i, s in enumerate(snaps):
                key = (s.step, bool(x[i, c] != 0))
                if 0 < s.step <= tgts[c][0] and (best_key is None or key > best_key):
                    best, best_key = i, key
            buf_src[c] = best
        acc: list[dict[str, torch.Tensor] | None] = [None] * len(cols)
        bufs: list[dict[str, torch.Tensor]] = [{} for _ in cols]
        keys: set[str] | None = None
        for i, snap in enumerate(snaps):
            coef = [float(x[i, c]) for c in cols]
            needs_buf = [j for j, c in enumerate(cols) if buf_src[c] == i]
            if all(v == 0.0 for v in coef) and not needs_buf:
                continue
            with _open_snapshot(snap.path) as f:
                bnames = _buffer_names(f.metadata())
                names = list(f.keys())
                pnames = [n for n in names if n not in bnames]
                if keys is None:
                    keys = set(pnames)
                elif set(pnames) != keys:
                    raise ValueError(f"{snap.path.name}: parameter names differ from the other snapshots")
                for n in names:
                    is_buf = n in bnames
                    if is_buf and not needs_buf:
                        continue
                    if not is_buf and all(v == 0.0 for v in coef):
                        continue
                    t = f.get_tensor(n)
                    if is_buf:
                        b = t.float() if t.is_floating_point() else t
                        for j in needs_buf:
                            bufs[j][n] = b.clone()
                        continue
                    for j, v in enumerate(coef):
                        if v == 0.0:
                            continue
                        if acc[j] is None:
                            acc[j] = {}
                        a = acc[j].get(n)
                        if a is None:
                            acc[j][n] = a = torch.zeros(t.shape, dtype=torch.float32)
                        elif a.shape != t.shape:
                            raise ValueError(f"{snap.path.name}: shape of {n} {tuple(t.shape)} differs from "
                                             f"{tuple(a.shape)}")
                        a.add_(t, alpha=v)
                    del t
        for j, c in enumerate(cols):
            state = acc[j] or {}
            acc[j] = None
            state.update(bufs[j])
            bufs[j] = {}
            yield tgts[c], state
