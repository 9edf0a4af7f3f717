"""Guidance (diffusion/guidance.py): classifier-free guidance, autoguidance, the guidance interval, the null
label of every backbone, label dropout in training, and the CLI's --guidance / --guide / --class."""

import functools
import json

import numpy as np
import pytest
import torch
from torch import nn

from steadydiff.config import load_config
from steadydiff.diffusion import VPSDE, EDMFormulation, FlowFormulation, Guided
from steadydiff.nn import NULL_LABEL


class Mixture1D(nn.Module):
    """Closed-form denoisers of a 1-D two-class Gaussian mixture: class c ~ N(MU[c], S^2), equal priors.

    EDM denoiser: D(x; sigma, c) = MU[c] + S^2 / (S^2 + sigma^2) (x - MU[c]); unconditional: the posterior
    mixture of the two. `vp`: the same model as a noise prediction at the network time 999 t of `sde`
    (x_t = alpha x0 + sigma eps, so eps_hat = (x_t - alpha D(x_t / alpha; sigma / alpha)) / sigma)."""

    MU = (-1.0, 1.0)
    S = 0.5

    def __init__(self, sde: VPSDE | None = None):
        super().__init__()
        self.sde = sde

    def denoise(self, x, sigma, labels):
        mu = torch.tensor(self.MU, dtype=x.dtype)
        var = self.S**2 + sigma.reshape(-1, 1) ** 2
        cond = mu[None] + self.S**2 / var * (x - mu[None])  # (B, 2): each class's denoiser
        logp = -0.5 * (x - mu[None]) ** 2 / var  # equal priors, equal variances
        post = torch.softmax(logp, dim=1)
        uncond = (post * cond).sum(1, keepdim=True)
        pick = cond.gather(1, labels.clamp(min=0).reshape(-1, 1))
        return torch.where((labels >= 0).reshape(-1, 1), pick, uncond)

    def forward(self, x, noise, labels):
        if self.sde is None:
            return self.denoise(x, noise.to(x.dtype).expand(x.shape[0]), labels)
        alpha, sigma = self.sde.alpha_sigma(torch.as_tensor(noise) / self.sde.time_scale)
        alpha, sigma = alpha.to(x.dtype).reshape(-1, 1), sigma.to(x.dtype).reshape(-1, 1)
        d = self.denoise(x / alpha, (sigma / alpha).reshape(-1), labels)
        return (x - alpha * d) / sigma


def _denoisers_np(x: np.ndarray, s: float, label: int) -> tuple[np.ndarray, np.ndarray]:
    """(unconditional, class `label`) denoisers of Mixture1D in float64 numpy: an implementation independent of
    the module's, for the reference."""
    mu, var = np.array(Mixture1D.MU), Mixture1D.S**2 + s * s
    cond = mu[None] + Mixture1D.S**2 / var * (x[:, None] - mu[None])
    logp = -0.5 * (x[:, None] - mu[None]) ** 2 / var
    post = np.exp(logp - logp.max(1, keepdims=True))
    post /= post.sum(1, keepdims=True)
    return (post * cond).sum(1), cond[:, label]


@functools.cache
def reference_class_mean(w: float, label: int, sigma_start: float, n_steps: int = 1000) -> float:
    """The guided probability-flow ODE dx/dsigma = (x - D_w(x; sigma)) / sigma from x = sigma_start * x_T
    (x_T = `_x_T()`), integrated with RK4 on a geometric sigma grid down to 1e-4 in float64: the reference the
    samplers are compared with (1,000 vs 4,000 steps change the mean by < 1e-9)."""
    x = _x_T().numpy()[:, 0] * sigma_start

    def f(x, s):
        du, dc = _denoisers_np(x, s, label)
        return (x - (du + w * (dc - du))) / s

    grid = np.geomspace(sigma_start, 1e-4, n_steps)
    for a, b in zip(grid[:-1], grid[1:]):
        h = b - a
        k1 = f(x, a)
        k2 = f(x + h / 2 * k1, a + h / 2)
        k3 = f(x + h / 2 * k2, a + h / 2)
        k4 = f(x + h * k3, b)
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return float(x.mean())


