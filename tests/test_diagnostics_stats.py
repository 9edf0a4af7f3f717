"""Diagnostics: oscillation statistics, input sensitivity, loss landscape, and the ScaleLong Theorem 3.1 fit."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from steadydiff.diagnostics.landscape import consistency_score, interpolate_loss, top_hessian_eigenvalue
from steadydiff.diagnostics.sensitivity import jacobian_spectral_norm, perturbation_ratio, sensitivity_vs_t
from steadydiff.diagnostics.stats import (
    coefficient_of_variation,
    count_spikes,
    detrended_cv,
    detrended_std,
    log_residual_std,
    max_to_median,
    mean_abs_delta,
    median_abs_log_delta,
    moving_average,
    oscillation_summary,
    spike_fraction,
    spike_indices,
    spike_ratio,
    trailing_median,
)
from steadydiff.diagnostics.theory import (
    decoder_blocks,
    decoder_feature_norms,
    skip_energy,
    theory_fit,
)
from steadydiff.diffusion import VPSDE
from steadydiff.nn import MLPUNet, UNet, UViT, cs_coefficients, make_skip_scaling
from steadydiff.nn.skip_scaling import ConstantScaling

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------
# stats


def test_moving_average_is_centred_and_exact_on_affine_trends():
    x = 3.0 + 0.7 * np.arange(101)
    for window in (1, 2, 5, 20, 21, 500):
        m = moving_average(x, window)
        assert m.shape == x.shape
        np.testing.assert_allclose(m, x, rtol=0, atol=1e-11)  # symmetric windows, edges included
    y = np.random.default_rng(0).normal(size=60)
    m = moving_average(y, 10)  # h = 5: interior windows have 11 points
    assert m[30] == pytest.approx(y[25:36].mean(), abs=1e-14)
    assert m[2] == pytest.approx(y[0:5].mean(), abs=1e-14)  # shrinks symmetrically at the start
    assert m[0] == y[0] and m[-1] == y[-1]
    np.testing.assert_array_equal(moving_average(y, 1), y)


def test_detrended_std_linear_and_alternating():
    n, a = 400, 0.3
    trend = 5.0 - 0.01 * np.arange(n)
    assert detrended_std(trend, window=20) < 1e-12
    alt = a * (-1.0) ** np.arange(n)
    x = trend + alt
    resid = x - moving_average(x, 20)
    # Interior: the 21-point centred window holds one more point of the centre's sign.
    np.testing.assert_allclose(np.abs(resid[10:-10]), a * 20 / 21, rtol=1e-9)
    ds = detrended_std(x, window=20)
    assert ds == pytest.approx(a, rel=0.06)
    assert ds <= a
    # Larger window -> closer to a.
    assert detrended_std(x, window=100) == pytest.approx(a, rel=0.03)


def test_coefficient_of_variation():
    assert coefficient_of_variation([2.0] * 7) == 0.0
    assert coefficient_of_variation([1.0, 3.0]) == 0.5
    assert coefficient_of_variation(torch.tensor([1.0, 3.0])) == 0.5
    with pytest.raises(ValueError):
        coefficient_of_variation([-1.0, 1.0])
    with pytest.raises(ValueError):
        coefficient_of_variation([1.0, 2.0], warmup=2)


@pytest.mark.parametrize("r", [1.1, 0.9, 2.0])
def test_median_abs_log_delta_geometric(r):
    x = 3.0 * r ** np.arange(50)
    assert median_abs_log_delta(x) == pytest.approx(abs(math.log(r)), rel=1e-12)
    with pytest.raises(ValueError):
        median_abs_log_delta([1.0, 0.0, 2.0])
    with pytest.raises(ValueError):
        median_abs_log_delta([1.0])


def test_spike_ratio_and_mean_abs_delta():
    assert spike_ratio([4.0] * 30) == 1.0
    x = np.arange(1.0, 101.0)
    assert spike_ratio(x, q=50) == 1.0
    assert spike_ratio(x, q=100) == pytest.approx(100 / 50.5)
    with pytest.raises(ValueError):
        spike_ratio([0.0, 0.0, 1.0])
    assert mean_abs_delta([1.0, 3.0, 2.0]) == 1.5
    assert mean_abs_delta([5.0] * 10) == 0.0


def test_count_spikes_finds_exactly_the_injected_spikes():
    rng = np.random.default_rng(1)
    x = 1.0 + 0.2 * rng.random(600)  # bounded in [1, 1.2]: max / median < 3 everywhere
    injected = [60, 123, 250, 251, 400, 599]
    x[injected] = 5.0
    x[2] = 50.0  # too little history (< 5 predecessors): not judged
    assert spike_indices(x, k=3.0, window=50) == injected
    assert count_spikes(x, k=3.0, window=50) == len(injected)
    assert count_spikes(x, k=10.0, window=50) == 0
    assert count_spikes(np.ones(100)) == 0


def test_warmup_really_drops_points():
    x = [100.0, 100.0, 1.0, 1.0, 1.0, 1.0]
    assert coefficient_of_variation(x, warmup=2) == 0.0
    assert coefficient_of_variation(x, warmup=0) > 1.0
    steps = [0, 10, 20, 30, 40, 50]
    assert coefficient_of_variation(x, warmup=20, steps=steps) == 0.0
    assert coefficient_of_variation(x, warmup=11, steps=steps) == 0.0
    assert mean_abs_delta(x, warmup=2) == 0.0
    assert spike_ratio(x, warmup=2) == 1.0
    assert detrended_std(x, window=3, warmup=2) == 0.0
    assert median_abs_log_delta(x, warmup=2) == 0.0
    # count_spikes: the warm-up is neither judged nor used as history.
    y = np.concatenate([np.full(10, 0.1), np.ones(40)])
    assert count_spikes(y, window=20) > 0
    assert count_spikes(y, window=20, warmup=10) == 0
    z = np.ones(80)
    z[[3, 30, 60]] = 9.0
    assert spike_indices(z, window=20, warmup=25) == [30, 60]  # indices into the original series
    assert spike_indices(z, window=20, warmup=310, steps=np.arange(80) * 10) == [60]
    with pytest.raises(ValueError):
        coefficient_of_variation(x, warmup=-1)


def test_oscillation_summary():
    rng = np.random.default_rng(2)
    loss = 1.0 + 0.1 * rng.random(200)
    signed = rng.normal(size=200)
    out = oscillation_summary({"loss": loss, "signed": signed}, warmup=20)
    keys = {"n", "mean", "detrended_std", "cv", "median_abs_log_delta", "spike_ratio", "mean_abs_delta", "spikes",
            "spike_frac_5x", "spike_frac_3x", "max_to_median", "log_residual_std", "detrended_cv", "growth"}
    assert set(out) == {"loss", "signed"} and all(set(v) == keys for v in out.values())
    s = out["loss"]
    assert s["n"] == 180.0
    assert s["cv"] == coefficient_of_variation(loss, warmup=20)
    assert s["detrended_std"] == detrended_std(loss, warmup=20)
    assert s["median_abs_log_delta"] == median_abs_log_delta(loss, warmup=20)
    assert s["spike_ratio"] == spike_ratio(loss, warmup=20)
    assert s["mean_abs_delta"] == mean_abs_delta(loss, warmup=20)
    assert s["spikes"] == 0.0
    assert all(isinstance(v, float) for v in s.values())
    assert math.isnan(out["signed"]["median_abs_log_delta"])  # logs of a signed series: undefined
    assert math.isfinite(out["signed"]["mean_abs_delta"])


# spike-aware, trend-insensitive statistics


def test_trailing_median_matches_a_direct_loop():
    y = np.random.default_rng(3).random(90)
    for window, min_history in [(20, 5), (7, 1), (10, 15), (200, 3)]:
        m = trailing_median(y, window, min_history)
        expected = [np.median(y[max(0, i - window):i]) if i >= min_history else np.nan for i in range(90)]
        np.testing.assert_array_equal(m, expected)
    assert np.isnan(trailing_median(np.ones(4), 50, 5)).all()
    with pytest.raises(ValueError):
        trailing_median(y, 0, 5)
    with pytest.raises(ValueError):
        trailing_median(y, 10, 0)


def _spiky(n=800, seed=4):
    """1 + noise in [0, 0.01), 10x spikes at `big` and 4x spikes at `mid` (all isolated, full windows)."""
    base = 1.0 + 0.01 * np.random.default_rng(seed).random(n)
    x = base.copy()
    big, mid = [80, 200, 333, 500, 650, 799], [120, 420, 700]
    x[big] = 10.0
    x[mid] = 4.0
    return base, x, big, mid


def test_spike_statistics_on_known_spikes():
    base, x, big, mid = _spiky()
    judged = len(x) - 5  # min_history=5: the first 5 points are not judged
    assert spike_fraction(x, factor=5.0) == len(big) / judged
    assert spike_fraction(x, factor=3.0) == (len(big) + len(mid)) / judged
    assert spike_fraction(x, factor=5.0) * judged == count_spikes(x, k=5.0)  # the same rule
    assert spike_indices(x, k=3.0) == sorted(big + mid)
    assert spike_fraction(base, factor=3.0) == 0.0
    assert max_to_median(x) == pytest.approx(10.0, rel=0.02)
    assert max_to_median(base) < 1.02
    # 6 x log(10) and 3 x log(4) among 795 judged points: sqrt((6 * 5.30 + 3 * 1.92) / 795) ~ 0.22.
    assert log_residual_std(x) > 0.15 > 10 * log_residual_std(base)
    # A median statistic cannot see rare spikes: the 9 spikes barely move it.
    assert median_abs_log_delta(x) == pytest.approx(median_abs_log_delta(base), rel=0.1)


def test_trend_is_not_measured_by_the_new_statistics():
    k = np.arange(2000)
    decay = np.exp(-k / 300)
    linear = 1.0 + 0.001 * k
    for trend in (decay, linear):
        assert spike_fraction(trend, factor=5.0) == 0.0
        assert spike_fraction(trend, factor=3.0) == 0.0
    # Geometric series: y_i / m_i is the same constant at every judged point when all windows are full.
    assert log_residual_std(decay, min_history=50) < 1e-9
    assert max_to_median(decay) < 1.0  # decreasing: every point is below its trailing median
    assert detrended_cv(linear) < 1e-9
    assert detrended_cv(decay) < 1e-3
    # The trend-sensitive statistics see the trend as "oscillation".
    assert coefficient_of_variation(decay) > 0.5
    assert coefficient_of_variation(linear) > 0.25
    assert detrended_cv(decay + 0.05 * (-1.0) ** k) > 0.05  # but an oscillation is seen


def test_spike_statistics_find_the_planted_spikes_on_a_decaying_trend():
    rng = np.random.default_rng(5)
    n = 2000
    x = np.exp(-np.arange(n) / 300) * (1.0 + 0.05 * rng.random(n))
    big, mid = [100, 400, 401, 900, 1500, 1999], [250, 1200]
    x[big] *= 10.0
    x[mid] *= 4.0
    judged = n - 5
    assert spike_indices(x, k=5.0) == big
    assert spike_indices(x, k=3.0) == sorted(big + mid)
    assert spike_fraction(x, factor=5.0) == len(big) / judged
    assert spike_fraction(x, factor=3.0) == (len(big) + len(mid)) / judged
    assert 8.0 < max_to_median(x) < 11.0
    assert detrended_cv(x) > 10 * detrended_cv(np.exp(-np.arange(n) / 300))


def test_new_statistics_edge_cases_and_warmup():
    for fn in (spike_fraction, max_to_median, log_residual_std):
        with pytest.raises(ValueError):
            fn(np.ones(5))  # min_history=5 needs 6 points
        assert fn(np.ones(6)) == (0.0 if fn is spike_fraction else 1.0 if fn is max_to_median else 0.0)
        with pytest.raises(ValueError):
            fn(np.ones(20), window=0)
        with pytest.raises(ValueError):
            fn(np.ones(20), warmup=15)
    with pytest.raises(ValueError):
        log_residual_std(np.r_[np.ones(20), 0.0, np.ones(5)])
    with pytest.raises(ValueError):
        log_residual_std(-np.ones(20))
    with pytest.raises(ValueError):
        max_to_median(np.zeros(20))
    with pytest.raises(ValueError):
        detrended_cv(np.ones(20), window=21)
    assert detrended_cv(np.ones(21), window=21) == 0.0
    assert detrended_cv(np.ones(21), window=20) == 0.0  # even: widened to 21, as in moving_average
    with pytest.raises(ValueError):
        detrended_cv(np.ones(20), window=20)
    with pytest.raises(ValueError):
        detrended_cv(np.zeros(30))
    # The warm-up is neither judged nor history.
    x = np.r_[np.full(10, 0.1), np.ones(40)]
    assert spike_fraction(x, window=20) > 0 and max_to_median(x, window=20) == pytest.approx(10.0)
    assert spike_fraction(x, window=20, warmup=10) == 0.0
    assert max_to_median(x, window=20, warmup=10) == 1.0
    assert log_residual_std(x, window=20, warmup=10) == 0.0
    assert spike_fraction(x, window=20, warmup=100, steps=np.arange(50) * 10) == 0.0
    y = np.r_[np.full(10, 100.0), 1.0 + 0.01 * np.arange(60)]
    assert detrended_cv(y, window=5) > 0.1
    assert detrended_cv(y, window=5, warmup=10) < 1e-12


def test_oscillation_summary_new_keys():
    _, x, big, mid = _spiky()
    out = oscillation_summary({"x": x, "neg": -x}, warmup=0)["x"]
    assert out["spike_frac_5x"] == spike_fraction(x, factor=5.0) == len(big) / (len(x) - 5)
    assert out["spike_frac_3x"] == spike_fraction(x, factor=3.0)
    assert out["max_to_median"] == max_to_median(x)
    assert out["log_residual_std"] == log_residual_std(x)
    assert out["detrended_cv"] == detrended_cv(x, window=21)  # summary window 20 -> 21 points
    neg = oscillation_summary({"neg": -x})["neg"]
    assert math.isnan(neg["log_residual_std"]) and math.isnan(neg["max_to_median"])  # undefined -> nan
    short = oscillation_summary({"s": [1.0, 2.0, 3.0]})["s"]
    assert all(math.isnan(short[k]) for k in ("spike_frac_5x", "max_to_median", "detrended_cv"))


# ---------------------------------------------------------------------------------------------------------
# sensitivity


class LinearMap(nn.Module):
    """f(x) = W x per sample (x flattened), ignoring the time and labels."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x, t, labels=None):
        return (x.reshape(x.shape[0], -1) @ self.w.T).reshape(x.shape)


