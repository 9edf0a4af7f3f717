"""EDM formulation: preconditioning, loss weighting, noise levels, samplers, LR schedules, training."""

import math

import pytest
import torch

from steadydiff.config import DiffusionConfig, load_config
from steadydiff.diffusion import EDMFormulation, sample_euler, sample_heun
from steadydiff.nn import UNet
from steadydiff.train import InverseSqrt, WarmupConstant, WarmupCosine

SD = 0.5


pytestmark = pytest.mark.usefixtures("one_thread")


def edm(**kw):
    return EDMFormulation.from_config(DiffusionConfig(kind="edm", **kw))


def test_at_init_D_is_c_skip_x_and_lambda_loss_is_one():
    torch.manual_seed(0)
    f = edm(learn_uncertainty=False)
    net = UNet(in_channels=1, resolution=8, channels=8, channel_mult=[1, 2], num_res_blocks=1, attn_resolutions=[])
    model = f.wrap(net)  # UNet's output conv is zero-initialised: F = 0 at init
    x = torch.randn(4, 1, 8, 8)
    sigma = torch.tensor([0.01, 0.5, 3.0, 60.0])
    c_skip = SD**2 / (sigma**2 + SD**2)
    torch.testing.assert_close(model(x, sigma), c_skip.view(-1, 1, 1, 1) * x)
    # With data of std sigma_data, E[lambda(sigma) (D - x0)^2] = 1 for every sigma (EDM2 Sec. 2):
    # (c_skip - 1)^2 sd^2 + c_skip^2 sigma^2 = sigma^2 sd^2 / (sigma^2 + sd^2) = 1 / lambda.
    x0 = torch.randn(4096, 1, 8, 8) * SD
    for s in [0.02, 0.3, 1.0, 10.0]:
        t = f.level(torch.full((4096,), s))
        weighted = f.loss(model, x0, t=t, noise=torch.randn_like(x0))
        # 262k elements: the mean of a scaled chi-square is within ~1% (8 std errors ~ 2%).
        assert weighted.mean().item() == pytest.approx(1.0, rel=0.02)


def test_loss_uses_the_learned_uncertainty():
    torch.manual_seed(0)
    f = edm()
    model = f.wrap(UNet(in_channels=1, resolution=8, channels=8, channel_mult=[1], num_res_blocks=1,
                        attn_resolutions=[]))
    x0, noise = torch.randn(3, 1, 8, 8), torch.randn(3, 1, 8, 8)
    t = torch.tensor([0.1, 0.5, 0.9])
    sigma = f.sigma(t)
    d = model(x0 + sigma.view(-1, 1, 1, 1) * noise, sigma)
    err = (d - x0).pow(2).flatten(1).mean(1)
    u = model.log_variance(sigma)
    assert u.abs().sum() > 0  # u(sigma) is a real learned function, non-zero at init
    lam = (sigma**2 + SD**2) / (sigma * SD) ** 2
    torch.testing.assert_close(f.loss(model, x0, t=t, noise=noise), lam / u.exp() * err + u)
    f.loss(model, x0, t=t, noise=noise).mean().backward()
    assert all(p.grad is not None for p in model.logvar.parameters() if p.requires_grad)


def test_noise_levels_follow_the_log_normal():
    f = edm(p_mean=-0.4, p_std=1.0)
    s = torch.tensor([0.1, 0.5, 0.9])
    torch.testing.assert_close(f.level(f.sigma(s)), s, rtol=0, atol=1e-6)
    assert f.sigma(torch.tensor([0.5])).item() == pytest.approx(math.exp(-0.4), rel=1e-6)
    g = torch.Generator().manual_seed(0)
    log_sigma = f.sigma(f.sample_t(200_000, generator=g)).log().double()
    # 200k draws: standard errors 0.0022 (mean) and 0.0016 (std); 5 std errors.
    assert log_sigma.mean().item() == pytest.approx(-0.4, abs=0.011)
    assert log_sigma.std().item() == pytest.approx(1.0, abs=0.008)


def test_sigma_grid():
    f = edm()
    grid = f.sigma_grid(18)
    assert len(grid) == 19 and grid[0].item() == pytest.approx(80.0) and grid[-2].item() == pytest.approx(0.002)
    assert grid[-1] == 0 and (grid[1:] < grid[:-1]).all()


def _gaussian_denoiser(m, s):
    # Exact D for data N(m, s^2): E[x0 | x] = m + s^2 / (s^2 + sigma^2) (x - m).
    def denoise(x, sigma):
        sig = sigma.view(-1, *([1] * (x.ndim - 1))).to(x.dtype)
        return m + s**2 / (s**2 + sig**2) * (x - m)

    return denoise


