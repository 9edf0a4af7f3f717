"""Latent diffusion: `steadydiff dataset encode` with a tiny randomly initialised AutoencoderKL saved to a local
folder (offline), training on the latent store, decoding at sample and eval time."""

import json

import numpy as np
import pytest
import torch

from helpers import LATENT_UNET, latent_stores
from steadydiff.cli import main
from steadydiff.config import load_config
from steadydiff.data import open_store
from steadydiff.data.sampler import get_batch

diffusers = pytest.importorskip("diffusers")

UNET = LATENT_UNET


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A 40-image Fashion-MNIST store (with labels), a VAE folder, and the latent store it encodes to."""
    torch.set_num_threads(1)
    return latent_stores(tmp_path_factory.mktemp("latent"))


def test_latent_store_rows_and_statistics_match_a_direct_encoding(stores):
    from steadydiff.nn.vae import load_vae

    codec = load_vae(stores / "vae")
    images = open_store(stores / "small").items_range(0, 40)
    mean, std = codec.encode(images)
    lat = open_store(stores / "lat")
    meta = lat.meta["latent"]
    assert lat.sample_shape == (4, 14, 14) and len(lat) == 40 and lat.num_classes == 10
    rows = torch.from_numpy(lat._gather(np.arange(40)))
    torch.testing.assert_close(rows, torch.cat([mean, std], 1), rtol=1e-5, atol=1e-6)
    m64, s64 = mean.double(), std.double()
    mu = m64.mean(dim=(0, 2, 3))
    var = (m64**2 + s64**2).mean(dim=(0, 2, 3)) - mu**2
    np.testing.assert_allclose(meta["channel_mean"], mu.numpy(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(meta["channel_std"], var.sqrt().numpy(), rtol=1e-6)
    assert meta["vae"]["weights_sha256"] == codec.identity["weights_sha256"]
    # the model's latents: (z - m) / s * 0.5; the posterior means have per-channel std just under 0.5
    x = lat.items(torch.arange(40))
    torch.testing.assert_close(x, (mean - mu.float().view(1, -1, 1, 1)) / var.sqrt().float().view(1, -1, 1, 1) * 0.5,
                               rtol=1e-4, atol=1e-5)
    assert torch.equal(lat.labels, open_store(stores / "small").labels)


def test_latent_batches_draw_fresh_latents_per_step_and_rank_slices_match(stores):
    lat = open_store(stores / "lat")
    idx = torch.arange(8)
    a, _ = get_batch(lat, idx, False, torch.Generator().manual_seed(1))
    b, _ = get_batch(lat, idx, False, torch.Generator().manual_seed(2))
    assert not torch.equal(a, b)  # a new draw from the posteriors
    halves = [get_batch(lat, idx, False, torch.Generator().manual_seed(1), keep=s)[0]
              for s in (slice(0, 3), slice(3, 8))]
    assert torch.equal(torch.cat(halves), a)  # a DDP rank's rows are those of the single-process batch
    with pytest.raises(Exception, match="set data.hflip=false"):
        get_batch(lat, idx, True, torch.Generator().manual_seed(1))


@pytest.mark.plots("save_samples")  # the trainer's grid and `sample --out`
def test_encode_train_sample_eval_end_to_end_and_resume_is_exact(stores, tmp_path, capsys, assert_resume_exact):
    from PIL import Image


    cfg = UNET + ["data.name=store", f"data.root={stores / 'lat'}"]
    # 4 steps (run a), and 2 then resumed to 4: the same step-4 weights, bit for bit
    a = assert_resume_exact(cfg, 4, config="configs/demo.yaml", weights=0, ema=False).full
    grid = next((a / "samples").glob("*.png"))
    png = tmp_path / "s.png"
    assert main(["sample", str(a), "--n", "4", "--steps", "2", "--out", str(png)]) == 0
    assert Image.open(png).size == Image.open(grid).size  # decoded 28x28 images, the trainer's grid layout
    w, h = Image.open(png).size
    assert w > 28 and h >= 28  # pixels, not 14x14 latents
    out = tmp_path / "eval.json"
    assert main(["eval", str(a), "--metric", "fd_fmnist", "--n", "8", "--steps", "2",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["metrics"]["fd_fmnist"] > 0
    capsys.readouterr()
    # the store's VAE moved: --vae points at a copy; another VAE is refused
    assert main(["sample", str(a), "--n", "2", "--steps", "1", "--out", str(png),
                 "--vae", str(stores / "vae")]) == 0


@pytest.mark.parametrize("backbone,kind", [("unet", "vp"), ("uvit", "vp"), ("edm2", "edm"), ("unet", "edm"),
                                          ("unet", "flow")])
def test_every_backbone_and_formulation_trains_on_4_channel_latents_and_decodes(stores, tmp_path, backbone, kind):
    from steadydiff.train import Trainer

    sets = UNET + ["data.name=store", f"data.root={stores / 'lat'}", f"model.backbone={backbone}",
                   f"diffusion.kind={kind}", "train.steps=1", "model.depth=4", "model.embed_dim=16",
                   "model.channels_per_head=8", "model.num_classes=10", "model.label_dropout=0.1",
                   f"train.sample_sampler={ {'vp': 'ddim', 'edm': 'heun', 'flow': 'heun'}[kind]}"]
    tr = Trainer(load_config("configs/demo.yaml", sets), tmp_path / "r", show_progress=False)
    tr.fit()
    assert tr.dataset.sample_shape == (4, 14, 14)
    x = tr.sample(3, tr.cfg.train.sample_sampler, 2, seed=0)
    assert x.shape == (3, 1, 28, 28) and x.abs().max() <= 1  # decoded pixels


def test_a_killed_encode_continues_and_equals_a_clean_one(stores, tmp_path, monkeypatch):
    import steadydiff.data.build as build_mod
    from steadydiff.data.encode import encode_store
    from steadydiff.data.store import read_index
    from steadydiff.nn.vae import load_vae

    codec = load_vae(stores / "vae")
    real_save, calls = build_mod._save_npy, []

    def dying(path, arr):
        calls.append(path.name)
        if len(calls) == 3:  # shard 0 (rows, labels) written, then killed writing shard 1
            raise KeyboardInterrupt
        return real_save(path, arr)

    monkeypatch.setattr(build_mod, "_save_npy", dying)
    with pytest.raises(KeyboardInterrupt):
        encode_store(stores / "small", tmp_path / "lat", codec.encode, codec.identity, batch=7, shard_size=16,
                     progress=False)
    assert not (tmp_path / "lat").exists() and (tmp_path / "lat.partial").is_dir()
    monkeypatch.setattr(build_mod, "_save_npy", real_save)
    from steadydiff.data import DataError

    with pytest.raises(DataError, match="unfinished build of other arguments"):  # another batch: other numerics
        encode_store(stores / "small", tmp_path / "lat", codec.encode, codec.identity, batch=5, shard_size=16,
                     progress=False)
    meta = encode_store(stores / "small", tmp_path / "lat", codec.encode, codec.identity, batch=7, shard_size=16,
                        progress=False)
    clean = read_index(stores / "lat")
    assert meta["shards"] == clean["shards"] and meta["latent"]["channel_std"] == clean["latent"]["channel_std"]