class Scale(nn.Module):
    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, x, t, labels=None):
        return self.c * x


def _matrix_with_singular_values(s, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(s)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return u @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ v.T


def test_jacobian_spectral_norm_of_linear_map():
    w = _matrix_with_singular_values([3.0, 2.0, 1.0, 0.7, 0.5, 0.1])
    s = torch.linalg.svdvals(w)
    model = LinearMap(w)
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    t = torch.full((5,), 500.0, dtype=torch.float64)
    sig = jacobian_spectral_norm(model, x, t, iters=40, generator=torch.Generator().manual_seed(2))
    assert sig.shape == (5,)
    torch.testing.assert_close(sig, torch.full_like(sig, float(s.max())), rtol=1e-6, atol=0)
    r = perturbation_ratio(model, x, t, n_draws=8, generator=torch.Generator().manual_seed(3))
    assert r.shape == (5,)
    assert bool((r >= s.min() - 1e-9).all() and (r <= s.max() + 1e-9).all())


def test_jacobian_spectral_norm_random_matrix_and_fallback(monkeypatch):
    w = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    s = torch.linalg.svdvals(w)
    x = torch.randn(3, 2, 4, dtype=torch.float64)  # non-flat samples
    t = torch.zeros(3, dtype=torch.float64)
    ref = jacobian_spectral_norm(LinearMap(w), x, t, iters=300, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ref, torch.full_like(ref, float(s[0])), rtol=1e-4, atol=0)

    def no_forward_mode(*args, **kwargs):
        raise NotImplementedError("no forward AD")

    monkeypatch.setattr(torch.func, "jvp", no_forward_mode)  # double-backward fallback
    alt = jacobian_spectral_norm(LinearMap(w), x, t, iters=300, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(alt, ref, rtol=1e-10, atol=0)


def test_scale_map_ratio_is_exactly_abs_c():
    model = Scale(-2.5)
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    t = torch.zeros(4, dtype=torch.float64)
    r = perturbation_ratio(model, x, t, rel_eps=1e-3, n_draws=3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(r, torch.full((4,), 2.5, dtype=torch.float64), rtol=1e-9, atol=0)
    j = jacobian_spectral_norm(model, x, t, iters=3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(j, torch.full((4,), 2.5, dtype=torch.float64), rtol=1e-12, atol=0)


def test_jacobian_on_mlp_unet_matches_dense_jacobian():
    torch.manual_seed(0)
    model = MLPUNet(dim=3, hidden=16, depth=4)
    nn.init.normal_(model.out.weight, std=0.3)  # the zero-initialised output layer would give J = 0
    model.train()
    x = torch.randn(4, 3)
    t = 999 * torch.rand(4)
    sig = jacobian_spectral_norm(model, x, t, iters=200, generator=torch.Generator().manual_seed(0))
    assert model.training  # mode restored
    for b in range(4):
        jac = torch.autograd.functional.jacobian(lambda v, b=b: model(v[None], t[b:b + 1])[0], x[b])
        assert float(sig[b]) == pytest.approx(float(torch.linalg.svdvals(jac.double())[0]), rel=1e-4)


def test_sensitivity_vs_t():
    sde = VPSDE()
    x0 = torch.randn(6, 4, dtype=torch.float64)
    ts = [0.1, 0.5, 0.9]
    for method in ("ratio", "jacobian"):
        out = sensitivity_vs_t(Scale(1.5), sde, x0, ts, method=method, generator=torch.Generator().manual_seed(0))
        assert list(out) == ts
        for v in out.values():
            assert v == pytest.approx(1.5, rel=1e-9)
    w = _matrix_with_singular_values([2.0, 1.0, 0.5, 0.25], seed=3)
    out = sensitivity_vs_t(LinearMap(w), sde, x0, ts, method="ratio", generator=torch.Generator().manual_seed(0))
    assert all(0.25 - 1e-9 <= v <= 2.0 + 1e-9 for v in out.values())
    with pytest.raises(ValueError):
        sensitivity_vs_t(Scale(1.0), sde, x0, ts, method="nope")


# ---------------------------------------------------------------------------------------------------------
# landscape


def _sym_with_eigs(eigs, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=g, dtype=torch.float64))
    return q @ torch.diag(torch.tensor(eigs, dtype=torch.float64)) @ q.T


@pytest.mark.parametrize("eigs", [[5.0, -3.0, 2.0, 1.0, 0.5, -0.25], [-4.0, 3.0, 1.0, 0.5, 0.2, 0.1]])
def test_top_hessian_eigenvalue_of_quadratic(eigs):
    a = _sym_with_eigs(eigs)
    ev = torch.linalg.eigvalsh(a)
    expected = float(ev[ev.abs().argmax()])
    p1 = torch.randn(2, dtype=torch.float64, requires_grad=True)
    p2 = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    unused = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def loss_fn():
        x = torch.cat([p1, p2.reshape(-1)])
        return 0.5 * x @ a @ x

    lam = top_hessian_eigenvalue(loss_fn, [p1, unused, p2], iters=60, generator=torch.Generator().manual_seed(0))
    assert lam == pytest.approx(expected, rel=1e-6)
    assert p1.grad is None and p2.grad is None  # nothing accumulated into .grad


class LinearWithBuffers(nn.Linear):
    def __init__(self):
        super().__init__(3, 2, dtype=torch.float64)
        self.register_buffer("scale", torch.randn(2, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(0))


def test_interpolate_loss_is_the_closed_form_quadratic_and_restores_state():
    torch.manual_seed(0)
    model, ma, mb = LinearWithBuffers(), LinearWithBuffers(), LinearWithBuffers()
    mb.count.fill_(7)
    sa, sb = ma.state_dict(), mb.state_dict()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(10, 3, dtype=torch.float64)
    y = torch.randn(10, 2, dtype=torch.float64)
    seen_buffers = []

    def loss_fn(m):
        seen_buffers.append((m.scale.clone(), int(m.count)))
        return 0.5 * (m(x) - y).square().sum(dim=1).mean()

    alphas = np.linspace(-0.5, 1.5, 21)
    losses = interpolate_loss(model, sa, sb, loss_fn, alphas)
    # Outputs are affine in alpha, so the loss is c0 + c1 alpha + c2 alpha^2 exactly.
    with torch.no_grad():
        ra, d = ma(x) - y, mb(x) - ma(x)
    c0 = float(0.5 * ra.square().sum(1).mean())
    c1 = float((ra * d).sum(1).mean())
    c2 = float(0.5 * d.square().sum(1).mean())
    expected = [c0 + c1 * al + c2 * al**2 for al in alphas]
    np.testing.assert_allclose(losses, expected, rtol=1e-10, atol=1e-13)
    assert all(isinstance(v, float) for v in losses)
    assert all(torch.equal(s, sa["scale"]) and c == 0 for s, c in seen_buffers)  # buffers copied from a
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k])
    with torch.no_grad():
        at_b = float(loss_fn(mb))
    assert interpolate_loss(model, sa, sb, loss_fn, [0.0, 1.0])[1] == pytest.approx(at_b)
    assert len(interpolate_loss(model, sa, sb, loss_fn)) == 21  # default alphas

    def failing(m):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        interpolate_loss(model, sa, sb, failing, [0.5])
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k])