def _exact_flow(x_start, sig0, m, s):
    # Probability-flow ODE for Gaussian data keeps (x - m) / sqrt(s^2 + sigma^2) constant; at sigma = 0:
    return m + (x_start - m) * s / math.sqrt(s**2 + sig0**2)


def test_heun_is_second_order_and_euler_first_order():
    f = edm()
    m, s = 0.3, 0.5
    x = torch.linspace(-3, 3, 101, dtype=torch.float64).view(-1, 1) * 80.0
    errs = {}
    for name, fn in [("heun", sample_heun), ("euler", sample_euler)]:
        errs[name] = []
        for n in (16, 32, 64):
            out = fn(_gaussian_denoiser(m, s), x.clone(), f.sigma_grid(n).double())
            errs[name].append((out - _exact_flow(x, 80.0, m, s)).abs().max().item())
    heun, euler = errs["heun"], errs["euler"]
    assert 3.0 < heun[0] / heun[1] < 5.5 and 3.0 < heun[1] / heun[2] < 5.5, heun
    assert 1.6 < euler[0] / euler[1] < 2.6 and 1.6 < euler[1] / euler[2] < 2.6, euler
    assert heun[-1] < euler[-1] / 10  # at equal steps the second-order method wins by a wide margin


def test_heun_samples_have_the_data_moments():
    f = edm()
    m, s = 0.3, 0.5
    g = torch.Generator().manual_seed(0)
    x_T = torch.randn(40_000, 1, generator=g, dtype=torch.float64)
    out = f.generate(lambda x, sigma, labels=None: _gaussian_denoiser(m, s)(x, sigma), x_T, "heun", 64)
    # Starting from sigma_max N(0, 1) instead of N(m, s^2 + sigma_max^2) is off by O(s^2/sigma_max^2) ~ 4e-5;
    # at 64 Heun steps the map's scale error is ~0.4% (test above: max error 0.0055 on outputs up to ~1.5),
    # i.e. a variance bias ~0.002; standard errors: mean 0.0025, variance 0.0018 (40k draws); 5 std errors.
    assert out.mean().item() == pytest.approx(m, abs=0.0125)
    assert out.var().item() == pytest.approx(s**2, abs=0.009)


def test_generate_rejects_vp_samplers():
    with pytest.raises(ValueError, match="heun, euler"):
        edm().generate(lambda x, s, labels=None: x, torch.zeros(1, 1), "ddim", 4)


def test_lr_schedules():
    inv = InverseSqrt(warmup_steps=10, ref_steps=100)
    assert inv(0) == pytest.approx(0.1) and inv(9) == 1.0 and inv(100) == 1.0
    assert inv(400) == pytest.approx(0.5) and inv(900) == pytest.approx(1 / 3)
    cos = WarmupCosine(warmup_steps=10, total_steps=110)
    assert cos(9) == 1.0 and cos(10) == 1.0 and cos(60) == pytest.approx(0.5) and cos(110) == pytest.approx(0.0)
    assert WarmupConstant(4)(1) == 0.5 and WarmupConstant(0)(0) == 1.0


@pytest.mark.slow
def test_edm_training_on_toy2d_improves_samples(tmp_path):
    from steadydiff.data import load_dataset
    from steadydiff.metrics import sliced_wasserstein
    from steadydiff.train import Trainer

    cfg = load_config("configs/toy2d.yaml", [
        "diffusion.kind=edm", "diffusion.sigma_data=1.0", "diffusion.p_mean=-1.0", "diffusion.p_std=1.4",
        "train.sample_sampler=heun", "train.steps=300", "train.log_every=10", "train.threads=1",
        "data.toy_size=4000", "model.hidden=64", "train.lr_schedule=inv_sqrt", "train.lr_ref_steps=200",
        "train.ema_decay=0.95", "train.sample_n=500", "train.sample_steps=16"])
    tr = Trainer(cfg, tmp_path / "run", show_progress=False)
    data = load_dataset(cfg.data).data
    sw0 = sliced_wasserstein(tr.sample(1000, "heun", 16, seed=1), data, generator=torch.Generator().manual_seed(0))
    tr.fit()
    sw1 = sliced_wasserstein(tr.sample(1000, "heun", 16, seed=1), data, generator=torch.Generator().manual_seed(0))
    assert sw1 < 0.5 * sw0, (sw0, sw1)
