"""CLTS noise-level curriculum and MDLRC momentum decay with LR compensation."""

import json
import math

import numpy as np
import pytest
import torch

from helpers import toy
from steadydiff.config import load_config
from steadydiff.train import Trainer
from steadydiff.train.momentum import MomentumSchedule
from steadydiff.train.timesteps import CLTSTimesteps

TOY = toy("data.toy_size=2000", "train.batch_size=64", "train.ckpt_every=1000", "train.sample_n=16",
          "train.sample_steps=3")


def reference_p(k, kc, mu, sigma, bins):
    """p_k on the grid, straight from the formula in float64 numpy."""
    lam = min(1.0, k / kc)
    centres = (np.arange(bins) + 0.5) / bins
    g = np.exp(-((centres - mu) ** 2) / (2 * sigma**2))
    return (1 - lam) / bins + lam * g / g.sum()


@pytest.mark.parametrize("k", [0, 50, 100, 250])
def test_clts_probabilities(k):
    c = CLTSTimesteps(mu=0.3, sigma=0.2, curriculum_steps=100, bins=200)
    p = c.probs(k).numpy()
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(p, reference_p(k, 100, 0.3, 0.2, 200), rtol=1e-12)
    if k == 0:
        np.testing.assert_allclose(p, np.full(200, 1 / 200))  # starts uniform
    if k >= 100:  # clamped: lambda = 1 at and beyond K_c
        np.testing.assert_allclose(p, reference_p(100, 100, 0.3, 0.2, 200), rtol=1e-12)
        assert abs((p.argmax() + 0.5) / 200 - 0.3) <= 0.5 / 200 + 1e-12  # the peak sits at mu


def test_clts_samples_follow_p_k():
    c = CLTSTimesteps(mu=0.3, sigma=0.2, curriculum_steps=100, bins=1000)
    g = torch.Generator().manual_seed(0)
    n, step = 200_000, 60
    s = c.sample(n, step, g, "cpu")
    assert 0 < s.min() and s.max() < 1
    # Chi-square goodness of fit on 20 coarse cells (each sums 50 fine cells of p_k).
    observed = torch.histc(s.double(), bins=20, min=0, max=1).numpy()
    expected = c.probs(step).numpy().reshape(20, 50).sum(1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 19 degrees of freedom: the 0.999 quantile is 43.8; a sampler that ignored the curriculum (uniform)
    # would score in the thousands here.
    assert chi2 < 43.8, chi2
    uniform = np.full(20, n / 20)
    assert float(((observed - uniform) ** 2 / uniform).sum()) > 1000


def test_clts_importance_weights_keep_the_expectation():
    c = CLTSTimesteps(mu=0.3, sigma=0.2, curriculum_steps=10, bins=1000, importance=True)
    g = torch.Generator().manual_seed(1)
    s = c.sample(400_000, 10, g, "cpu")
    f = torch.cos(3 * s.double())  # any function of the level: E_p[w f] = E_uniform[f]
    estimate = (c.weights(s, 10).double() * f).mean().item()
    exact = math.sin(3) / 3
    assert estimate == pytest.approx(exact, abs=0.01)  # weights up to ~1e2 in the tails: std error ~2e-3


@pytest.mark.parametrize("tau, beta1, factor", [(0.0, 0.9, 1.0), (0.5, 0.9 * 0.5 / (0.1 + 0.45), 0.55),
                                                 (1.0, 0.0, 0.1)])
def test_mdlrc_values(tau, beta1, factor):
    m = MomentumSchedule(beta0=0.9, decay_beta=True, compensate_lr=True, steps=100)
    k = int(tau * 100)
    assert m.beta1(k) == pytest.approx(beta1, abs=1e-12)
    assert m.lr_factor(k) == pytest.approx(factor, abs=1e-12)
    assert m.lr_factor(k) * (1 - m.beta1(k)) == pytest.approx(0.1, abs=1e-12)  # lr (1 - beta1) constant
    assert m.beta1(250) == 0.0 and m.lr_factor(250) == pytest.approx(0.1)  # clamped beyond K_m
    decay_only = MomentumSchedule(beta0=0.9, decay_beta=True, compensate_lr=False, steps=100)
    lr_only = MomentumSchedule(beta0=0.9, decay_beta=False, compensate_lr=True, steps=100)
    assert decay_only.beta1(k) == m.beta1(k) and decay_only.lr_factor(k) == 1.0
    assert lr_only.beta1(k) == 0.9 and lr_only.lr_factor(k) == m.lr_factor(k)
    floored = MomentumSchedule(beta0=0.9, decay_beta=True, compensate_lr=True, steps=100, beta_end=0.4)
    assert floored.beta1(100) == 0.4


def test_the_optimiser_uses_the_scheduled_beta1(tmp_path):
    tr = Trainer(load_config(None, TOY + ["train.steps=10", "train.momentum=mdlrc", "train.momentum_steps=4",
                                          "train.betas=[0.9, 0.999]", "train.warmup_steps=0"]), tmp_path / "r",
                 show_progress=False)
    p = next(tr.model.parameters())
    for k in range(6):
        state = tr.optimizer.state.get(p, {})
        m_prev = state["exp_avg"].clone() if "exp_avg" in state else torch.zeros_like(p)
        tr.train_step()
        beta1 = tr.momentum.beta1(k)
        assert tr.optimizer.param_groups[0]["betas"][0] == beta1
        assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * tr.momentum.lr_factor(k))
        # Adam's first moment after the step is beta1 m_prev + (1 - beta1) g with the scheduled beta1
        # (grads are kept after the step: zero_grad runs at the start of the next one).
        torch.testing.assert_close(tr.optimizer.state[p]["exp_avg"], beta1 * m_prev + (1 - beta1) * p.grad)
    assert tr.momentum.beta1(5) == 0.0


@pytest.mark.parametrize("formulation", [[], ["diffusion.kind=edm", "train.sample_sampler=euler"]])
def test_resume_continues_both_schedules_exactly(assert_resume_exact, formulation):
    extra = ["train.timesteps=clts", "train.clts_steps=12", "train.momentum=mdlrc", "train.momentum_steps=12",
             "train.clts_importance=true", *formulation]
    runs = assert_resume_exact(TOY + extra, 16, split=8, split_overrides=["train.ckpt_every=8"])  # compared below

    def log(run):
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["beta1"], r["lr"], r["level_hist"]) for r in rows if "loss" in r]

    a, b = log(runs.full), log(runs.split)
    assert [r[0] for r in a] == [r[0] for r in b] == list(range(1, 17))
    for ra, rb in zip(a, b):
        assert ra[1] == pytest.approx(rb[1], abs=1e-6) and ra[2:] == rb[2:]
    assert a[-1][2] == 0.0  # beta1 reached 0 at K_m
    assert sum(a[0][4]) == 64  # the histogram counts every level of the logged step
