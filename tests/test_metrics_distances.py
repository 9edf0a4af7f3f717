"""steadydiff.metrics: Frechet distance, KID, improved precision/recall, RBF MMD, sliced Wasserstein.

Closed forms and independent computations check the arithmetic; Fashion-MNIST with simple fixed feature maps
checks that the distances order degradations sensibly; torchmetrics (a dev-only oracle, skipped when absent)
checks FD and KID against the reference implementation on identical features.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steadydiff.metrics import (
    fd_from_features,
    frechet_distance,
    gaussian_stats,
    kid,
    mmd_rbf,
    precision_recall,
    sliced_wasserstein,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _spd(rng: np.random.Generator, d: int) -> np.ndarray:
    a = rng.standard_normal((d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


def _tr_sqrt_eigvals(s1: np.ndarray, s2: np.ndarray) -> float:
    """tr((S1 S2)^{1/2}) from the (real, non-negative) eigenvalues of the non-symmetric product S1 @ S2."""
    ev = torch.linalg.eigvals(torch.from_numpy(s1) @ torch.from_numpy(s2))
    return float(ev.real.clamp_min(0).sqrt().sum())


def _fd_oracle(mu1, s1, mu2, s2) -> float:
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * _tr_sqrt_eigvals(s1, s2))


def _correlated(gen: torch.Generator, n: int, d: int, shift: float = 0.0) -> torch.Tensor:
    mix = torch.randn(d, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    return torch.randn(n, d, generator=gen, dtype=torch.float64) @ mix + shift


# ---------------------------------------------------------------------------------------------------------
# Frechet distance


def test_gaussian_stats_match_numpy_cov_ddof1():
    x = np.random.default_rng(0).standard_normal((50, 6)) * np.arange(1, 7)
    mu, sigma = gaussian_stats(torch.from_numpy(x).float())
    assert mu.dtype == np.float64 and sigma.dtype == np.float64
    np.testing.assert_allclose(mu, x.astype(np.float32).mean(0), rtol=1e-6)
    np.testing.assert_allclose(sigma, np.cov(x.astype(np.float32).astype(np.float64), rowvar=False), rtol=1e-10)
    with pytest.raises(ValueError):
        gaussian_stats(np.zeros((1, 3)))
    with pytest.raises(ValueError):
        gaussian_stats(np.zeros((4, 3, 2)))


def test_fd_self_is_zero_and_symmetric():
    g = torch.Generator().manual_seed(0)
    a = _correlated(g, 400, 24)
    b = _correlated(g, 300, 24, shift=0.3)
    mu, s = gaussian_stats(a)
    assert abs(fd_from_features(a, a)) < 1e-6 * np.trace(s)
    ab, ba = fd_from_features(a, b), fd_from_features(b, a)
    assert ab > 0
    assert ab == pytest.approx(ba, rel=1e-10)


def test_fd_closed_form_diagonal_and_commuting():
    rng = np.random.default_rng(1)
    d = 10
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    a, b = rng.uniform(0.1, 3.0, d), rng.uniform(0.1, 3.0, d)
    expected = float(((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum())
    assert abs(frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) - expected) < 1e-8
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))  # commuting: shared eigenvectors
    s1, s2 = q @ np.diag(a) @ q.T, q @ np.diag(b) @ q.T
    assert abs(frechet_distance(mu1, s1, mu2, s2) - expected) < 1e-8
    assert abs(frechet_distance(torch.from_numpy(mu1), torch.from_numpy(s1), mu2, s2) - expected) < 1e-8


def test_fd_non_commuting_matches_eigvals_of_product():
    rng = np.random.default_rng(2)
    for d in (2, 7, 32):
        mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
        s1, s2 = _spd(rng, d), _spd(rng, d)
        assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(_fd_oracle(mu1, s1, mu2, s2), rel=1e-9, abs=1e-10)


def test_fd_singular_covariances():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(12, 40, generator=g, dtype=torch.float64)  # N < D: rank-11 covariances
    b = torch.randn(15, 40, generator=g, dtype=torch.float64) + 0.2
    fd = fd_from_features(a, b)
    (mu1, s1), (mu2, s2) = gaussian_stats(a), gaussian_stats(b)
    assert np.isfinite(fd) and fd > 0
    assert fd == pytest.approx(_fd_oracle(mu1, s1, mu2, s2), rel=1e-5)
    assert abs(fd_from_features(a, a)) < 1e-6 * np.trace(s1)
    zero = np.zeros((40, 40))  # fully degenerate: reduces to ||mu1 - mu2||^2 + tr(S2)
    assert frechet_distance(mu1, zero, mu2, s2) == pytest.approx(((mu1 - mu2) ** 2).sum() + np.trace(s2), rel=1e-12)


def test_fd_rejects_bad_input():
    with pytest.raises(ValueError):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))
    with pytest.raises(ValueError):
        frechet_distance(np.zeros(2), np.array([[1.0, np.nan], [np.nan, 1.0]]), np.zeros(2), np.eye(2))


# ---------------------------------------------------------------------------------------------------------
# Fashion-MNIST degradations


@pytest.fixture(scope="module")
def fmnist() -> torch.Tensor:
    from steadydiff.data import DataError, load_fashion_mnist

    try:
        ds = load_fashion_mnist("test")
    except DataError as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"Fashion-MNIST not available: {e}")
    return ds.items_range(0, 2000).clone()


def _pool_features(x: torch.Tensor) -> torch.Tensor:
    """Deterministic 49-d features: 4x4 average-pooled 28x28 pixels."""
    return F.avg_pool2d(x.double(), 4).flatten(1)


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    r = max(1, math.ceil(3 * sigma))
    t = torch.arange(-r, r + 1, dtype=x.dtype)
    k = torch.exp(-(t**2) / (2 * sigma**2))
    k = k / k.sum()
    x = F.conv2d(F.pad(x, (r, r, 0, 0), mode="reflect"), k.view(1, 1, 1, -1))
    return F.conv2d(F.pad(x, (0, 0, r, r), mode="reflect"), k.view(1, 1, -1, 1))


def test_fd_increases_with_noise(fmnist):
    g = torch.Generator().manual_seed(0)
    eps = torch.randn(fmnist.shape, generator=g)
    ref = _pool_features(fmnist)
    fds = [fd_from_features(ref, _pool_features(fmnist + std * eps)) for std in (0.0, 0.05, 0.1, 0.2, 0.4)]
    assert fds[0] < 1e-9
    assert all(lo < hi for lo, hi in zip(fds, fds[1:])), fds


def test_fd_increases_with_blur(fmnist):
    ref = _pool_features(fmnist)
    fds = [fd_from_features(ref, _pool_features(_gaussian_blur(fmnist, s))) for s in (0.5, 1.0, 2.0, 3.0)]
    assert fds[0] > 0
    assert all(lo < hi for lo, hi in zip(fds, fds[1:])), fds


# ---------------------------------------------------------------------------------------------------------
# KID


def _kid_direct(x: np.ndarray, y: np.ndarray) -> float:
    """Unbiased MMD^2 with (x.y/d + 1)^3, written out with explicit off-diagonal sums."""
    d, m, n = x.shape[1], x.shape[0], y.shape[0]
    kxx, kyy, kxy = (x @ x.T / d + 1) ** 3, (y @ y.T / d + 1) ** 3, (x @ y.T / d + 1) ** 3
    off = ~np.eye(m, dtype=bool)
    offy = ~np.eye(n, dtype=bool)
    return float(kxx[off].mean() + kyy[offy].mean() - 2 * kxy.mean())


def test_kid_single_full_subset_is_exact():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(60, 5, generator=g), torch.randn(60, 5, generator=g) + 0.4
    mean, std = kid(a, b, subsets=1, subset_size=10**6)  # clipped to 60: the whole sets, order irrelevant
    assert std == 0.0
    assert mean == pytest.approx(_kid_direct(a.double().numpy(), b.double().numpy()), rel=1e-12)


def test_kid_near_zero_for_one_distribution_and_positive_for_shift():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(1000, 16, generator=g), torch.randn(1000, 16, generator=g)
    mean, std = kid(a, b, subsets=20, subset_size=400, seed=1)
    # Each subset estimate is unbiased for MMD^2 = 0 with spread ~std; their average over overlapping subsets
    # of these 1000-sample sets varies less than one 400-sample estimate, so |mean| < 3 std is generous.
    assert std > 0 and abs(mean) < 3 * std
    mean_s, std_s = kid(a, b + 0.5, subsets=20, subset_size=400, seed=1)
    assert mean_s > 0.05 and mean_s > 10 * std_s and mean_s > 20 * abs(mean)


def test_kid_reproducible_and_seeded():
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(200, 4, generator=g), torch.randn(150, 4, generator=g) + 0.2
    assert kid(a, b, subsets=5, subset_size=50, seed=3) == kid(a, b, subsets=5, subset_size=50, seed=3)
    r1 = kid(a, b, subsets=5, subset_size=50, generator=torch.Generator().manual_seed(3))
    assert r1 == kid(a, b, subsets=5, subset_size=50, seed=3)
    assert kid(a, b, subsets=5, subset_size=50, seed=4) != r1
    with pytest.raises(ValueError):
        kid(a[:, :3], b, subsets=2)


# ---------------------------------------------------------------------------------------------------------
# Improved precision / recall


def test_precision_recall_identical_and_same_distribution():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(1000, 4, generator=g)
    p, r = precision_recall(a, a.clone(), k=3)
    assert p > 0.95 and r > 0.95
    b = torch.randn(1000, 4, generator=g)
    p, r = precision_recall(a, b, k=3)
    assert p > 0.8 and r > 0.8


def test_precision_recall_disjoint_sets():
    g = torch.Generator().manual_seed(8)
    a = torch.randn(500, 8, generator=g)
    p, r = precision_recall(a, torch.randn(500, 8, generator=g) + 50.0, k=3)
    assert p < 0.05 and r < 0.05


def test_precision_recall_mode_dropping_is_asymmetric():
    g = torch.Generator().manual_seed(9)
    centres = torch.tensor([[10.0, 0, 0], [-10.0, 0, 0], [0, 10.0, 0], [0, -10.0, 0]])
    real = centres[torch.randint(0, 4, (2000,), generator=g)] + torch.randn(2000, 3, generator=g)
    fake = centres[0] + torch.randn(500, 3, generator=g)  # one of four modes
    p, r = precision_recall(real, fake, k=3)
    assert p > 0.9 and r < 0.35
    p2, r2 = precision_recall(fake, real, k=3)  # roles swapped: a generator that covers more than the data
    assert p2 < 0.35 and r2 > 0.9


def test_precision_recall_batching_and_dtype():
    g = torch.Generator().manual_seed(10)
    a, b = torch.randn(300, 5, generator=g), torch.randn(250, 5, generator=g) * 1.3
    full = precision_recall(a, b, k=5)
    assert precision_recall(a, b, k=5, batch_size=37) == full
    p32, r32 = precision_recall(a.numpy(), b.numpy(), k=5, dtype=torch.float32)
    assert abs(p32 - full[0]) <= 2 / 250 and abs(r32 - full[1]) <= 2 / 300
    with pytest.raises(ValueError):
        precision_recall(a, b[:3], k=3)


# ---------------------------------------------------------------------------------------------------------
# RBF MMD and sliced Wasserstein (toy2d)


def test_mmd_rbf_same_vs_shifted_toy2d():
    from steadydiff.data import make_toy2d

    for kind in ("8gaussians", "checkerboard"):
        x, y = make_toy2d(kind, 1000, seed=0), make_toy2d(kind, 1000, seed=1)
        same = mmd_rbf(x, y)  # |same| <~ 4e-3 over seeds 1-3 for both kinds; shifted >= 0.12
        shifted = mmd_rbf(x, y + 0.5)
        assert abs(same) < 0.05 * shifted, (kind, same, shifted)
        assert shifted > 0.05
    with pytest.raises(ValueError):
        mmd_rbf(x, y, bandwidths=(0.0,))


def test_mmd_rbf_matches_direct_formula():
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(30, 2, generator=g, dtype=torch.float64), torch.randn(20, 2, generator=g, dtype=torch.float64)

    def k(u, v):
        d2 = ((u[:, None, :] - v[None, :, :]) ** 2).sum(-1)
        return sum(np.exp(-d2 / (2 * s * s)) for s in (0.5, 2.0))

    xn, yn = x.numpy(), y.numpy()
    kxx, kyy = k(xn, xn), k(yn, yn)
    expected = (kxx.sum() - np.trace(kxx)) / (30 * 29) + (kyy.sum() - np.trace(kyy)) / (20 * 19) - 2 * k(xn, yn).mean()
    assert mmd_rbf(x, y, bandwidths=(0.5, 2.0)) == pytest.approx(expected, rel=1e-10)


def test_sliced_wasserstein_unchanged():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(400, 3, generator=g)
    assert sliced_wasserstein(x, x, generator=torch.Generator().manual_seed(0)) == 0.0
    c = torch.tensor([0.5, -1.0, 2.0])
    # A translation moves every projection by theta.c: SW = sqrt(mean_theta (theta.c)^2) for the same thetas.
    theta = torch.randn(3, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    theta = theta / theta.norm(dim=0, keepdim=True)
    expected = float((c.double() @ theta).pow(2).mean().sqrt())
    got = sliced_wasserstein(x, x + c, n_proj=64, generator=torch.Generator().manual_seed(1))
    assert got == pytest.approx(expected, rel=1e-6)
    assert sliced_wasserstein(x, x[:300] + 5.0, generator=torch.Generator().manual_seed(0)) > 1.0
    with pytest.raises(ValueError):
        sliced_wasserstein(x, x[:, :2])


# ---------------------------------------------------------------------------------------------------------
# torchmetrics oracle (dev-only)


class _FixedFeatures(nn.Module):
    """A fixed random linear map of 4x4-pooled, channel-averaged uint8 images, in float64.

    torchmetrics (checked on 1.9.0) passes `update` images to a custom `feature` module unchanged (`normalize` is
    ignored for custom modules), and FID probes the output size once with a random (1, 3, 299, 299) uint8 dummy
    (`normalize=False`) unless the module has `num_features`; the pooling is adaptive (7x7 cells at any size),
    so both the 28x28 uint8 images and that dummy work. Features are float64, so both sides compute in float64.
    """

    def __init__(self, out_dim: int = 16) -> None:
        super().__init__()
        w = torch.randn(49, out_dim, generator=torch.Generator().manual_seed(123), dtype=torch.float64)
        self.register_buffer("w", w / 7.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.double().mean(dim=1, keepdim=True) / 255.0
        return F.adaptive_avg_pool2d(x, 7).flatten(1) @ self.w


def _to_uint8_rgb(x: torch.Tensor) -> torch.Tensor:
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).expand(-1, 3, -1, -1).contiguous()


@pytest.mark.filterwarnings("ignore:Metric `Kernel Inception Distance` will save all extracted features")
def test_fd_and_kid_match_torchmetrics(fmnist):
    pytest.importorskip("torchmetrics", reason="torchmetrics (dev-only oracle) is not installed")
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    g = torch.Generator().manual_seed(13)
    real = _to_uint8_rgb(fmnist[:400])
    fake = _to_uint8_rgb(fmnist[400:700] + 0.15 * torch.randn(300, 1, 28, 28, generator=g))
    feat = _FixedFeatures()
    with torch.no_grad():
        fr, ff = feat(real), feat(fake)

    fid = FrechetInceptionDistance(feature=_FixedFeatures(), normalize=False)
    fid.update(real, real=True)
    fid.update(fake, real=False)
    ours = fd_from_features(fr, ff)
    assert ours > 0
    assert float(fid.compute()) == pytest.approx(ours, rel=1e-4)

    # subsets=1 with subset_size = N: one permutation of each whole set, for which KID is deterministic.
    kid_tm = KernelInceptionDistance(feature=_FixedFeatures(), subsets=1, subset_size=300, normalize=False)
    kid_tm.update(real[:300], real=True)
    kid_tm.update(fake, real=False)
    tm_mean, _ = kid_tm.compute()
    ours_mean, ours_std = kid(fr[:300], ff, subsets=1, subset_size=300)
    assert ours_std == 0.0
    assert float(tm_mean) == pytest.approx(ours_mean, rel=1e-4)

    # Several subsets: torchmetrics draws torch.randperm(real) then torch.randperm(fake) per subset from the
    # global generator; ours draws in the same order from its own generator, so equal seeds give equal subsets.
    kid_tm = KernelInceptionDistance(feature=_FixedFeatures(), subsets=10, subset_size=100, normalize=False)
    kid_tm.update(real, real=True)
    kid_tm.update(fake, real=False)
    state = torch.random.get_rng_state()
    torch.manual_seed(77)
    try:
        tm_mean, tm_std = kid_tm.compute()
    finally:
        torch.random.set_rng_state(state)
    ours_mean, ours_std = kid(fr, ff, subsets=10, subset_size=100, seed=77)
    assert float(tm_mean) == pytest.approx(ours_mean, rel=1e-4)
    assert float(tm_std) == pytest.approx(ours_std, rel=1e-4)
