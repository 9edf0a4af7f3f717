"""Power-function EMA and post-hoc EMA reconstruction (steadydiff.train.phema; EDM2 App. C, notes §2.6)."""

import math
import os
from collections import Counter

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from steadydiff.train import phema
from steadydiff.train.phema import (
    PowerEMA,
    gamma_to_sigma_rel,
    list_snapshots,
    power_ema_beta,
    profile_inner,
    reconstruct,
    sigma_rel_to_gamma,
    solve_phema,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def profile(tau, t, g):
    """p_{t,g}(tau) = (g+1) tau^g / t^(g+1) on [0, t], 0 after."""
    tau = np.asarray(tau, dtype=np.float64)
    return np.where(tau <= t, (g + 1) / t * (np.minimum(tau, t) / t) ** g, 0.0)


def trapezoid(y, x):
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2)


def flat(d, names):
    return torch.cat([d[n].detach().double().reshape(-1) for n in names])


# ---------------------------------------------------------------------------------------------------------
# sigma_rel <-> gamma
# ---------------------------------------------------------------------------------------------------------

def test_sigma_rel_gamma_round_trip():
    for s in np.concatenate([np.linspace(0.005, 0.28, 221), [0.015, 0.25, 0.2886]]):
        g = sigma_rel_to_gamma(s)
        assert g > 0
        assert abs(gamma_to_sigma_rel(g) - s) <= 1e-10 * s, s
    # and the other way round
    for g in [0.01, 0.5, 3.0, 16.97, 100.0, 1000.0]:
        assert sigma_rel_to_gamma(gamma_to_sigma_rel(g)) == pytest.approx(g, rel=1e-10)


@pytest.mark.parametrize("bad", [0.2887, 0.29, 0.5, 0.0, -0.1, float("nan"), float("inf")])
def test_sigma_rel_out_of_range_is_rejected(bad):
    with pytest.raises(ValueError, match=r"0\.2887"):
        sigma_rel_to_gamma(bad)


def test_known_pairs():
    # notes §2.1 (checked): 0.05 <-> 16.972, 0.10 <-> 6.937; paper Fig. 24 pairs to the stated two decimals
    assert sigma_rel_to_gamma(0.05) == pytest.approx(16.972, abs=5e-4)
    assert sigma_rel_to_gamma(0.10) == pytest.approx(6.937, abs=5e-4)
    for s, g in [(0.05, 16.97), (0.10, 6.94), (0.25, 0.72), (0.20, 1.83), (0.15, 3.56)]:
        assert round(sigma_rel_to_gamma(s), 2) == g, (s, sigma_rel_to_gamma(s))
        assert round(gamma_to_sigma_rel(g), 3) == s, (g, gamma_to_sigma_rel(g))
    # sigma_rel is the std of the profile divided by t (Beta(g+1, 1) on [0, t]): check by integration
    g = sigma_rel_to_gamma(0.10)
    tau = np.linspace(0, 1, 200001)
    p = profile(tau, 1.0, g)
    mu = trapezoid(p * tau, tau)
    assert mu == pytest.approx((g + 1) / (g + 2), rel=1e-6)
    assert math.sqrt(trapezoid(p * (tau - mu) ** 2, tau)) == pytest.approx(0.10, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Inner product of profiles (Eq. 151)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ta,ga,tb,gb", [
    (0.3, 16.97, 1.0, 6.94), (1.0, 0.72, 0.5, 3.56), (2.0, 6.94, 2.0, 16.97), (1e6, 0.5, 3e6, 40.0),
    (7.0, 1.83, 9.0, 1.83),
])
def test_profile_inner_matches_numerical_integration(ta, ga, tb, gb):
    lo = min(ta, tb)
    # integrate in u = ln(tau) over [ln(lo) - 40, ln(lo)] (the part below is < e^-40 relative), dtau = tau du
    u = np.linspace(math.log(lo) - 40.0, math.log(lo), 400001)
    tau = np.exp(u)
    num = trapezoid(profile(tau, ta, ga) * profile(tau, tb, gb) * tau, u)
    assert profile_inner(ta, ga, tb, gb) == pytest.approx(num, rel=1e-4)


