"""Sample-set distances: Frechet distance, KID, improved precision/recall, RBF MMD, sliced Wasserstein.

All functions take feature sets as (N, D) torch tensors or numpy arrays and compute in float64 (except
`precision_recall`, whose distance dtype is selectable). Feature extraction (Inception, a fixed random map,
raw pixels, ...) is the caller's business; these functions only compare two sets of vectors.

- `gaussian_stats` / `frechet_distance` / `fd_from_features`: the Frechet (2-Wasserstein) distance between
  Gaussians fitted to the two sets -- FID when the features are Inception pool3 (Heusel et al. 2017,
  "GANs Trained by a Two Time-Scale Update Rule Converge to a Local Nash Equilibrium").
- `kid`: Kernel Inception Distance, the unbiased MMD^2 with a cubic polynomial kernel averaged over random
  subsets (Binkowski et al. 2018, "Demystifying MMD GANs").
- `precision_recall`: improved precision and recall from k-NN-ball manifold estimates
  (Kynkaanniemi et al. 2019, "Improved Precision and Recall Metric for Assessing Generative Models").
- `mmd_rbf`: unbiased MMD^2 with a sum of Gaussian kernels, for low-dimensional sets such as toy2d
  (Gretton et al. 2012, "A Kernel Two-Sample Test").
- `sliced_wasserstein`: sliced 2-Wasserstein distance for low-dimensional sets.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

ArrayLike = Tensor | np.ndarray

#: Default `mmd_rbf` bandwidths (kernel standard deviations). toy2d sets are normalised to about unit std,
#: and their finest structure (an `8gaussians` mode) has std ~0.05, so the scales run from the mode width to
#: twice the data scale; summing kernels over this range keeps the test sensitive both to mode shape and to
#: where the mass sits, without having to tune one bandwidth (the "multi-scale" choice of Li et al. 2017,
#: "MMD GAN"). Rescale them with the data if the sets are not about unit scale.
DEFAULT_RBF_BANDWIDTHS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


def _as_2d(x: ArrayLike, name: str, dtype: torch.dtype = torch.float64) -> Tensor:
    """A (N, D) CPU tensor of `dtype` from a tensor or array; raises ValueError on other shapes or non-finite values."""
    t = torch.as_tensor(np.asarray(x)) if isinstance(x, np.ndarray) else torch.as_tensor(x)
    if t.ndim != 2:
        raise ValueError(f"{name}: expected an (N, D) feature set, got shape {tuple(t.shape)}")
    t = t.detach().to(device="cpu", dtype=dtype)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: features contain NaN or inf")
    return t


def _as_np(x: ArrayLike) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------------------------------------
# Frechet distance (Heusel et al. 2017)


def gaussian_stats(features: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and covariance (D, D) of an (N, D) feature set, float64 numpy.

    The covariance is the unbiased sample covariance (ddof=1, divisor N - 1), as in pytorch-fid
    (`np.cov(act, rowvar=False)`) and torchmetrics' `FrechetInceptionDistance` (sum of outer products minus
    N mu mu^T, divided by N - 1), so FD values computed from these statistics match both.
    """
    f = _as_2d(features, "features").numpy()
    if f.shape[0] < 2:
        raise ValueError(f"features: need at least 2 samples for a covariance, got {f.shape[0]}")
    mu = f.mean(axis=0)
    centred = f - mu
    sigma = centred.T @ centred / (f.shape[0] - 1)
    return mu, sigma


def _psd_sqrt(s: np.ndarray) -> np.ndarray:
    """Symmetric PSD square root via eigh, with eigenvalues clipped at 0 (absorbs round-off on singular S)."""
    w, v = np.linalg.eigh(s)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(mu1: ArrayLike, sigma1: ArrayLike, mu2: ArrayLike, sigma2: ArrayLike) -> float:
    """Frechet distance ||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1 S2)^{1/2}) between N(mu1, S1) and N(mu2, S2).

    Computed in float64. tr((S1 S2)^{1/2}) is the sum of square roots of the eigenvalues of S1 S2, which are
    those of the symmetric PSD matrix S1^{1/2} S2 S1^{1/2} (S1 S2 = S1^{1/2} (S1^{1/2} S2 S1^{1/2}) S1^{-1/2}
    when S1 is invertible, and AB, BA share their nonzero spectrum otherwise). Both the square root of S1
    and that spectrum come from symmetric eigendecompositions (`numpy.linalg.eigh`) with eigenvalues clipped
    at 0, so the result is real, needs no scipy `sqrtm` and no diagonal offset, and stays finite for singular
    covariances (e.g. fewer samples than dimensions). Round-off can leave a tiny negative total; the result
    is clipped at 0, since the distance is a squared 2-Wasserstein distance (Heusel et al. 2017).
    """
    mu1, mu2 = _as_np(mu1).reshape(-1), _as_np(mu2).reshape(-1)
    s1, s2 = np.atleast_2d(_as_np(sigma1)), np.atleast_2d(_as_np(sigma2))
    d = mu1.shape[0]
    if mu2.shape != (d,) or s1.shape != (d, d) or s2.shape != (d, d):
        raise ValueError(
            f"frechet_distance: shape mismatch mu1 {mu1.shape}, sigma1 {s1.shape}, mu2 {mu2.shape}, sigma2 {s2.shape}"
        )
    for name, a in (("mu1", mu1), ("sigma1", s1), ("mu2", mu2), ("sigma2", s2)):
        if not np.isfinite(a).all():
            raise ValueError(f"frechet_distance: {name} contains NaN or inf")
    s1, s2 = (s1 + s1.T) / 2, (s2 + s2.T) / 2
    r1 = _psd_sqrt(s1)
    m = r1 @ s2 @ r1
    eig = np.linalg.eigvalsh((m + m.T) / 2)
    tr_covmean = float(np.sqrt(np.clip(eig, 0.0, None)).sum())
    diff = mu1 - mu2
    fd = float(diff @ diff) + float(np.trace(s1)) + float(np.trace(s2)) - 2.0 * tr_covmean
    return max(fd, 0.0)


