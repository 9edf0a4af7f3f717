"""Flow matching (diffusion/flow.py) and VP's v-prediction and min-SNR weighting (diffusion/vp.py), issue 29.

References: closed-form velocity fields of Gaussian (mixture) data integrated by RK4 in float64; the analytic
irreducible loss of the exact velocity; diffusers' FlowMatchEulerDiscreteScheduler stepping the same velocity
on the same grid; the losses written out in float64. Then every backbone, the CLI, exact resume, and bad input.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import toy, toy_sets
from steadydiff.cli import EXIT_USER_ERROR, main
from steadydiff.config import DiffusionConfig, load_config
from steadydiff.diffusion import VPSDE, FlowFormulation, Guided, build_formulation, generate
from steadydiff.diffusion import edm as edm_module
from steadydiff.diffusion import flow as flow_module
from steadydiff.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------------------------------------------------
# Closed forms


class Mixture(nn.Module):
    """Exact predictions of a 1-D two-component Gaussian mixture (weights PI, means MU, std S) on the flow path
    x_t = (1 - t) x0 + t eps, called like a `FlowModel`: (x, t, labels) -> velocity, eps or x0.

    Per component k: x_t ~ N((1 - t) mu_k, V_k), V_k = (1 - t)^2 s_k^2 + t^2, E[x0 | x_t, k] = mu_k + (1 - t)
    s_k^2 (x - (1 - t) mu_k) / V_k and E[eps | x_t, k] = t (x - (1 - t) mu_k) / V_k; the mixture weighs them by
    the posterior of k. A label c >= 0 conditions on component c; the null label (< 0) gives the mixture. The
    velocity E[eps] - E[x0] has no 1/t or 1/(1 - t), so it is defined on all of [0, 1]."""

    PI, MU, S = (0.3, 0.7), (-1.5, 1.0), (0.4, 0.6)

    def __init__(self, prediction: str = "velocity"):
        super().__init__()
        self.prediction = prediction

    @classmethod
    def parts(cls, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None):
        pi, mu, s = (torch.tensor(v, dtype=x.dtype) for v in (cls.PI, cls.MU, cls.S))
        t = torch.as_tensor(t).to(x.dtype).reshape(-1, 1)
        var = (1 - t) ** 2 * s**2 + t**2
        m = (1 - t) * mu
        logp = torch.log(pi) - 0.5 * torch.log(var) - 0.5 * (x - m) ** 2 / var
        if labels is not None:
            pick = torch.where(torch.arange(2) == labels.clamp(min=0).reshape(-1, 1), 0.0, -math.inf).to(x.dtype)
            logp = torch.where(labels.reshape(-1, 1) >= 0, pick, logp)
        post = torch.softmax(logp, dim=1)
        x0 = (post * (mu + (1 - t) * s**2 * (x - m) / var)).sum(1, keepdim=True)
        eps = (post * (t * (x - m) / var)).sum(1, keepdim=True)
        return x0, eps

    @classmethod
    def velocity(cls, x, t, labels=None):
        x0, eps = cls.parts(x, t, labels)
        return eps - x0

    @classmethod
    def moments(cls) -> tuple[float, float]:
        mean = sum(p * m for p, m in zip(cls.PI, cls.MU))
        return mean, sum(p * (s * s + m * m) for p, m, s in zip(cls.PI, cls.MU, cls.S)) - mean**2

    def forward(self, x, t, labels=None):
        x0, eps = self.parts(x, t, labels)
        return {"velocity": eps - x0, "eps": eps, "x0": x0}[self.prediction]


def rk4(f, x: torch.Tensor, steps: int) -> torch.Tensor:
    """Classical RK4 on dx/dt = f(x, t) from t = 1 to t = 0 on a uniform grid, float64."""
    ts = torch.linspace(1, 0, steps + 1, dtype=torch.float64).tolist()
    for a, b in zip(ts[:-1], ts[1:]):
        h = b - a
        k1 = f(x, a)
        k2 = f(x + h / 2 * k1, a + h / 2)
        k3 = f(x + h / 2 * k2, a + h / 2)
        k4 = f(x + h * k3, b)
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return x


def _x_T(n: int = 4000, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, 1), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(scope="module")
def reference():
    """RK4 (300 steps; 150 differ by < 1e-7) of the exact mixture velocity from x_T: where every ODE sampler
    must land."""
    x = _x_T()
    f = lambda x, t: Mixture.velocity(x, torch.full((x.shape[0],), t, dtype=x.dtype))  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run outside `one_thread`
    try:
        ref = rk4(f, x, 300)
        assert (ref - rk4(f, x, 150)).abs().max() < 1e-7
    finally:
        torch.set_num_threads(threads)
    return x, ref


def test_euler_and_heun_on_the_exact_velocity_match_rk4_at_their_order_and_the_data_moments(reference):
    x, ref = reference
    flow = FlowFormulation()

    def err(sampler, steps, form=flow, model=None):
        return float((form.generate(model or Mixture(), x, sampler, steps) - ref).abs().max())

    e_euler = [err("euler", n) for n in (100, 200)]
    e_heun = [err("heun", n) for n in (25, 50)]
    assert e_euler[1] < 0.04 and 1.7 < e_euler[0] / e_euler[1] < 2.3  # first order
    assert e_heun[1] < 3e-3 and 3.3 < e_heun[0] / e_heun[1] < 4.7  # second order
    # the shifted grid (SD3, shift 3) and the eps and x0 predictions integrate the same ODE
    assert err("heun", 50, FlowFormulation(shift=3.0)) < 2e-2
    for prediction in ("eps", "x0"):
        assert err("heun", 50, FlowFormulation(prediction=prediction), Mixture(prediction)) < 2e-3, prediction
    # the ODE carries N(0, 1) to the data: the samples' moments are the mixture's within Monte Carlo error
    mean, var = Mixture.moments()
    out = flow.generate(Mixture(), x, "heun", 50)
    m4 = float(((out - out.mean()) ** 4).mean())
    assert abs(float(out.mean()) - mean) < 4 * math.sqrt(var / len(x))
    assert abs(float(out.var()) - var) < 4 * math.sqrt((m4 - var**2) / len(x))


def test_the_sde_sampler_reaches_the_data_moments_and_is_driven_by_its_generator():
    """Euler-Maruyama with g^2 = 2 t and the score from the velocity: the samples' mean and variance are the
    data's within Monte Carlo error (a missing or wrong score term inflates or shrinks the variance)."""
    x = _x_T()
    flow = FlowFormulation()

    def draw(seed):
        return flow.generate(Mixture(), x, "em", 200, generator=torch.Generator().manual_seed(seed))

    out = draw(1)
    mean, var = Mixture.moments()
    m4 = float(((out - out.mean()) ** 4).mean())
    assert abs(float(out.mean()) - mean) < 4 * math.sqrt(var / len(x))
    assert abs(float(out.var()) - var) < 4 * math.sqrt((m4 - var**2) / len(x))
    assert torch.equal(out, draw(1)) and not torch.equal(out, draw(2))


