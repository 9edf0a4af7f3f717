"""The validation-loss monitor: trajectory unchanged, logged values equal a direct computation, stratified and
held-out set stored with the run, the base (u-free) EDM loss, config checks."""

import dataclasses
import gzip
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import toy
from steadydiff.config import ConfigError, DiffusionConfig, load_config
from steadydiff.data import ArrayDataset, load_dataset
from steadydiff.data import fashion_mnist as fm
from steadydiff.diagnostics.base import RunContext
from steadydiff.diagnostics.validation import ValidationSet
from steadydiff.diffusion import VPSDE, EDMFormulation, build_formulation
from steadydiff.nn import UNet, build_model
from steadydiff.runs import latest_checkpoint, read_checkpoint
from steadydiff.train import Trainer

TOY = toy("data.toy_size=2000", "model.depth=6", "train.batch_size=64", "train.ckpt_every=1000", "train.sample_n=16")
SIZE, BINS = 96, 4
# 96 examples in chunks of 40: the last chunk is a partial one.
VAL = [f"diagnostics.val_size={SIZE}", f"diagnostics.val_bins={BINS}", "diagnostics.val_batch=40",
       "diagnostics.val_seed=7"]
STEPS = 20
VARIANTS = {
    "vp": [],
    "vp-dropout": ["model.dropout=0.1", "model.skip_scaling=ls_ns"],
    "edm": ["diffusion.kind=edm", "diffusion.sigma_data=1.0", "train.sample_sampler=heun"],
    "flow": ["diffusion.kind=flow", "diffusion.t_sampling=logit_normal", "train.sample_sampler=euler"],
}

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """One tiny config trained twice: with the validation monitor every 5 steps ("on") and without ("off")."""
    base = tmp_path_factory.mktemp(request.param)
    extra = VARIANTS[request.param] + [f"train.steps={STEPS}"]
    out = {}
    for name, every in (("on", 5), ("off", 0)):
        cfg = load_config(None, TOY + VAL + extra + [f"diagnostics.val_every={every}"])
        Trainer(cfg, base / name, show_progress=False).fit()
        out[name] = base / name
    out["cfg"] = load_config(None, TOY + VAL + extra)
    return out


def test_training_is_bit_identical_with_and_without_validation(pair):
    on, off = rows(pair["on"]), rows(pair["off"])
    log_on = [(r["step"], r["loss"], r["grad_norm"]) for r in on if "loss" in r]
    log_off = [(r["step"], r["loss"], r["grad_norm"]) for r in off if "loss" in r]
    assert len(log_on) == STEPS and log_on == log_off
    a, b = (read_checkpoint(latest_checkpoint(pair[n] / "checkpoints")) for n in ("on", "off"))
    assert a.step == b.step == STEPS
    for sd_a, sd_b in ((a.model, b.model), (a.ema, b.ema)):
        assert sd_a.keys() == sd_b.keys()
        assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    val_rows = [r for r in on if "val/loss" in r]
    assert [r["step"] for r in val_rows] == [5, 10, 15, 20]
    expect = {"val/loss", "val/ema_loss"} | {f"val/{m}/bin{k}" for m in ("loss", "ema_loss") for k in range(BINS)}
    assert all(expect <= r.keys() for r in val_rows)
    assert not any(k.startswith("val/") for r in off for k in r)
    assert (pair["on"] / "val.safetensors").exists() and not (pair["off"] / "val.safetensors").exists()


def _model_from(cfg, state_dict):
    formulation = build_formulation(cfg.diffusion)
    model = formulation.wrap(build_model(cfg.model, (2,)))
    model.load_state_dict(state_dict)
    return formulation, model.eval()