def test_profile_inner_symmetry_self_product_and_no_overflow():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ta, tb = rng.uniform(1, 1e4, 2)
        ga, gb = rng.uniform(0, 50, 2)
        assert profile_inner(ta, ga, tb, gb) == pytest.approx(profile_inner(tb, gb, ta, ga), rel=1e-15)
    for t, g in [(1.0, 16.97), (3.5, 0.72), (1e9, 6.94)]:
        assert profile_inner(t, g, t, g) == pytest.approx((g + 1) ** 2 / ((2 * g + 1) * t), rel=1e-14)
    # t^gamma itself would overflow float64 here (2e9^100 ~ 1e931); the ratio form must not
    v = profile_inner(1e9, 100.0, 2e9, 120.0)
    ref = math.exp(math.log(101) + math.log(121) + 120 * math.log(0.5) - math.log(221) - math.log(2e9))
    assert math.isfinite(v) and v == pytest.approx(ref, rel=1e-12)
    with pytest.raises(ValueError):
        profile_inner(0.0, 1.0, 1.0, 1.0)


# ---------------------------------------------------------------------------------------------------------
# Least-squares solve
# ---------------------------------------------------------------------------------------------------------

def test_exact_recovery_and_columns_sum_to_one():
    steps = np.repeat(np.arange(1, 9) * 100, 2)
    gammas = np.tile([sigma_rel_to_gamma(0.05), sigma_rel_to_gamma(0.10)], 8)
    x = solve_phema(steps, gammas, steps, gammas)
    assert x.shape == (16, 16)
    # a target equal to a stored snapshot is that snapshot (unit vector), snapshots after it get exactly 0
    assert np.abs(x - np.eye(16)).max() < 1e-8
    out_t = [800, 800, 450, 300, 800]
    out_g = [sigma_rel_to_gamma(s) for s in (0.15, 0.02, 0.12, 0.07, 0.25)]
    x = solve_phema(steps, gammas, out_t, out_g)
    assert x.shape == (16, 5)
    np.testing.assert_allclose(x.sum(axis=0), 1.0, rtol=0, atol=1e-12)
    for r, t in enumerate(out_t):
        assert np.all(x[steps > t, r] == 0.0)
        assert np.all(x[steps <= t, r] != 0.0)
    # inputs at t = 0 are unusable (zero coefficient); no usable input at all is an error
    x0 = solve_phema([0, 100, 100], [6.0, 6.0, 17.0], [100], [3.56])
    assert x0[0, 0] == 0.0 and x0[:, 0].sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="usable"):
        solve_phema(steps, gammas, [50], [3.56])
    # duplicated identical inputs (singular A) still give a valid combination
    xd = solve_phema([100, 100, 200], [6.94, 6.94, 16.97], [200], [3.56])
    assert np.all(np.isfinite(xd)) and xd.sum() == pytest.approx(1.0)


def _response_error(n, target_sigma=0.15, sigmas=(0.05, 0.10)):
    """Relative L2 error of the reconstructed response function for n uniform snapshot times in (0, 1]."""
    gs = [sigma_rel_to_gamma(s) for s in sigmas]
    times = np.repeat(np.arange(1, n + 1) / n, len(gs))
    gammas = np.tile(gs, n)
    gr = sigma_rel_to_gamma(target_sigma)
    x = solve_phema(times, gammas, [1.0], [gr])[:, 0]
    cells = 2 ** 17  # midpoints of a grid whose cell edges include every snapshot time (discontinuities)
    tau = (np.arange(cells) + 0.5) / cells
    target = profile(tau, 1.0, gr)
    rec = np.zeros_like(tau)
    for xi, ti, gi in zip(x, times, gammas):
        rec += xi * profile(tau, ti, gi)
    return math.sqrt(np.mean((rec - target) ** 2) / np.mean(target ** 2))