def fd_from_features(a: ArrayLike, b: ArrayLike) -> float:
    """Frechet distance between Gaussians fitted (`gaussian_stats`) to the (N, D) feature sets `a` and `b`."""
    mu1, s1 = gaussian_stats(a)
    mu2, s2 = gaussian_stats(b)
    return frechet_distance(mu1, s1, mu2, s2)


# ---------------------------------------------------------------------------------------------------------
# Kernel distances (Binkowski et al. 2018; Gretton et al. 2012)


def _unbiased_mmd2(kxx: Tensor, kyy: Tensor, kxy: Tensor) -> float:
    """Unbiased MMD^2 estimate from the three Gram matrices (diagonals of kxx and kyy excluded)."""
    m, n = kxx.shape[0], kyy.shape[0]
    xx = (kxx.sum() - kxx.diagonal().sum()) / (m * (m - 1))
    yy = (kyy.sum() - kyy.diagonal().sum()) / (n * (n - 1))
    return float(xx + yy - 2.0 * kxy.mean())


def kid(
    a: ArrayLike,
    b: ArrayLike,
    subsets: int = 100,
    subset_size: int = 1000,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> tuple[float, float]:
    """Kernel Inception Distance between (N, D) feature sets: (mean, std) of the unbiased MMD^2 over subsets.

    Kernel k(x, y) = (x.y / D + 1)^3 (Binkowski et al. 2018). Each of `subsets` rounds draws `m` rows of `a`
    and `m` rows of `b` without replacement, m = min(subset_size, len(a), len(b)), and computes the unbiased
    MMD^2 (which may be slightly negative). The std is the population std (ddof=0) across rounds, as in
    torchmetrics' `KernelInceptionDistance`; the standard error of the mean is roughly std / sqrt(subsets)
    (rounds overlap, so this is approximate). Subsets come from `generator` if given, else from a fresh
    generator seeded with `seed` (default 0), so results are reproducible. Computed in float64.
    """
    x, y = _as_2d(a, "a"), _as_2d(b, "b")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"kid: feature dims differ: {x.shape[1]} vs {y.shape[1]}")
    m = min(subset_size, x.shape[0], y.shape[0])
    if m < 2:
        raise ValueError(f"kid: need subsets of at least 2 samples, got {m}")
    if subsets < 1:
        raise ValueError(f"kid: subsets must be >= 1, got {subsets}")
    if generator is None:
        generator = torch.Generator().manual_seed(0 if seed is None else seed)
    d = x.shape[1]
    scores = torch.empty(subsets, dtype=torch.float64)
    for i in range(subsets):
        xs = x[torch.randperm(x.shape[0], generator=generator)[:m]]
        ys = y[torch.randperm(y.shape[0], generator=generator)[:m]]
        kxx = (xs @ xs.T / d + 1.0).pow(3)
        kyy = (ys @ ys.T / d + 1.0).pow(3)
        kxy = (xs @ ys.T / d + 1.0).pow(3)
        scores[i] = _unbiased_mmd2(kxx, kyy, kxy)
    return float(scores.mean()), float(scores.std(correction=0))


def mmd_rbf(x: ArrayLike, y: ArrayLike, bandwidths: tuple[float, ...] = DEFAULT_RBF_BANDWIDTHS) -> float:
    """Unbiased MMD^2 between (N, D) and (M, D) sets with k(u, v) = sum_s exp(-||u - v||^2 / (2 s^2)).

    Meant for low-dimensional sets (toy2d): all three Gram matrices are formed at once, O((N + M)^2) memory.
    The default `bandwidths` (`DEFAULT_RBF_BANDWIDTHS`, kernel stds from 0.05 to 2) suit data of about unit
    scale, as toy2d is; see that constant for the reasoning. The estimate is 0 in expectation when both sets
    come from one distribution and can then be slightly negative (Gretton et al. 2012). Float64.
    """
    xt, yt = _as_2d(x, "x"), _as_2d(y, "y")
    if xt.shape[1] != yt.shape[1]:
        raise ValueError(f"mmd_rbf: dims differ: {xt.shape[1]} vs {yt.shape[1]}")
    if xt.shape[0] < 2 or yt.shape[0] < 2:
        raise ValueError("mmd_rbf: need at least 2 samples in each set")
    if not bandwidths or any(s <= 0 for s in bandwidths):
        raise ValueError(f"mmd_rbf: bandwidths must be positive, got {bandwidths}")

    def gram(u: Tensor, v: Tensor) -> Tensor:
        d2 = torch.cdist(u, v).pow(2)
        return sum(torch.exp(-d2 / (2.0 * s * s)) for s in bandwidths)

    return _unbiased_mmd2(gram(xt, xt), gram(yt, yt), gram(xt, yt))