def test_logged_validation_loss_equals_a_direct_computation(pair):
    cfg, run = pair["cfg"], pair["on"]
    val = load_file(str(run / "val.safetensors"))
    ckpt = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    last = [r for r in rows(run) if "val/loss" in r][-1]
    assert last["step"] == ckpt.step == STEPS
    x0, s, noise, bins = val["x0"], val["s"], val["noise"], val["bin"]
    for key, sd in (("val/loss", ckpt.model), ("val/ema_loss", ckpt.ema)):
        formulation, model = _model_from(cfg, sd)
        with torch.no_grad():
            if cfg.diffusion.kind == "vp":  # the explicit eps-MSE, written out
                alpha, sigma = formulation.alpha_sigma(s)
                xt = alpha[:, None] * x0 + sigma[:, None] * noise
                per = (model(xt, 999 * s, None) - noise).pow(2).mean(dim=1)
                torch.testing.assert_close(per, formulation.base_loss(model, x0, None, s, noise))
            elif cfg.diffusion.kind == "flow":  # the explicit velocity MSE at t(s), the logit-normal quantile
                t = torch.sigmoid(math.sqrt(2) * torch.erfinv(2 * s.double() - 1)).float()
                xt = (1 - t[:, None]) * x0 + t[:, None] * noise
                per = (model(xt, t, None) - (noise - x0)).pow(2).mean(dim=1)
                torch.testing.assert_close(per, formulation.base_loss(model, x0, None, s, noise))
            else:
                per = formulation.base_loss(model, x0, None, s, noise)
        per = per.double()
        assert last[key] == pytest.approx(float(per.mean()), rel=1e-6)
        for k in range(BINS):
            assert last[f"{key}/bin{k}"] == pytest.approx(float(per[bins == k].mean()), rel=1e-6)
        # Equal-sized bins: the overall mean is the mean of the bin means.
        assert last[key] == pytest.approx(sum(last[f"{key}/bin{k}"] for k in range(BINS)) / BINS, rel=1e-12)