def test_consistency_score():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(400, 2, 3, generator=g)
    assert consistency_score(a, a.clone()) == 1.0
    shuffled = a[torch.randperm(400, generator=g)]
    assert abs(consistency_score(a, shuffled)) < 0.1
    independent = torch.randn(400, 2, 3, generator=g)
    assert abs(consistency_score(a, independent)) < 0.1
    close = a + 0.01 * torch.randn(400, 2, 3, generator=g)
    assert consistency_score(a, close) > 0.95
    with pytest.raises(ValueError):
        consistency_score(a, a[:10])
    with pytest.raises(ValueError):
        consistency_score(a[:1], a[:1])


# ---------------------------------------------------------------------------------------------------------
# theory


def test_skip_energy_exact():
    assert skip_energy(cs_coefficients(4, 0.5)) == [
        1 + 0.25 + 0.0625 + 0.015625, 0.25 + 0.0625 + 0.015625, 0.0625 + 0.015625, 0.015625
    ]
    assert skip_energy([1.0, 1.0, 1.0]) == [3.0, 2.0, 1.0]


class RecordingScaling(ConstantScaling):
    def __init__(self, n, events):
        super().__init__([1.0] * n)
        self.events = events

    def forward(self, i, skip):
        self.events.append(("skip", i))
        return super().forward(i, skip)