def _x_T(n=2000):
    return torch.randn((n, 1), generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("kind,sampler", [("edm", "heun"), ("edm", "euler"), ("vp", "ddim"), ("vp", "dpmpp2m"),
                                          ("vp", "em")])
def test_guided_sampling_on_a_1d_mixture_matches_the_integrated_ode_and_separates_the_classes(kind, sampler,
                                                                                              one_thread):
    """Guidance pushes class 1's samples away from class 0 as W grows; the ODE samplers land where a fine RK4
    integration of the same guided ODE lands (VP guides eps, EDM guides D: the same ODE in x / alpha). The
    SDE sampler (em) follows a different process once guided (the guided score is not a marginal's score), so
    only its W = 1 mean and the separation are checked."""
    x_T = _x_T()
    form = EDMFormulation() if kind == "edm" else VPSDE()
    model = Mixture1D(None if kind == "edm" else form)
    means = []
    for w in (1.0, 2.0, 4.0):
        x = form.generate(Guided(model, w), x_T, sampler, 128 if kind == "edm" else 200,
                          torch.ones(len(x_T), dtype=torch.long), generator=torch.Generator().manual_seed(0))
        means.append(x.mean().item())
        if sampler == "em":
            continue
        # where the sampler starts, in EDM terms: sigma_max, or VP's sigma(1) / alpha(1) (x_T / alpha(1))
        start = form.sigma_max if kind == "edm" else float(1 / form.alpha_sigma(torch.tensor(1.0))[0])
        ref = reference_class_mean(w, 1, start)
        assert means[-1] == pytest.approx(ref, abs=0.01), (w, means[-1], ref)
    assert means[0] == pytest.approx(Mixture1D.MU[1], abs=0.03)  # W = 1: the conditional distribution itself
    assert means[0] < means[1] - 0.05 < means[2] - 0.1  # the class mean moves away from the other class


def _tiny(backbone: str, num_classes: int = 3) -> nn.Module:
    from steadydiff.nn import build_model

    cfg = load_config(None, [f"model.backbone={backbone}", f"model.num_classes={num_classes}", "model.channels=8",
                             "model.num_heads=1", "model.hidden=16", "model.depth=4", "model.embed_dim=16",
                             "model.channel_mult=[1,2]", "model.num_res_blocks=1", "model.attn_resolutions=[]",
                             "model.patch_size=4", "model.channels_per_head=8"])
    torch.manual_seed(0)
    shape = (2,) if backbone == "mlp_unet" else (1, 8, 8)
    net = build_model(cfg.model, shape).eval()
    with torch.no_grad():  # zero-initialised output layers would hide the label: perturb every weight
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return net, shape


class Probe(nn.Module):
    """A stand-in model whose output depends on x, the noise input and the label (exactly reproducible)."""

    def forward(self, x, noise, labels):
        lab = torch.zeros(x.shape[0]) if labels is None else labels.float()
        return torch.sin(x * 3 + noise.reshape(-1, *([1] * (x.dim() - 1))) * 0.1 + lab.view(-1, *([1] * (x.dim() - 1))))


def test_guided_output_is_its_formula_and_w1_w0_and_self_guidance_are_exact():
    x = torch.randn(5, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    sig = torch.full((5,), 0.7)
    lab = torch.tensor([0, 1, 2, 1, 0])
    main, other = Probe(), Probe()
    cond, uncond = main(x, sig, lab), main(x, sig, torch.full_like(lab, NULL_LABEL))
    torch.testing.assert_close(Guided(main, 2.5)(x, sig, lab), uncond + 2.5 * (cond - uncond), rtol=0, atol=1e-6)
    assert torch.equal(Guided(main, 1.0)(x, sig, lab), cond)
    assert torch.equal(Guided(main, 0.0)(x, sig, lab), uncond)
    assert torch.equal(Guided(main, 3.0, guide=other)(x, sig, lab), cond)  # autoguidance by an identical model
    # interval: guided inside [lo, hi], the main model outside
    sig2 = torch.tensor([0.1, 0.5, 1.0, 2.0, 5.0])
    g = Guided(main, 2.0, interval=(0.4, 2.0), sigma_of=lambda s: s)(x, sig2, lab)
    full = Guided(main, 2.0)(x, sig2, lab)
    inside = torch.tensor([False, True, True, True, False])
    assert torch.equal(g[inside], full[inside]) and torch.equal(g[~inside], main(x, sig2, lab)[~inside])


@pytest.mark.parametrize("kind,sampler", [("vp", "em"), ("vp", "ddim"), ("vp", "dpmpp2m"), ("edm", "heun"),
                                          ("edm", "euler"), ("flow", "euler"), ("flow", "heun"), ("flow", "em")])
def test_every_sampler_w1_is_conditional_w0_unconditional_and_self_autoguidance_unguided(kind, sampler, one_thread):
    from steadydiff.diffusion import generate

    net, shape = _tiny("unet")
    form = {"vp": VPSDE, "edm": EDMFormulation, "flow": FlowFormulation}[kind]()
    model = form.wrap(net)

    class Null(nn.Module):  # the model with every label replaced by the null label
        def forward(self, x, noise, labels):
            return model(x, noise, torch.full_like(labels, NULL_LABEL))

    def draw(m):
        return generate(m, form, shape, 6, sampler, 4, seed=3, num_classes=3)

    plain = draw(model)
    assert torch.equal(draw(Guided(model, 1.0)), plain)
    assert torch.equal(draw(Guided(model, 0.0)), draw(Null()))
    assert torch.equal(draw(Guided(model, 2.0, guide=model)), plain)
    assert not torch.equal(draw(Guided(model, 2.0)), plain)


@pytest.mark.parametrize("backbone", ["unet", "uvit", "edm2", "mlp_unet"])
def test_every_backbone_has_a_null_label_that_adds_no_label_term(backbone, one_thread):
    net, shape = _tiny(backbone)
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.3, 1.0, 2.0])
    null = torch.full((3,), NULL_LABEL)
    with torch.no_grad():
        out_null = net(x, t, null)
        outs = [net(x, t, torch.full((3,), c)) for c in range(3)]
        assert torch.isfinite(out_null).all() and all(not torch.equal(out_null, o) for o in outs)
        # the reference: class 0 with its label term removed by hand
        if backbone == "edm2":
            ref = net(x, t, torch.zeros(3, 3))  # EDM2's label dropout: the zero one-hot vector
        else:
            table = net.label_emb if backbone == "uvit" else net.embed.label
            table.weight[0].zero_()
            ref = net(x, t, torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(out_null, ref, rtol=0, atol=0)


COND = ["model.channels=8", "model.num_heads=1", "model.channel_mult=[1,2]", "model.num_res_blocks=1",
        "model.attn_resolutions=[]", "model.num_classes=10", "data.max_items=64", "train.batch_size=32",
        "train.sample_n=4", "train.sample_steps=2", "train.threads=1", "train.ckpt_every=2",
        "diagnostics.grad_every=0"]


def test_label_dropout_nulls_labels_at_rate_p_from_the_step_generator_and_resume_is_exact(tmp_path, one_thread,
                                                                                           assert_resume_exact):

    from steadydiff.train import Trainer

    def labels(p):
        tr = Trainer(load_config("configs/demo.yaml", COND + [f"model.label_dropout={p}", "train.steps=4"]),
                     tmp_path / f"probe-{p}", show_progress=False)
        return torch.cat([tr.batches(k).labels for k in range(60)])

    plain, dropped = labels(0.0), labels(0.3)
    null = dropped == NULL_LABEL
    assert not (plain == NULL_LABEL).any()
    assert abs(null.double().mean().item() - 0.3) < 0.05  # 1,920 draws: sd 0.010
    assert torch.equal(dropped[~null], plain[~null])  # dropout only replaces labels, it draws no others
    # 4 steps, and 2 then resumed to 4: the same step-4 weights, bit for bit
    assert_resume_exact(COND + ["model.label_dropout=0.3"], 4, config="configs/demo.yaml", weights=0, ema=False)


@pytest.mark.plots("save_samples", "plot_guidance_sweep")  # s.png and sweep.png
def test_cli_guided_sample_class_grid_and_eval_sweep(tmp_path, capsys, one_thread):
    from steadydiff.cli import main

    run, weak = tmp_path / "run", tmp_path / "weak"
    for out, steps in ((run, 3), (weak, 1)):
        sets = [a for o in COND + ["model.label_dropout=0.2", f"train.steps={steps}"] for a in ("--set", o)]
        assert main(["train", "--config", "configs/demo.yaml", "--out", str(out), "--quiet", *sets]) == 0
    png = tmp_path / "s.png"
    assert main(["sample", str(run), "--n", "4", "--steps", "2", "--guidance", "2", "--class", "3", "--out", str(png),
                 "--guidance-interval", "0.1,5"]) == 0
    assert png.stat().st_size > 0 and "guidance 2" in capsys.readouterr().out
    assert main(["sample", str(run), "--n", "4", "--steps", "2", "--guidance", "2", "--guide", str(weak),
                 "--out", str(png)]) == 0
    # EDM2's classifier-free guidance: an unconditional model (num_classes 0) as the guide
    uncond = tmp_path / "uncond"
    sets = [a for o in COND + ["model.num_classes=0", "train.steps=1"] for a in ("--set", o)]
    assert main(["train", "--config", "configs/demo.yaml", "--out", str(uncond), "--quiet", *sets]) == 0
    assert main(["sample", str(run), "--n", "4", "--steps", "2", "--guidance", "1.5", "--guide", str(uncond),
                 "--out", str(png)]) == 0
    out = tmp_path / "sweep.json"
    assert main(["eval", str(run), "--metric", "class_acc,fd_fmnist", "--guidance", "1,2", "--n", "20",
                 "--steps", "2", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert [r["guidance"] for r in rec["sweep"]] == [1.0, 2.0]
    assert all(0 <= r["metrics"]["class_acc"] <= 1 for r in rec["sweep"])
    assert rec["sweep"][0]["metrics"] != rec["sweep"][1]["metrics"]
    assert out.with_suffix(".png").stat().st_size > 0
    # W = 1 in a sweep is the plain conditional eval, number for number
    assert main(["eval", str(run), "--metric", "class_acc,fd_fmnist", "--n", "20", "--steps", "2",
                 "--out", str(tmp_path / "plain.json")]) == 0
    assert json.loads((tmp_path / "plain.json").read_text())["metrics"] == rec["sweep"][0]["metrics"]