def test_reconstruction_error_shrinks_fourfold_per_doubling():
    errs = {n: _response_error(n) for n in (8, 16, 32, 64)}
    assert 1e-3 < errs[32] < 5e-3  # notes §2.5 measured 2.3e-3
    for n in (16, 32, 64):
        assert 3.0 <= errs[n // 2] / errs[n] <= 5.5, errs
    # a single EMA only halves the error per doubling (MSE ~ 1/n^2): the second EMA is what buys 1/n^4
    one = [_response_error(n, sigmas=(0.10,)) for n in (16, 32)]
    assert 1.6 <= one[0] / one[1] <= 2.5 and one[1] > 5 * errs[32]


# ---------------------------------------------------------------------------------------------------------
# PowerEMA
# ---------------------------------------------------------------------------------------------------------

class Scalar(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([value], dtype=torch.float64))


@pytest.mark.parametrize("sigma_rel", [0.05, 0.10, 0.25])
def test_discrete_ema_equals_closed_form_weights(sigma_rel):
    assert power_ema_beta(1, sigma_rel_to_gamma(sigma_rel)) == 0.0
    m = Scalar(1e6)  # the initial value must get weight exactly 0
    ema = PowerEMA(m, (sigma_rel,))
    g = ema.gammas[0]
    assert g == sigma_rel_to_gamma(sigma_rel)
    rng = np.random.default_rng(1)
    thetas = 5.0 + np.cumsum(rng.normal(size=400))  # random walk
    for k in range(1, 401):
        with torch.no_grad():
            m.theta.fill_(thetas[k - 1])
        ema.update(m, k)
        if k in (1, 7, 100, 400):
            kk = np.arange(1, k + 1)
            w = (kk / k) ** (g + 1) - ((kk - 1) / k) ** (g + 1)
            assert w.sum() == pytest.approx(1.0, abs=1e-12)
            expected = float(np.sum(w * thetas[:k]))
            got = float(ema.averaged(sigma_rel)["theta"])
            assert abs(got - expected) <= 1e-10 * max(1.0, abs(expected)), (k, got, expected)


def test_update_every_k_steps_equals_piecewise_constant_updates():
    # updating every 3rd step (dt = 3) is exact for a trajectory constant over each 3-step interval
    a, b = Scalar(0.0), Scalar(0.0)
    ea, eb = PowerEMA(a, (0.1,)), PowerEMA(b, (0.1,))
    vals = np.random.default_rng(2).normal(size=30)
    for k in range(1, 91):
        with torch.no_grad():
            a.theta.fill_(vals[(k - 1) // 3])
        ea.update(a, k)
        if k % 3 == 0:
            with torch.no_grad():
                b.theta.fill_(vals[k // 3 - 1])
            eb.update(b, k)
    assert float(ea.averaged(0.1)["theta"]) == pytest.approx(float(eb.averaged(0.1)["theta"]), rel=1e-12)
    with pytest.raises(ValueError):
        eb.update(b, 90)  # time must move forward


def _set_params(model, k):
    g = torch.Generator().manual_seed(1000 + k)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) + 0.01 * k)


def test_state_dict_round_trip_resume_is_exact(tmp_path):
    sig = (0.05, 0.10, 0.2)
    model = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3))
    full = PowerEMA(model, sig)
    for k in range(1, 31):
        _set_params(model, k)
        full.update(model, k)

    model = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3))
    first = PowerEMA(model, sig)
    for k in range(1, 18):
        _set_params(model, k)
        first.update(model, k)
    torch.save(first.state_dict(), tmp_path / "ema.pt")
    state = torch.load(tmp_path / "ema.pt", weights_only=True)

    model = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3))  # fresh weights: must be overwritten
    resumed = PowerEMA(model, sig)
    resumed.load_state_dict(state)
    assert resumed.step == 17
    for k in range(18, 31):
        _set_params(model, k)
        resumed.update(model, k)
    assert resumed.step == full.step == 30
    for s in sig:
        a, b = full.averaged(s), resumed.averaged(s)
        assert sorted(a) == ["0.bias", "0.weight", "1.bias", "1.weight"]  # parameters only, no buffers
        for n in a:
            assert a[n].dtype == torch.float32
            assert torch.equal(a[n], b[n]), n
    with pytest.raises(ValueError, match="sigma_rels"):
        PowerEMA(model, (0.05, 0.10)).load_state_dict(state)