# ---------------------------------------------------------------------------------------------------------
# Improved precision / recall (Kynkaanniemi et al. 2019)


def _knn_radii(ref: Tensor, k: int, batch_size: int) -> Tensor:
    """Distance from each row of `ref` to its k-th nearest other row (the self-distance 0 is the 1st of k+1)."""
    radii = torch.empty(ref.shape[0], dtype=ref.dtype)
    for i in range(0, ref.shape[0], batch_size):
        d = torch.cdist(ref[i : i + batch_size], ref)
        radii[i : i + batch_size] = d.kthvalue(k + 1, dim=1).values
    return radii


def _inside_fraction(query: Tensor, ref: Tensor, radii: Tensor, batch_size: int) -> float:
    """Fraction of `query` rows within radii[j] of some ref row j (the k-NN-ball manifold of `ref`)."""
    inside = torch.zeros(query.shape[0], dtype=torch.bool)
    for i in range(0, query.shape[0], batch_size):
        q = query[i : i + batch_size]
        hit = torch.zeros(q.shape[0], dtype=torch.bool)
        for j in range(0, ref.shape[0], batch_size):
            hit |= (torch.cdist(q, ref[j : j + batch_size]) <= radii[j : j + batch_size]).any(dim=1)
        inside[i : i + batch_size] = hit
    return float(inside.double().mean())


def precision_recall(
    real: ArrayLike,
    fake: ArrayLike,
    k: int = 3,
    batch_size: int = 1024,
    dtype: torch.dtype = torch.float64,
) -> tuple[float, float]:
    """Improved precision and recall of `fake` against `real` (Kynkaanniemi et al. 2019).

    Each set's manifold is the union of balls centred on its samples with radius the distance to the sample's
    k-th nearest neighbour within the same set. Precision is the fraction of fake samples inside the real
    manifold (a point on a ball's boundary counts as inside); recall is the fraction of real samples inside the
    fake manifold. Distances are Euclidean, from `torch.cdist` in `dtype` (float64 by default; float32 halves
    memory and time), over blocks of at most `batch_size` x `batch_size`, so memory stays bounded for large sets.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"precision_recall: dtype must be float32 or float64, got {dtype}")
    r, f = _as_2d(real, "real", dtype), _as_2d(fake, "fake", dtype)
    if r.shape[1] != f.shape[1]:
        raise ValueError(f"precision_recall: feature dims differ: {r.shape[1]} vs {f.shape[1]}")
    if not 1 <= k < min(r.shape[0], f.shape[0]):
        raise ValueError(f"precision_recall: need 1 <= k < set sizes, got k={k} for {r.shape[0]} and {f.shape[0]}")
    if batch_size < 1:
        raise ValueError(f"precision_recall: batch_size must be >= 1, got {batch_size}")
    precision = _inside_fraction(f, r, _knn_radii(r, k, batch_size), batch_size)
    recall = _inside_fraction(r, f, _knn_radii(f, k, batch_size), batch_size)
    return precision, recall


# ---------------------------------------------------------------------------------------------------------
# Sliced Wasserstein


def sliced_wasserstein(x: Tensor, y: Tensor, n_proj: int = 256, generator: torch.Generator | None = None) -> float:
    """Sliced 2-Wasserstein distance sqrt(E_theta W2^2(theta.x, theta.y)) over random unit directions theta.

    Each 1-D W2 between equal-size empirical sets is the RMS difference of the sorted projections
    (Rabin et al. 2011; Bonneel et al. 2015). Sets of different sizes are compared at matched quantiles.
    """
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"expected two (N, D) sets of equal D, got {tuple(x.shape)} and {tuple(y.shape)}")
    x, y = x.double(), y.double()
    theta = torch.randn(x.shape[1], n_proj, generator=generator, dtype=torch.float64)
    theta = theta / theta.norm(dim=0, keepdim=True)
    px, _ = (x @ theta).sort(dim=0)
    py, _ = (y @ theta).sort(dim=0)
    if px.shape[0] != py.shape[0]:
        q = torch.linspace(0, 1, max(px.shape[0], py.shape[0]), dtype=torch.float64)
        px, py = torch.quantile(px, q, dim=0), torch.quantile(py, q, dim=0)
    return float((px - py).pow(2).mean().sqrt())