@pytest.mark.parametrize("kind", ["mlp", "unet", "uvit"])
def test_decoder_blocks_outermost_first(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        model, x = MLPUNet(dim=2, hidden=16, depth=6), torch.randn(2, 2)
    elif kind == "unet":
        model = UNet(in_channels=1, resolution=8, channels=16, channel_mult=[1, 2], num_res_blocks=1,
                     attn_resolutions=[4], num_heads=2)
        x = torch.randn(2, 1, 8, 8)
    else:
        model = UViT(img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=4, num_heads=2)
        x = torch.randn(2, 1, 8, 8)
    events = []
    model.skip_scaling = RecordingScaling(model.num_skips, events)
    blocks = decoder_blocks(model)
    assert len(blocks) == model.num_skips
    handles = [b.register_forward_hook(lambda *a, i=i: events.append(("block", i))) for i, b in enumerate(blocks)]
    model(x, torch.full((2,), 10.0))
    for h in handles:
        h.remove()
    n = model.num_skips
    # Each skip i is scaled right before the block that consumes it runs; innermost first.
    assert events == [e for i in reversed(range(n)) for e in (("skip", i), ("block", i))]
    norms = decoder_feature_norms(model, x, torch.full((2,), 10.0))
    assert len(norms) == n and all(v.shape == (2,) and v.dtype == torch.float64 for v in norms)
    with pytest.raises(NotImplementedError):
        decoder_blocks(nn.Linear(2, 2))


def test_decoder_feature_norms_match_a_manual_forward():
    torch.manual_seed(0)
    model = MLPUNet(dim=2, hidden=16, depth=6, skip_scaling=make_skip_scaling("cs", [16] * 3, 0.5))
    model.train()
    x, t = torch.randn(5, 2), 999 * torch.rand(5)
    norms = decoder_feature_norms(model, x, t)
    assert model.training
    with torch.no_grad():
        emb = model.embed(t)
        h = model.inp(x)
        skips = []
        for blk in model.down:
            h = blk(h, emb)
            skips.append(h)
        h = model.mid(h, emb)
        outs = []
        for fuse, blk in zip(model.fuse, model.up):
            i = len(skips) - 1
            h = blk(fuse(torch.cat([h, model.skip_scaling(i, skips.pop())], dim=-1)), emb)
            outs.append(h)
    for i, v in enumerate(norms):  # level i = up[N - 1 - i]
        torch.testing.assert_close(v, outs[len(outs) - 1 - i].double().square().sum(1), rtol=1e-6, atol=0)


def test_cs_shrinks_decoder_features_at_init_and_theory_fit():
    torch.manual_seed(0)
    model = MLPUNet(dim=2, hidden=64, depth=12)
    x = torch.randn(512, 2)
    t = 999 * torch.rand(512)
    model.skip_scaling = make_skip_scaling("org", model.skip_channels)
    org = [float(v.mean()) for v in decoder_feature_norms(model, x, t)]
    model.skip_scaling = make_skip_scaling("cs", model.skip_channels, 0.5)
    cs = [float(v.mean()) for v in decoder_feature_norms(model, x, t)]
    assert len(org) == len(cs) == 6
    assert all(c < o for c, o in zip(cs, org)), (cs, org)

    sde = VPSDE()
    x0 = torch.randn(128, 2)
    fit = theory_fit(model, sde, x0, 300, torch.Generator().manual_seed(0))
    assert fit["n_samples"] == 300 and fit["num_levels"] == 6
    assert fit["coefficients"] == cs_coefficients(6, 0.5)
    assert fit["skip_energy"] == skip_energy(cs_coefficients(6, 0.5))
    scalars = [fit["slope"], fit["intercept"], fit["r2"], fit["mean_xt_norm_sq"]]
    lists = fit["level_slope"] + fit["level_intercept"] + fit["level_r2"] + fit["level_mean_norm_sq"]
    assert all(math.isfinite(v) for v in scalars + lists)
    assert 0.0 <= fit["r2"] <= 1.0 and all(0.0 <= r <= 1.0 for r in fit["level_r2"])
    again = theory_fit(model, sde, [x0[:100], (x0[100:], None)], 300, torch.Generator().manual_seed(0))
    assert again["n_samples"] == 300
    same = theory_fit(model, sde, x0, 300, torch.Generator().manual_seed(0))
    assert same == fit  # deterministic given the generator


def test_growth_is_last_over_first_tenth():
    from steadydiff.diagnostics.stats import growth

    x = np.linspace(1.0, 3.0, 100)
    assert growth(x) == pytest.approx(np.mean(x[-10:]) / np.mean(x[:10]))
    assert growth(np.full(50, 2.0)) == 1.0
    assert growth([1.0, 1.0, 5.0, 4.0], warmup=2) == pytest.approx(4.0 / 5.0)  # warm-up dropped first
    with pytest.raises(ValueError):
        growth([1.0])


def test_jacobian_spectral_norm_runs_through_attention():
    """U-ViT attention (SDPA) has no double-backward in its fused CPU kernel: the estimate must still run."""
    from steadydiff.diagnostics.sensitivity import jacobian_spectral_norm
    from steadydiff.nn import UViT

    torch.manual_seed(0)
    model = UViT(img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=4, num_heads=2)
    x = torch.randn(2, 1, 8, 8)
    gen = torch.Generator().manual_seed(0)
    sigma = jacobian_spectral_norm(model, x, torch.full((2,), 500.0), iters=3, generator=gen)
    assert sigma.shape == (2,) and bool(torch.all(sigma > 0))