def test_snapshot_files_names_metadata_dtype_atomic(tmp_path, monkeypatch):
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model.train()(torch.randn(8, 4))  # give the BN buffers non-default values
    ema = PowerEMA(model, (0.05, 0.10))
    for k in range(1, 6):
        _set_params(model, k)
        ema.update(model, k)
    paths = ema.snapshot(tmp_path, 1234, dict(model.named_buffers()))
    names = ["phema-000001234-0.050.safetensors", "phema-000001234-0.100.safetensors"]
    assert [p.name for p in paths] == names
    assert sorted(os.listdir(tmp_path)) == names  # no temporary files left behind
    for p, s in zip(paths, (0.05, 0.10)):
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata()
        assert meta["step"] == "1234"
        assert float(meta["sigma_rel"]) == s
        assert float(meta["gamma"]) == sigma_rel_to_gamma(s)
        tensors = load_file(p)
        assert set(tensors) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                "1.num_batches_tracked"}
        for n, v in ema.averaged(s).items():
            assert tensors[n].dtype == torch.float16
            assert torch.equal(tensors[n], v.half())
        assert tensors["1.running_mean"].dtype == torch.float16
        assert torch.equal(tensors["1.running_mean"], model[1].running_mean.half())
        assert tensors["1.num_batches_tracked"].dtype == torch.int64
        assert int(tensors["1.num_batches_tracked"]) == 1

    snaps = list_snapshots(tmp_path)
    assert [(sn.step, sn.sigma_rel) for sn in snaps] == [(1234, 0.05), (1234, 0.10)]
    assert snaps[0].gamma == sigma_rel_to_gamma(0.05) and snaps[0].path == paths[0]

    # metadata missing: fall back to the file name
    save_file({"w": torch.zeros(2, dtype=torch.float16)}, str(tmp_path / "phema-000000010-0.070.safetensors"))
    snaps = list_snapshots(tmp_path)
    assert (snaps[0].step, snaps[0].sigma_rel, snaps[0].gamma) == (10, 0.07, sigma_rel_to_gamma(0.07))

    # a crash while writing leaves neither a partial snapshot nor a temporary file
    before = sorted(os.listdir(tmp_path))

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(phema, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ema.snapshot(tmp_path, 2000, {})
    assert sorted(os.listdir(tmp_path)) == before


# ---------------------------------------------------------------------------------------------------------
# Reconstruction from files
# ---------------------------------------------------------------------------------------------------------

def test_reconstruct_streams_each_file_once_per_batch(tmp_path, monkeypatch):
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    ema = PowerEMA(model, (0.05, 0.10))
    for k in range(1, 61):
        _set_params(model, k)
        with torch.no_grad():
            model[1].running_mean.fill_(k)
        ema.update(model, k)
        if k % 10 == 0:
            ema.snapshot(tmp_path, k, dict(model.named_buffers()))
    snaps = list_snapshots(tmp_path)
    assert len(snaps) == 12
    targets = [(60, 0.15), (60, 0.08), (40, 0.12), (60, 0.2), (30, 0.07)]
    batch_size = 2
    x = solve_phema([s.step for s in snaps], [s.gamma for s in snaps], [t for t, _ in targets],
                    [sigma_rel_to_gamma(r) for _, r in targets])
    raw = [load_file(s.path) for s in snaps]  # reference, loaded before the counting starts

    opens, reads = Counter(), Counter()
    depth = [0, 0]  # currently open, max open
    real_open = phema.safe_open

    class CountingOpen:
        def __init__(self, path, *args, **kwargs):
            self._path = str(path)
            self._f = real_open(path, *args, **kwargs)
            opens[self._path] += 1

        def __enter__(self):
            self._f.__enter__()
            depth[0] += 1
            depth[1] = max(depth)
            return self

        def __exit__(self, *exc):
            depth[0] -= 1
            return self._f.__exit__(*exc)

        def get_tensor(self, name):
            reads[(self._path, name)] += 1
            return self._f.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self._f, name)

    monkeypatch.setattr(phema, "safe_open", CountingOpen)
    results = list(reconstruct(snaps, targets, batch_size=batch_size))
    assert [t for t, _ in results] == targets

    n_batches = math.ceil(len(targets) / batch_size)
    assert depth[1] == 1  # never more than one snapshot file open at a time
    for s in snaps:
        used = sum(any(s.step <= targets[c][0] for c in range(lo, min(lo + batch_size, len(targets))))
                   for lo in range(0, len(targets), batch_size))
        assert opens[str(s.path)] == used <= n_batches, (s.path.name, opens[str(s.path)], used)
    assert max(reads.values()) <= n_batches  # every tensor read at most once per batch

    for c, ((step, _), state) in enumerate(results):
        for n in ("0.weight", "0.bias", "1.weight", "1.bias"):
            ref = sum(float(x[i, c]) * raw[i][n].double() for i in range(len(snaps)))
            assert state[n].dtype == torch.float32
            torch.testing.assert_close(state[n].double(), ref, rtol=1e-5, atol=1e-5)
        # buffers come from the latest snapshot at or before the target step
        assert torch.equal(state["1.running_mean"], torch.full((4,), float(step)))
        assert state["1.num_batches_tracked"].dtype == torch.int64

    # a directory works as input too, and a target equal to a stored snapshot returns it
    (_, state), = reconstruct(tmp_path, [(50, 0.10)])
    torch.testing.assert_close(state["0.weight"], load_file(tmp_path / "phema-000000050-0.100.safetensors")
                               ["0.weight"].float(), rtol=0, atol=2e-5)