def test_euler_steps_equal_diffusers_flow_match_euler_scheduler_on_the_same_shifted_grid():
    """diffusers' FlowMatchEulerDiscreteScheduler (its sigmas are our t): given our unshifted grid and shift 3,
    it shifts it to our grid and steps x + (sigma_next - sigma) v, the same velocity, in float32."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (the dev extra)")
    steps, shift = 12, 3.0
    flow = FlowFormulation(shift=shift)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(sigmas=torch.linspace(1, 0, steps + 1, dtype=torch.float64)[:-1].tolist())
    torch.testing.assert_close(scheduler.sigmas.double(), flow.time_grid(steps), rtol=0, atol=1e-6)
    x = torch.randn(256, 1, generator=torch.Generator().manual_seed(0))
    ours = flow.generate(Mixture(), x, "euler", steps)
    theirs = x.clone()
    for i, timestep in enumerate(scheduler.timesteps):
        v = Mixture.velocity(theirs, scheduler.sigmas[i].expand(len(theirs)))
        theirs = scheduler.step(v, timestep, theirs).prev_sample
    assert theirs.dtype == ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (ours - x).abs().mean() > 0.2  # it moved


# ---------------------------------------------------------------------------------------------------------
# Losses


class Gaussian(nn.Module):
    """The exact predictions for data N(MU, diag(S^2)) on the flow path: x_t ~ N((1 - t) MU, V), V = (1 - t)^2
    S^2 + t^2; E[eps | x] = t (x - (1 - t) MU) / V, E[x0 | x] = MU + (1 - t) S^2 (x - (1 - t) MU) / V."""

    MU, S = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64), torch.tensor([0.3, 1.0, 2.0], dtype=torch.float64)

    def __init__(self, prediction: str):
        super().__init__()
        self.prediction = prediction

    def forward(self, x, t, labels=None):
        t = t.reshape(-1, 1)
        var = (1 - t) ** 2 * self.S**2 + t**2
        centred = x - (1 - t) * self.MU
        eps, x0 = t * centred / var, self.MU + (1 - t) * self.S**2 * centred / var
        return {"velocity": eps - x0, "eps": eps, "x0": x0}[self.prediction]

    @classmethod
    def irreducible(cls, t: float) -> dict[str, float]:
        """E[loss] of the exact predictor at t, per element: Var(eps - x0 | x_t) = S^2 / V (the covariances
        cancel: (1 + S^2) V - (t - (1 - t) S^2)^2 = S^2), Var(eps | x_t) = (1 - t)^2 S^2 / V and
        Var(x0 | x_t) = t^2 S^2 / V."""
        var = (1 - t) ** 2 * cls.S**2 + t**2
        v = cls.S**2 / var
        return {"velocity": float(v.mean()), "eps": float(((1 - t) ** 2 * v).mean()),
                "x0": float((t**2 * v).mean())}


@pytest.mark.parametrize("sampling", [{}, {"t_sampling": "logit_normal", "t_mean": 0.3, "t_std": 0.8, "shift": 2.0}])
def test_the_exact_predictors_loss_is_the_analytic_irreducible_value_and_base_loss_the_velocity_mse(sampling):
    n, g = 20_000, torch.Generator().manual_seed(0)
    x0 = Gaussian.MU + Gaussian.S * torch.randn(n, 3, generator=g, dtype=torch.float64)
    noise = torch.randn(n, 3, generator=g, dtype=torch.float64)
    for s in (0.05, 0.3, 0.6, 0.95):
        level = torch.full((n,), s, dtype=torch.float64)
        for prediction in ("velocity", "eps", "x0"):
            flow = FlowFormulation(prediction=prediction, **sampling)
            t = float(flow.time(level[:1]))
            want = Gaussian.irreducible(t)
            model = Gaussian(prediction)
            loss = flow.loss(model, x0, t=level, noise=noise)
            base = flow.base_loss(model, x0, None, level, noise)
            for got, ref in ((loss, want[prediction]), (base, want["velocity"])):
                assert loss.dtype == torch.float64
                assert abs(float(got.mean()) - ref) < 4 * float(got.std()) / math.sqrt(n), (s, prediction, ref)
            # base_loss is the velocity MSE of the implied velocity, written out
            xt = (1 - t) * x0 + t * noise
            implied = flow.velocity(model, xt, level.new_full((n,), t))
            torch.testing.assert_close(base, (implied - (noise - x0)).pow(2).mean(1), rtol=1e-9, atol=1e-12)


def test_the_normalised_level_maps_to_the_logit_normal_quantile_then_the_sd3_shift():
    """t(s) = shift(sigmoid(m + sd Phi^{-1}(s))) with Phi^{-1} from the standard library; s ~ U(t_eps, 1 - t_eps)
    is the base draw, so CLTS, the probes and the validation bins work in s unchanged."""
    flow = FlowFormulation(t_sampling="logit_normal", t_mean=-0.4, t_std=1.3, shift=3.0)
    s = [1e-5, 0.01, 0.2, 0.5, 0.77, 0.99, 1 - 1e-5]
    got = flow.time(torch.tensor(s, dtype=torch.float64))
    for si, ti in zip(s, got.tolist()):
        u = 1 / (1 + math.exp(-(-0.4 + 1.3 * statistics.NormalDist().inv_cdf(si))))
        assert ti == pytest.approx(3 * u / (1 + 2 * u), rel=1e-12, abs=1e-15)
    assert FlowFormulation().time(torch.tensor([0.25])).item() == 0.25  # uniform, no shift: t = s
    draws = flow.sample_t(10_000, torch.Generator().manual_seed(0))
    assert draws.dtype == torch.float32 and 1e-5 <= draws.min() and draws.max() <= 1 - 1e-5
    assert flow.level_range() == (1e-5, 1 - 1e-5)
    # the grid: SD3's shift of the uniform grid, from 1 to 0 (eps-prediction starts at 1 - t_eps)
    grid = flow.time_grid(4)
    u = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    torch.testing.assert_close(grid, 3 * u / (1 + 2 * u), rtol=0, atol=1e-15)
    assert FlowFormulation(prediction="eps").time_grid(2).tolist() == [1 - 1e-5, 0.5 * (1 - 1e-5), 0.0]


def _vp_coefficients(t: torch.Tensor, beta_min: float = 0.1, beta_max: float = 20.0):
    """alpha, sigma of the VP-SDE written out (Song et al. 2021, eq. 29), float64."""
    log_alpha = -0.25 * t**2 * (beta_max - beta_min) - 0.5 * t * beta_min
    alpha = torch.exp(log_alpha)
    return alpha, torch.sqrt(1 - alpha**2)


class Net(nn.Module):
    """A fixed nonlinear stand-in network in float64, called like a VP backbone (x, 999 t, labels)."""

    def __init__(self, dim: int = 4, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(dim, dim, generator=g, dtype=torch.float64) / 2
        self.b = torch.randn(dim, generator=g, dtype=torch.float64)

    def forward(self, x, tm, labels=None):
        return torch.tanh(x @ self.w + self.b * tm.reshape(-1, 1) / 999)


def test_vp_v_prediction_and_min_snr_losses_equal_their_formulas_in_float64():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    t = torch.tensor([0.02, 0.1, 0.3, 0.7], dtype=torch.float64)  # SNR 1e2, 8.6 (> gamma 5), 0.66, 0.005
    alpha, sigma = (c[:, None] for c in _vp_coefficients(t))
    snr = (alpha / sigma)[:, 0] ** 2
    assert (snr[:2] > 5).all() and (snr[2:] < 5).all()
    xt = alpha * x0 + sigma * noise
    net = Net()
    out = net(xt, 999 * t)
    mse_eps = (out - noise).pow(2).mean(1)
    mse_v = (out - (alpha * noise - sigma * x0)).pow(2).mean(1)

    def vp(**kw):
        return VPSDE.from_config(DiffusionConfig(**kw))

    # the default stays the eps-MSE (bit for bit against old runs: tests/test_contract.py)
    torch.testing.assert_close(vp().loss(net, x0, t=t, noise=noise), mse_eps, rtol=1e-12, atol=0)
    torch.testing.assert_close(vp(prediction="v").loss(net, x0, t=t, noise=noise), mse_v, rtol=1e-12, atol=0)
    clip = torch.clamp(snr, max=5.0)
    torch.testing.assert_close(vp(weighting="min_snr").loss(net, x0, t=t, noise=noise), clip / snr * mse_eps,
                               rtol=1e-12, atol=0)
    v_min_snr = vp(prediction="v", weighting="min_snr", min_snr_gamma=2.0)
    torch.testing.assert_close(v_min_snr.loss(net, x0, t=t, noise=noise), torch.clamp(snr, max=2.0) / (snr + 1) * mse_v,
                               rtol=1e-12, atol=0)
    # Both min-SNR forms are min(SNR, gamma) x the x0-MSE of the same denoiser: a v-network consistent with the
    # eps-network (v = (eps - sigma x_t) / alpha) has the same min-SNR loss (Hang et al.'s x0-space weight).
    x0_hat = (xt - sigma * out) / alpha
    x0_space = clip * (x0_hat - x0).pow(2).mean(1)

    class Consistent(nn.Module):
        def forward(self, x, tm, labels=None):
            a, s = (c[:, None] for c in _vp_coefficients(tm / 999))
            return (net(x, tm) - s * x) / a

    torch.testing.assert_close(vp(weighting="min_snr").loss(net, x0, t=t, noise=noise), x0_space, rtol=1e-10, atol=0)
    torch.testing.assert_close(vp(prediction="v", weighting="min_snr").loss(Consistent(), x0, t=t, noise=noise),
                               x0_space, rtol=1e-10, atol=0)
    # the validation yardstick stays the eps-MSE of the implied eps, whatever the prediction and weighting
    for form, model in ((vp(weighting="min_snr"), net), (vp(prediction="v", weighting="min_snr"), Consistent())):
        torch.testing.assert_close(form.base_loss(model, x0, None, t, noise), mse_eps, rtol=1e-10, atol=0)


@pytest.mark.parametrize("sampler", ["ddim", "dpmpp2m", "em"])
def test_vp_samplers_convert_a_v_prediction(sampler):
    """The exact eps and the exact v (alpha eps - sigma x0) of Gaussian data give the same samples."""
    mu, s = 0.5, 0.7
    sde_eps, sde_v = VPSDE(), VPSDE(prediction="v")

    def exact(x, tm):
        a, sg = (c.reshape(-1, 1) for c in sde_eps.alpha_sigma(tm / 999))
        var = a**2 * s**2 + sg**2
        return sg * (x - a * mu) / var, mu + a * s**2 * (x - a * mu) / var, a, sg

    class Eps(nn.Module):
        def forward(self, x, tm, labels=None):
            return exact(x, tm)[0]

    class V(nn.Module):
        def forward(self, x, tm, labels=None):
            eps, x0, a, sg = exact(x, tm)
            return a * eps - sg * x0

    x = torch.randn(500, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = sde_eps.generate(Eps(), x, sampler, 50, generator=torch.Generator().manual_seed(1))
    b = sde_v.generate(V(), x, sampler, 50, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    assert abs(float(a.mean()) - mu) < 0.1 and abs(float(a.std()) - s) < 0.1


# ---------------------------------------------------------------------------------------------------------
# Guidance on the velocity


def test_guided_flow_sampling_matches_the_integrated_guided_ode_and_the_interval_is_in_t_over_1_minus_t():
    x, labels = _x_T(500), torch.ones(500, dtype=torch.long)
    flow = FlowFormulation()
    means = []
    for w in (1.0, 3.0):
        got = flow.generate(Guided(Mixture(), w), x, "heun", 60, labels)

        def f(x, t, w=w):
            tt = torch.full((x.shape[0],), t, dtype=x.dtype)
            u = Mixture.velocity(x, tt, torch.full_like(labels, -1))
            return u + w * (Mixture.velocity(x, tt, labels) - u)

        ref = rk4(f, x, 150)
        assert (got - ref).abs().max() < 3e-3, w
        means.append(float(got.mean()))
    assert means[0] == pytest.approx(Mixture.MU[1], abs=0.03) and means[1] > means[0] + 0.1
    # interval: sigma = t / (1 - t); guided inside [0.5, 2] (t in [1/3, 2/3]), the conditional model outside
    t = torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0], dtype=torch.float64)
    xs, lab = x[:5], labels[:5]
    g = Guided(Mixture(), 3.0, interval=(0.5, 2.0), sigma_of=flow.sigma_of_input)(xs, t, lab)
    inside = torch.tensor([False, True, True, False, False])
    assert torch.equal(g[inside], Guided(Mixture(), 3.0)(xs, t, lab)[inside])
    assert torch.equal(g[~inside], Mixture()(xs, t, lab)[~inside])


# ---------------------------------------------------------------------------------------------------------
# The network's time input


class Recorder(nn.Module):
    def __init__(self, convention: str):
        super().__init__()
        self.time_input, self.seen = convention, None

    def forward(self, x, t, labels=None):
        self.seen = t
        return x


def test_the_backbone_sees_999_t_or_edms_c_noise_of_sigma_t_over_1_minus_t():
    assert set(flow_module.TIME_INPUTS) == set(edm_module.TIME_INPUT_SCALES)  # every convention a backbone declares
    t = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0])
    for convention in flow_module.TIME_INPUTS:
        net = Recorder(convention)
        model = FlowFormulation().wrap(net)
        model(torch.zeros(5, 2), t)
        if convention == "vp_time":
            torch.testing.assert_close(net.seen, 999 * t)
        else:  # ln(sigma) / 4 with sigma = t / (1 - t), t kept in [1e-5, 1 - 1e-5]
            tc = t.clamp(1e-5, 1 - 1e-5).double()  # the float32 ends
            torch.testing.assert_close(net.seen.double(), torch.log(tc / (1 - tc)) / 4, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="time_input = one of vp_time, c_noise"):
        FlowFormulation().wrap(nn.Linear(2, 2))
    flow = FlowFormulation(t_sampling="logit_normal")
    s = torch.tensor([0.1, 0.5])
    torch.testing.assert_close(flow.model_time(s), flow.time(s))
    torch.testing.assert_close(flow.sigma_of_input(torch.tensor([0.5, 0.8])), torch.tensor([1.0, 4.0]))


# ---------------------------------------------------------------------------------------------------------
# Every backbone trains and samples; the commands; exact resume

FLOW = ["diffusion.kind=flow", "train.sample_sampler=heun"]
IMG = ["data.name=fashion_mnist", "data.max_items=16", "train.batch_size=4", "train.steps=2", "train.log_every=1",
       "train.sample_n=2",
       "train.sample_steps=2", "train.threads=1", "train.warmup_steps=1", "model.channels=8", "model.num_heads=1",
       "model.channel_mult=[1,2]", "model.num_res_blocks=1", "model.attn_resolutions=[]", "model.depth=2",
       "model.embed_dim=16", "model.patch_size=4", "model.channels_per_head=8", "diagnostics.grad_every=0"]
BACKBONES = {
    "unet": IMG + ["model.skip_scaling=cs", "diagnostics.probe_every=1", "diagnostics.probe_size=4"],
    "uvit": IMG + ["model.skip_scaling=ls", "diffusion.prediction=x0"],
    "edm2": IMG + ["diffusion.prediction=eps"],
    "mlp_unet": toy("train.steps=2", "model.skip_scaling=cs"),
}


def test_every_registered_backbone_has_a_flow_case():
    from steadydiff.nn import BACKBONES as REGISTERED

    assert set(BACKBONES) == set(REGISTERED)


@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_every_backbone_trains_and_samples_under_flow(backbone, tmp_path):
    cfg = load_config(None, [*BACKBONES[backbone], *FLOW, f"model.backbone={backbone}"])
    tr = Trainer(cfg, tmp_path / "r", show_progress=False)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    assert isinstance(tr.model, flow_module.FlowModel)
    tr.fit()
    rows = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    if "diagnostics.probe_every=1" in BACKBONES[backbone]:  # ScaleLong's coefficients reach the probe
        assert any(k.startswith("probe/kappa/") for r in rows for k in r)
    for sampler in ("euler", "heun", "em"):
        x = tr.sample(2, sampler, 3, seed=0)
        assert x.shape == (2, *tr.dataset.sample_shape) and torch.isfinite(x).all(), sampler
        if x.dim() == 4:
            assert x.abs().max() <= 1 + 1e-5  # images: x0_hat clipped on every step (to float round-off)


def test_a_diffusers_unet_trains_and_samples_under_flow(tmp_path):
    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (the dev extra)")
    from steadydiff.nn.diffusers_compat import DiffusersUNetAdapter

    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=28, in_channels=1, out_channels=1, layers_per_block=1,
                                 block_out_channels=(8, 16), norm_num_groups=4,
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"))
    cfg = load_config(None, [*IMG, *FLOW])
    tr = Trainer(cfg, tmp_path / "r", show_progress=False, model=DiffusersUNetAdapter(unet))
    tr.fit()
    losses = [json.loads(ln).get("loss") for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for v in losses if v is not None)
    x = generate(tr.ema.model, tr.diffusion, (1, 28, 28), 2, "heun", 2, seed=0)
    assert x.shape == (2, 1, 28, 28) and torch.isfinite(x).all()


def test_sample_eval_phema_and_diagnose_on_a_flow_run(tmp_path, capsys):
    run = tmp_path / "run"
    sets = toy_sets("train.steps=4", "train.ckpt_every=2", "train.ema_sigma_rels=[0.1]", "diffusion.kind=flow",
                    "train.sample_sampler=euler", "diffusion.t_sampling=logit_normal")
    assert main(["train", "--out", str(run), "--quiet", *sets]) == 0
    assert main(["sample", str(run), "--n", "4", "--steps", "3", "--sampler", "em",
                 "--out", str(tmp_path / "s.png")]) == 0
    assert main(["eval", str(run), "--metric", "sw", "--n", "32", "--steps", "3", "--out",
                 str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["metrics"]["sw"] > 0
    assert main(["phema", str(run), "--sigma-rel", "0.08", "--out", str(tmp_path / "ph")]) == 0
    (folder,) = (tmp_path / "ph").iterdir()
    assert main(["sample", str(folder), "--n", "2", "--steps", "2", "--out", str(tmp_path / "p.png")]) == 0
    assert main(["diagnose", str(run), "--out", str(tmp_path / "diag")]) == 0
    report = json.loads((tmp_path / "diag" / "stability.json").read_text())["runs"]["run"]
    assert all(math.isfinite(v) and v > 0 for v in report["sensitivity_vs_t"].values())
    capsys.readouterr()


def test_a_flow_run_resumes_exactly_with_clts_mdlrc_power_ema_and_validation(assert_resume_exact):
    runs = assert_resume_exact(
        toy("diffusion.kind=flow", "train.sample_sampler=heun", "diffusion.t_sampling=logit_normal",
            "diffusion.shift=2", "diffusion.prediction=x0", "train.timesteps=clts", "train.clts_steps=6",
            "train.momentum=mdlrc", "train.momentum_steps=6", "train.ema_sigma_rels=[0.1]", "train.ckpt_every=3",
            "diagnostics.val_every=3", "diagnostics.val_size=32", "diagnostics.val_bins=4"),
        6, losses=0, weights=0)
    val = [[r[k] for k in sorted(r) if k.startswith("val/")] for r in map(json.loads, (runs.split / "metrics.jsonl")
           .read_text().splitlines()) if "val/loss" in r]
    full = [[r[k] for k in sorted(r) if k.startswith("val/")] for r in map(json.loads, (runs.full / "metrics.jsonl")
            .read_text().splitlines()) if "val/loss" in r]
    assert len(full) == 2 and val == full


# ---------------------------------------------------------------------------------------------------------
# Bad input (item 5): one line naming the fix, exit 2, nothing written or overwritten


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_run_shared):
    r = tmp_path_factory.mktemp("flow_bad_input")
    shutil.copytree(toy_run_shared, r / "run")  # a VP run (eps-prediction)
    assert main(["train", "--out", str(r / "flowrun"), "--quiet",
                 *toy_sets("train.steps=2", "diffusion.kind=flow", "train.sample_sampler=euler")]) == 0
    return r


def _fingerprint(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


VP_RUN = toy_sets("train.steps=2", "diagnostics.grad_every=0")  # the settings of the shared toy run
FLOW_RUN = toy_sets("train.steps=2", "diffusion.kind=flow", "train.sample_sampler=euler")
EDM = ["--set", "diffusion.kind=edm", "--set", "train.sample_sampler=heun"]
BAD = [
    ("v-on-edm", ["train", "--out", "{R}/new", *VP_RUN, *EDM, "--set", "diffusion.prediction=v"],
     "diffusion.prediction=v does not apply to diffusion.kind=edm; remove it"),
    ("velocity-on-vp", ["train", "--out", "{R}/new", *VP_RUN, "--set", "diffusion.prediction=velocity"],
     "choose one of eps, v"),
    ("t-sampling-on-vp", ["train", "--out", "{R}/new", *VP_RUN, "--set", "diffusion.t_sampling=logit_normal"],
     "diffusion.t_sampling applies to diffusion.kind=flow"),
    ("shift-on-edm", ["train", "--out", "{R}/new", *VP_RUN, *EDM, "--set", "diffusion.shift=3"],
     "diffusion.shift applies to diffusion.kind=flow"),
    ("t-std-on-edm", ["train", "--out", "{R}/new", *VP_RUN, *EDM, "--set", "diffusion.t_std=2"],
     "diffusion.t_std applies to diffusion.kind=flow"),
    ("t-mean-on-uniform", ["train", "--out", "{R}/new", *FLOW_RUN, "--set", "diffusion.t_mean=0.5"],
     "set it, or remove them"),
    ("min-snr-on-flow", ["train", "--out", "{R}/new", *FLOW_RUN, "--set", "diffusion.weighting=min_snr"],
     "diffusion.weighting applies to diffusion.kind=vp"),
    ("min-snr-gamma-zero", ["train", "--out", "{R}/new", *VP_RUN, "--set", "diffusion.weighting=min_snr",
                            "--set", "diffusion.min_snr_gamma=0"], "diffusion.min_snr_gamma: must be > 0"),
    ("min-snr-gamma-negative", ["train", "--out", "{R}/new", *VP_RUN, "--set", "diffusion.weighting=min_snr",
                                "--set", "diffusion.min_snr_gamma=-1"], "diffusion.min_snr_gamma: must be > 0"),
    ("vp-sampler-on-flow", ["train", "--out", "{R}/new", *FLOW_RUN, "--set", "train.sample_sampler=ddim"],
     "sampler 'ddim' does not apply to diffusion.kind=flow; choose one of euler, heun, em"),
    ("flow-sampler-on-vp", ["train", "--out", "{R}/new", *VP_RUN, "--set", "train.sample_sampler=euler"],
     "sampler 'euler' does not apply to diffusion.kind=vp; choose one of em, ddim, dpmpp2m"),
    ("sample-vp-sampler-on-flow-run", ["sample", "{R}/flowrun", "--sampler", "dpmpp2m", "--out", "{R}/x.png"],
     "--sampler: sampler 'dpmpp2m' does not apply to diffusion.kind=flow"),
    ("resume-with-another-kind", ["train", "--out", "{R}/run", *VP_RUN, "--set", "diffusion.kind=flow",
                                  "--set", "train.sample_sampler=euler"], "diffusion.kind: 'vp' -> 'flow'"),
    ("resume-with-another-prediction", ["train", "--out", "{R}/run", *VP_RUN, "--set", "diffusion.prediction=v"],
     "diffusion.prediction: None -> 'v'"),
    ("resume-flow-with-another-prediction", ["train", "--out", "{R}/flowrun", *FLOW_RUN,
                                             "--set", "diffusion.prediction=x0"], "use a new --out directory"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_formulation_settings_are_one_line_naming_the_fix_and_change_nothing(argv, needle, world, capsys):
    before = _fingerprint(world)
    code = main([a.replace("{R}", str(world)) for a in argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == EXIT_USER_ERROR and len(err) == 1 and err[0].startswith("steadydiff: error: "), err
    assert needle in err[0], err[0]
    assert _fingerprint(world) == before and not (world / "new").exists() and not (world / "x.png").exists()


def test_the_bad_settings_are_config_errors_before_anything_is_built():
    from steadydiff.config import ConfigError

    for overrides in (["diffusion.kind=edm", "train.sample_sampler=heun", "diffusion.prediction=v"],
                      ["diffusion.t_sampling=logit_normal"], ["diffusion.min_snr_gamma=0"]):
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        assert "\n" not in str(e.value)
    cfg = load_config(None, FLOW)  # and a good flow config builds the registered formulation
    assert isinstance(build_formulation(cfg.diffusion), FlowFormulation)