def test_the_set_is_stratified_held_out_and_reused_on_resume(tmp_path):
    run = tmp_path / "r"
    cfg = TOY + VAL + ["diagnostics.val_every=5", "train.ckpt_every=10"]
    Trainer(load_config(None, cfg + ["train.steps=10"]), run, show_progress=False).fit()
    first = load_file(str(run / "val.safetensors"))
    s, bins = first["s"], first["bin"]
    assert s.dtype == torch.float32 and s.shape == (SIZE,) and first["x0"].shape == (SIZE, 2)
    assert torch.equal(bins, torch.arange(SIZE) % BINS) and "labels" not in first
    assert torch.bincount(bins, minlength=BINS).tolist() == [SIZE // BINS] * BINS
    t_eps = load_config(None, cfg).diffusion.t_eps
    for k in range(BINS):
        sk = s[bins == k].double()
        assert sk.min() >= max(k / BINS, t_eps) - 1e-7 and sk.max() < (k + 1) / BINS
        assert sk.max() - sk.min() > 0.5 / BINS  # spread over the bin, not a point
    # x0: the first val_size of a permutation (seed val_seed) of the toy2d *test* split, none from train.
    c = load_config(None, cfg)
    test = load_dataset(dataclasses.replace(c.data, split="test")).data
    train = load_dataset(c.data).data
    idx = torch.randperm(len(test), generator=torch.Generator().manual_seed(7))[:SIZE]
    assert torch.equal(first["x0"], test[idx])
    assert not (first["x0"][:, None] == train[None]).all(-1).any()

    # Resume: the stored set is reused (same tensors), and evaluated again after the resume.
    Trainer(load_config(None, cfg + ["train.steps=20"]), run, show_progress=False).fit()
    again = load_file(str(run / "val.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert [r["step"] for r in rows(run) if "val/loss" in r] == [5, 10, 15, 20]
    # A resume that asks for another set is refused (the diagnostics section may change on resume).
    tr = Trainer(load_config(None, cfg + ["train.steps=30", "diagnostics.val_size=64"]), run, show_progress=False)
    with pytest.raises(ConfigError, match="diagnostics.val_size=96") as e:
        tr.fit()
    assert "\n" not in str(e.value) and "delete" in str(e.value)


def _idx(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    return bytes([0, 0, 0x08, arr.ndim]) + np.array(arr.shape, dtype=">u4").tobytes() + arr.tobytes()


def _fake_fashion(directory, n):
    """idx files for both splits: train images are all 0, test images all 255 (labels i % 10)."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, (img, lbl) in fm.SPLIT_FILES.items():
        value = 0 if split == "train" else 255
        (directory / (img + ".gz")).write_bytes(gzip.compress(_idx(np.full((n, 28, 28), value))))
        (directory / lbl).write_bytes(_idx(np.arange(n) % 10))


@pytest.mark.parametrize("split, expect", [("train", 1.0), ("test", -1.0)])
def test_fashion_mnist_validates_on_the_other_split_with_labels(tmp_path, monkeypatch, split, expect):
    _fake_fashion(tmp_path / "fm", n=40)
    monkeypatch.setenv("STEADYDIFF_DATA", str(tmp_path / "fm"))
    cfg = load_config(None, ["data.name=fashion_mnist", f"data.split={split}", "data.max_items=8",
                             "model.num_classes=10"])
    ctx = RunContext(cfg, load_dataset(cfg.data), VPSDE())
    # max_items limits the training data, not the held-out split: 30 of its 40 images are available.
    val = ValidationSet.create(ctx, 30, 3, seed=1)
    assert val.held_out and val.x0.shape == (30, 1, 28, 28) and torch.all(val.x0 == expect)
    idx = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:30]
    assert torch.equal(val.labels, idx % 10)
    with pytest.raises(ConfigError, match="diagnostics.val_size"):
        ValidationSet.create(ctx, 41, 3, seed=1)


def test_folder_data_validates_on_a_seeded_subset_of_the_training_images():
    cfg = load_config(None, ["data.name=folder", "data.root=unused", "data.resolution=4"])
    ds = ArrayDataset(torch.randn(50, 3, 4, 4), None, 0, "folder")
    val = ValidationSet.create(RunContext(cfg, ds, EDMFormulation()), 20, 5, seed=3)
    idx = torch.randperm(50, generator=torch.Generator().manual_seed(3))[:20]
    assert not val.held_out and torch.equal(val.x0, ds.items(idx)) and val.labels is None
    # EDM levels are clipped into (t_eps, 1 - t_eps); bins still hold their levels.
    assert val.s.min() >= 1e-5 and val.s.max() <= 1 - 1e-5
    assert all(((val.s[val.bin == k] >= k / 5 - 1e-7) & (val.s[val.bin == k] < (k + 1) / 5)).all() for k in range(5))


def test_edm_base_loss_ignores_the_learned_uncertainty():
    torch.manual_seed(0)
    f = EDMFormulation.from_config(DiffusionConfig(kind="edm"))
    model = f.wrap(UNet(in_channels=1, resolution=8, channels=8, channel_mult=[1], num_res_blocks=1,
                        attn_resolutions=[]))
    with torch.no_grad():
        for p in model.net.parameters():  # a non-trivial F (the output conv starts at zero)
            p.add_(0.1 * torch.randn_like(p))
    x0, noise = torch.randn(3, 1, 8, 8), torch.randn(3, 1, 8, 8)
    t = torch.tensor([0.1, 0.5, 0.9])
    sigma = f.sigma(t)
    u = model.log_variance(sigma)
    assert (u.abs() > 1e-3).all()  # the u head is non-zero
    d = model(x0 + sigma.view(-1, 1, 1, 1) * noise, sigma)
    lam = (sigma**2 + 0.5**2) / (sigma * 0.5) ** 2
    err = (d - x0).pow(2).flatten(1).mean(1)
    base = f.base_loss(model, x0, None, t, noise)
    torch.testing.assert_close(base, lam * err)
    torch.testing.assert_close(f.loss(model, x0, t=t, noise=noise), lam / u.exp() * err + u)
    assert not torch.allclose(base, f.loss(model, x0, t=t, noise=noise))


def test_vp_base_loss_is_its_loss():
    torch.manual_seed(0)
    sde = VPSDE()
    net = UNet(in_channels=1, resolution=8, channels=8, channel_mult=[1], num_res_blocks=1, attn_resolutions=[])
    x0, noise, t = torch.randn(3, 1, 8, 8), torch.randn(3, 1, 8, 8), torch.tensor([0.1, 0.5, 0.9])
    assert torch.equal(sde.base_loss(net, x0, None, t, noise), sde.loss(net, x0, t=t, noise=noise))


@pytest.mark.parametrize("override, key", [
    ("diagnostics.val_every=-1", "diagnostics.val_every"),
    ("diagnostics.val_bins=0", "diagnostics.val_bins"),
    ("diagnostics.val_size=4", "diagnostics.val_size"),  # fewer examples than the 8 default bins
    ("diagnostics.val_batch=0", "diagnostics.val_batch"),
])
def test_bad_validation_config_is_a_one_line_error(override, key):
    with pytest.raises(ConfigError, match=key) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_a_set_larger_than_the_held_out_split_is_a_clear_error(tmp_path):
    cfg = load_config(None, TOY + ["data.toy_size=50", "diagnostics.val_every=1", "diagnostics.val_size=64",
                                   "train.steps=1"])
    tr = Trainer(cfg, tmp_path / "r", show_progress=False)
    with pytest.raises(ConfigError, match=r"diagnostics.val_size <= 50"):
        tr.fit()