def test_end_to_end_held_out_ema_is_recovered(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    steps, d_in, d_out = 400, 8, 4
    w_start = torch.randn(d_out, d_in, generator=g)
    w_drift = torch.randn(d_out, d_in, generator=g)
    model = nn.Linear(d_in, d_out)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracked = PowerEMA(model, (0.05, 0.10))
    held = PowerEMA(model, (0.03, 0.13, 0.15))  # held out: tracked directly, never snapshotted
    for k in range(1, steps + 1):
        w_true = w_start + (k / steps) * w_drift  # slowly moving regression target: a drifting trajectory
        xb = torch.randn(16, d_in, generator=g)
        yb = xb @ w_true.T + 0.3 * torch.randn(16, d_out, generator=g)
        loss = ((model(xb) - yb) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        tracked.update(model, k)
        held.update(model, k)
        if k % 20 == 0:
            tracked.snapshot(tmp_path, k, {})
    assert len(list_snapshots(tmp_path)) == 40
    rec = dict(reconstruct(tmp_path, [(steps, 0.15), (steps, 0.03)]))
    names = ["weight", "bias"]
    ref15 = flat(held.averaged(0.15), names)
    err15 = (flat(rec[(steps, 0.15)], names) - ref15).norm() / ref15.norm()
    gap = (flat(held.averaged(0.13), names) - ref15).norm() / ref15.norm()
    nearest_stored = (flat(tracked.averaged(0.10), names) - ref15).norm() / ref15.norm()
    assert gap > 1e-3  # the trajectory moves enough for the comparison to mean something
    assert err15 < 0.1 * gap, (float(err15), float(gap))
    assert err15 < 0.02 * nearest_stored
    # a short target (below the two stored EMAs) from only 20 snapshot times is harder but still far better
    # than the nearest stored EMA
    ref03 = flat(held.averaged(0.03), names)
    err03 = (flat(rec[(steps, 0.03)], names) - ref03).norm() / ref03.norm()
    assert err03 < 0.3 * (flat(tracked.averaged(0.05), names) - ref03).norm() / ref03.norm()


# ---------------------------------------------------------------------------------------------------------
# Dev-only oracle: lucidrains/ema-pytorch (MIT), checked against version 0.8.3
# ---------------------------------------------------------------------------------------------------------

def test_matches_ema_pytorch():
    """Compare with ``ema_pytorch`` (``KarrasEMA``, ``p_dot_p``, ``solve_weights``, ``sigma_rel_to_gamma``).

    Agreement (ema-pytorch 0.8.3): same sigma_rel -> gamma (np.roots of Eq. 126), same closed-form inner product
    (Eq. 151 in ratio form) and the same normal equations solved in float64; ``KarrasEMA`` is the same
    recursion ``theta_hat <- beta theta_hat + (1 - beta) theta`` with ``beta = (1 - 1/t)^(gamma+1)``, and time is
    counted in update calls, as here.

    Differences in conventions (precisely):
    1. ``solve_weights`` returns the raw solution of A x = b; it does **not** divide each column by its sum
       (the official EDM2 code and we do), so its coefficients sum to 1 only approximately.
    2. ``solve_weights`` / ``PostHocEMA.synthesize_ema_model`` use **every** checkpoint, including those taken
       after the target step (t_i > t_r); we (like the paper, Algorithm 3 with 0 < t_i <= t_r) give those
       coefficient 0. When t_r is a snapshot step at which every gamma was stored (the paper's setting) this makes
       no difference: on [0, t_r] a later profile of the same gamma is a multiple of the one at t_r, so the least
       squares solution puts exactly (to 1e-14) zero weight on later snapshots and both agree. For a target step
       between snapshot steps their solution uses later snapshots with O(1) weights (e.g. 1.9 below).
    3. ``KarrasEMA(update_every=N>1)`` still uses beta = (1 - 1/(step+1))^(gamma+1) on each of the sparse
       updates, which is no longer a power-function profile with that gamma (it should use dt = N: ours is
       ``(1 - N/step)^(gamma+1)``). Default ``update_every`` is 100 there, so compare with ``update_every=1``.
    4. ``KarrasEMA`` also averages floating-point buffers and ``synthesize_ema_model`` combines buffers with the
       same weights; we average parameters only and copy buffers from the latest usable snapshot.
    5. Off by one step: ``KarrasEMA.update`` increments its ``step`` buffer *before* computing beta, so its k-th
       update uses ``beta = (1 - 1/(k+1))^(gamma+1)`` (ours: ``(1 - 1/k)^(gamma+1)``); its first update copies
       the weights (so beta there is irrelevant). Its average after K updates therefore equals ours after K+1
       updates in which the first parameter value is fed twice (it counts theta_1 for two time units), while
       its checkpoint files are labelled with step K. The profile it stores is p_{K+1, gamma}, not p_{K, gamma};
       the relative effect is O(1/K) and vanishes in long runs, but it is exact arithmetic, checked below.
    6. Its ``sigma_rel_to_gamma`` does not validate the range (sigma_rel >= 0.2887 silently gives gamma <= 0);
       ours raises ValueError.
    """
    ema_pytorch = pytest.importorskip(
        "ema_pytorch", reason="dev-only oracle: pip install ema-pytorch (MIT, depends only on torch) to run it")
    from ema_pytorch.post_hoc_ema import p_dot_p, solve_weights
    from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma as their_gamma

    for s in (0.02, 0.05, 0.10, 0.15, 0.25):
        assert their_gamma(s) == pytest.approx(sigma_rel_to_gamma(s), rel=1e-9)

    rng = np.random.default_rng(3)
    for _ in range(20):
        ta, tb = rng.integers(1, 10_000, 2)
        ga, gb = rng.uniform(0.5, 30, 2)
        theirs = float(p_dot_p(*(torch.tensor(float(v), dtype=torch.float64) for v in (ta, ga, tb, gb))))
        assert theirs == pytest.approx(profile_inner(ta, ga, tb, gb), rel=1e-12)

    # synthetic snapshots: 24 times x 2 EMAs, targets at the last step (where the conventions coincide)
    steps = np.repeat(np.arange(1, 25) * 500, 2).astype(np.float64)
    gammas = np.tile([sigma_rel_to_gamma(0.05), sigma_rel_to_gamma(0.10)], 24)
    out_g = [sigma_rel_to_gamma(s) for s in (0.03, 0.08, 0.15, 0.22)]
    ours = solve_phema(steps, gammas, [steps[-1]] * 4, out_g)
    theirs = solve_weights(torch.tensor(steps), torch.tensor(gammas), torch.tensor([steps[-1]] * 4),
                           torch.tensor(out_g)).numpy()
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(theirs.sum(axis=0), 1.0, atol=1e-2)  # close to, but not exactly, 1 (diff. 1)
    np.testing.assert_allclose(theirs / theirs.sum(axis=0), ours, rtol=1e-6, atol=1e-9 * np.abs(ours).max())

    # earlier targets (difference 2): at a snapshot step both agree (their later weights vanish); between
    # snapshot steps they put O(1) weight on later snapshots, we put exactly 0
    for t_r, agree in ((6000.0, True), (6250.0, False)):
        theirs = solve_weights(torch.tensor(steps), torch.tensor(gammas), torch.tensor([t_r]),
                               torch.tensor([out_g[2]])).numpy()[:, 0]
        ours = solve_phema(steps, gammas, [t_r], [out_g[2]])[:, 0]
        assert np.all(ours[steps > t_r] == 0.0)
        if agree:
            assert np.abs(theirs[steps > t_r]).max() < 1e-10
            np.testing.assert_allclose(theirs / theirs.sum(), ours, rtol=1e-6, atol=1e-9 * np.abs(ours).max())
        else:
            assert np.abs(theirs[steps > t_r]).max() > 0.1

    # the running EMA itself (difference 5): KarrasEMA(update_every=1) after K updates == PowerEMA after K+1
    # updates with the first value fed twice; plain same-step comparison differs at O(1/K)
    m, m2 = Scalar(0.0), Scalar(0.0)
    karras = ema_pytorch.KarrasEMA(m, sigma_rel=0.10, update_every=1)
    shifted, same = PowerEMA(m, (0.10,)), PowerEMA(m2, (0.10,))
    vals = 3.0 + np.cumsum(rng.normal(size=200))
    with torch.no_grad():
        m.theta.fill_(vals[0])
    shifted.update(m, 1)
    for k in range(1, 201):
        with torch.no_grad():
            m.theta.fill_(vals[k - 1])
            m2.theta.fill_(vals[k - 1])
        karras.update()
        shifted.update(m, k + 1)
        same.update(m2, k)
        if k in (1, 2, 50, 200):
            assert float(karras.ema_model.theta) == pytest.approx(float(shifted.averaged(0.10)["theta"]), rel=1e-12)
    assert float(karras.ema_model.theta) != pytest.approx(float(same.averaged(0.10)["theta"]), rel=1e-6)
