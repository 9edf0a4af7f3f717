"""`steadydiff export`: the diffusers DDPMPipeline folder checked against diffusers itself (loading, noise
prediction, DDIM sampling), what it refuses, `--raw`, the model card and `--push-to-hub` (upload replaced).

The runs are written directly (config + one checkpoint of randomised weights, raw and EMA different), not trained:
a freshly initialised UNet predicts exactly zero noise (its output conv is zero-initialised), so only random
weights make the comparisons mean something."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config
from steadydiff.diffusion import VPSDE, clip_denoised, sample_ddim
from steadydiff.diffusion.samplers import ddim_on_grid
from steadydiff.nn import build_model
from steadydiff.nn.diffusers_export import unet2d_refusal
from steadydiff.nn.layers import NULL_LABEL
from steadydiff.runs import checkpoint_dir, load_model, save_checkpoint, write_config

diffusers = pytest.importorskip("diffusers")

# A tiny exportable UNet: 8x8, widths 16 and 32, attention at 4x4 (as wide as the middle block's), 4 groups.
TINY = ["data.resolution=8", "model.backbone=unet", "model.channels=16", "model.channel_mult=[1,2]",
        "model.num_res_blocks=1", "model.attn_resolutions=[4]", "model.num_heads=2", "model.norm_groups=4"]
SHAPE = (1, 8, 8)
STEP = 7


def _randomised(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def make_run(root: Path, *sets: str, shape: tuple[int, ...] = SHAPE) -> Path:
    """A run directory: config.yaml and checkpoint step-7 whose raw (seed 1) and EMA (seed 2) weights differ."""
    cfg = load_config(None, list(TINY) + list(sets))
    torch.manual_seed(0)
    from steadydiff.diffusion import build_formulation

    model = build_formulation(cfg.diffusion).wrap(build_model(cfg.model, shape))
    sd = model.state_dict()
    root.mkdir(parents=True)
    write_config(root, cfg)
    save_checkpoint(checkpoint_dir(root), STEP, _randomised(sd, 1), _randomised(sd, 2),
                    {"sample_shape": list(shape)})
    return root


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny run and its diffusers export (EMA weights), shared by the read-only tests below."""
    root = tmp_path_factory.mktemp("export")
    run = make_run(root / "run")
    assert main(["export", str(run), "--format", "diffusers", "--out", str(root / "hf"), "--samples", "0"]) == 0
    return run, root / "hf"


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_pipeline_loads_without_missing_keys_and_predicts_the_same_noise(exported):
    run, out = exported
    pipe = diffusers.DDPMPipeline.from_pretrained(out)
    assert type(pipe.unet).__name__ == "UNet2DModel" and type(pipe.scheduler).__name__ == "DDPMScheduler"
    _, info = diffusers.UNet2DModel.from_pretrained(out, subfolder="unet", output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    ours = load_model(run).model  # the EMA weights, as exported
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, *SHAPE, generator=g)
    with torch.no_grad():
        for n in (0, 1, 250, 500, 999):  # DDPM timestep n is steadydiff's t = n / 999, model time n
            want = ours(x, VPSDE().model_time(torch.full((4,), n / 999)), None)
            got = pipe.unet(x, n).sample
            assert want.abs().max() > 0.1  # random weights: a real prediction, not the zero of a fresh UNet
            assert (got - want).abs().max() <= 1e-5, n  # float32 (measured 1.7e-6: conv vs linear, op order)
    images = pipe(batch_size=2, num_inference_steps=10, output_type="np").images  # DDPM sampling runs end to end
    assert images.shape == (2, 8, 8, 1) and (images >= 0).all() and (images <= 1).all()


def test_scheduler_carries_the_vp_schedule(exported):
    _, out = exported
    sched = diffusers.DDPMScheduler.from_pretrained(out, subfolder="scheduler")
    assert sched.config.prediction_type == "epsilon" and sched.config.num_train_timesteps == 1000
    sde = VPSDE()
    n = torch.arange(1000, dtype=torch.float64)
    alpha, _ = sde.alpha_sigma(n / 999)
    # diffusers rebuilds alphas_cumprod as a float32 cumprod of 1 - betas: 1000 roundings, measured 6.3e-7
    rel = (sched.alphas_cumprod.double() / alpha**2 - 1).abs().max()
    assert rel <= 2e-6
    # and the betas themselves: our float64 ones to float32 rounding (betas[0] = 0: alpha(0) = 1)
    betas, ac = sde.discrete_schedule()
    assert torch.equal(sched.betas, betas.float()) and betas[0] == 0 and torch.allclose(ac, alpha**2, rtol=1e-14)


def _diffusers_ddim(out: Path, x_T: torch.Tensor, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """50 DDIM steps of the exported folder, with diffusers' own scheduler and UNet; also its timesteps."""
    unet = diffusers.UNet2DModel.from_pretrained(out, subfolder="unet")
    sched = diffusers.DDIMScheduler.from_pretrained(out, subfolder="scheduler", **overrides)
    sched.set_timesteps(50)
    x = x_T.clone()
    with torch.no_grad():
        for t in sched.timesteps:
            x = sched.step(unet(x, t).sample, t, x, use_clipped_model_output=True).prev_sample
    return x, sched.timesteps


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
def test_ddim_50_steps_matches_steadydiff_on_the_same_timesteps(exported, clip):
    """Both driven over diffusers' 50 timesteps (trailing: 999, 979, ..., 19, then alpha = 1): the same sampler."""
    run, out = exported
    x_T = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(4))
    got, timesteps = _diffusers_ddim(out, x_T, **({} if clip else {"clip_sample": False}))
    assert timesteps[0] == 999 and timesteps[-1] == 19 and len(timesteps) == 50
    m = load_model(run)
    sde = m.formulation

    def eps_fn(x, t):
        return sde.eps(m.model, x, t)

    want = ddim_on_grid(clip_denoised(eps_fn, sde) if clip else eps_fn, sde, x_T, (timesteps.double() / 999).tolist())
    # What differs is float32 rounding: diffusers' alphas_cumprod (relative 6e-7, above) and the network's time
    # input (int n there, fl32(n / 999) * 999 here). Measured: 4.2e-6 clipped (samples in [-1, 1]); unclipped the
    # random network's x0_hat reaches ~400 and the difference is 3.1e-4, 7.5e-7 of that. Bounds ~10x above.
    scale = want.abs().max()
    assert (got - want).abs().max() <= (5e-5 if clip else 1e-5 * scale)


def test_ddim_50_steps_matches_steadydiffs_own_ddim_within_its_discretisation_error(exported):
    """steadydiff's `ddim` at 50 steps (uniform t from 1 to t_eps = 1e-5, then x0_hat there) vs diffusers' DDIM at
    50 steps: the same integrator on grids that differ by up to one timestep (0.02 k of 20 at step k, the last
    step 5% off) and at the end (x0_hat at t = 19/999 there, a step to t_eps and x0_hat there here). They are not
    the same sampler, so no rounding-level bound holds; the bound is the integrator's own error: their
    difference must stay below steadydiff's 50-vs-100-step difference (for a first-order method about half its
    50-step error). Measured for this random network: 0.11 against 0.70 (mean abs 0.0045 against 0.030)."""
    run, out = exported
    x_T = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(4))
    got, _ = _diffusers_ddim(out, x_T)
    m = load_model(run)
    sde = m.formulation
    eps_fn = clip_denoised(lambda x, t: sde.eps(m.model, x, t), sde)
    own50, own100 = sample_ddim(eps_fn, sde, x_T, 50), sample_ddim(eps_fn, sde, x_T, 100)
    assert (got - own50).abs().max() <= (own50 - own100).abs().max()


def test_class_conditional_export_keeps_the_class_and_null_embeddings(tmp_path):
    run = make_run(tmp_path / "run", "model.num_classes=3", "model.label_dropout=0.1")
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out), "--samples", "0"]) == 0
    pipe = diffusers.DDPMPipeline.from_pretrained(out)  # loads; sampling needs labels (see the card)
    assert pipe.unet.config.num_class_embeds == 4  # 3 classes + the null label (label dropout)
    assert torch.equal(pipe.unet.class_embedding.weight[3], torch.zeros(64))
    ours = load_model(run).model
    x = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(5))
    labels = torch.tensor([0, 1, 2, NULL_LABEL])
    with torch.no_grad():
        want = ours(x, torch.full((4,), 500.0), labels)
        got = pipe.unet(x, 500, class_labels=torch.tensor([0, 1, 2, 3])).sample  # class 3: the null label
    assert (want[:3] - want[3:]).abs().max() > 1e-3  # the labels matter
    assert (got - want).abs().max() <= 1e-5


def test_raw_exports_the_raw_weights_and_the_default_the_ema(tmp_path):
    from safetensors.torch import load_file

    from steadydiff.runs import read_checkpoint

    run = make_run(tmp_path / "run")
    ckpt = read_checkpoint(checkpoint_dir(run) / f"step-{STEP:07d}")
    for flag, want in (([], ckpt.ema), (["--raw"], ckpt.model)):
        out = tmp_path / f"hf{len(flag)}"
        assert main(["export", str(run), "--out", str(out), "--samples", "0", *flag]) == 0
        w = load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))
        assert torch.equal(w["conv_in.weight"], want["conv_in.weight"])
        assert torch.equal(w["mid_block.attentions.0.to_k.weight"], want["mid.1.qkv.weight"][32:64, :, 0, 0])
    assert not torch.equal(ckpt.ema["conv_in.weight"], ckpt.model["conv_in.weight"])


def test_steadydiff_format_exports_any_run_and_loads_back(tmp_path, capsys):
    run = make_run(tmp_path / "run", "model.skip_scaling=cs")  # refused for diffusers, fine here
    out = tmp_path / "sd"
    assert main(["export", str(run), "--format", "steadydiff", "--out", str(out), "--samples", "0"]) == 0
    assert "as steadydiff to" in capsys.readouterr().out
    a, b = load_model(run), load_model(out)
    assert b.step == STEP and b.weights == "EMA"
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert "steadydiff sample" in (out / "README.md").read_text()


# --- refusals: one line, exit 2, nothing written ------------------------------------------------------------

REFUSED = [
    (["diffusion.kind=edm", "train.sample_sampler=heun"], "diffusion.kind=edm"),
    (["model.backbone=uvit", "model.embed_dim=16", "model.depth=2", "model.norm_groups=null"], "U-ViT is a"),
    (["model.backbone=edm2", "model.channels_per_head=8", "model.norm_groups=null"], "magnitude-preserving"),
    (["model.skip_scaling=ls"], "LS gates"),
    (["model.skip_scaling=ls_ns"], "LS gates"),
    (["model.skip_scaling=cs"], "cannot be folded"),
    (["model.skip_scaling=inv_sqrt2"], "cannot be folded"),
    (["model.skip_scaling=zero"], "cannot be folded"),
    # gcd(32, C // 4) per layer: 16 and 48 channels -> 4 groups, 32 -> 8, 64 -> 16
    (["model.norm_groups=null"], "per-layer group counts (4, 8, 16;"),
    (["model.attn_resolutions=[8,4]"], "head widths differ"),  # 16 and 32 channels, 2 heads each
    (["model.channel_mult=[2,2]"], "channel_mult starting at 1"),
]


@pytest.mark.parametrize("sets,why", REFUSED, ids=[s[0].split(".")[-1] for s, _ in REFUSED])
def test_refusals_are_one_line_with_nothing_written(tmp_path, capsys, sets, why):
    run = make_run(tmp_path / "run", *sets)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("steadydiff: error: cannot export")
    assert why in err and "--format steadydiff" in err
    assert not out.exists() and _leftovers(tmp_path) == []


def test_mlp_unet_run_is_refused(toy_run_shared, tmp_path, capsys):
    assert main(["export", str(toy_run_shared), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MLP U-Net" in err and "--format steadydiff" in err
    assert list(tmp_path.iterdir()) == []


def test_latent_runs_are_refused(tmp_path, capsys, monkeypatch):
    import steadydiff.diffusion.latent as latent

    run = make_run(tmp_path / "run")
    monkeypatch.setattr(latent, "latent_record", lambda data_cfg: {"vae": {}})  # as a latent store's record reads
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 2
    assert "VAE latents" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_a_non_empty_out_and_raw_on_a_model_folder_are_refused(exported, tmp_path, capsys):
    run, out = exported
    assert main(["export", str(run), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    sd = tmp_path / "sd"
    assert main(["export", str(run), "--format", "steadydiff", "--out", str(sd), "--samples", "0"]) == 0
    assert main(["export", str(sd), "--raw", "--out", str(tmp_path / "x")]) == 2
    assert "one set of weights (EMA)" in capsys.readouterr().err and not (tmp_path / "x").exists()


# --- model.norm_groups -------------------------------------------------------------------------------------

def test_norm_groups_sets_every_groupnorm_and_null_keeps_the_per_layer_rule():
    per_layer = build_model(load_config(None, TINY + ["model.norm_groups=null"]).model, SHAPE)
    one = build_model(load_config(None, TINY + ["model.norm_groups=8"]).model, SHAPE)
    assert sorted(set(per_layer.norm_group_counts())) == [4, 8, 16]  # gcd(32, C // 4) per layer, as before
    assert set(one.norm_group_counts()) == {8}
    assert per_layer.state_dict().keys() == one.state_dict().keys()  # same parameters: only the grouping differs
    with pytest.raises(ConfigError, match=r"model.norm_groups=3 .* choose one of 1, 2, 4, 8, 16 or null"):
        build_model(load_config(None, TINY + ["model.norm_groups=3"]).model, SHAPE)
    with pytest.raises(ConfigError, match="model.norm_groups"):
        load_config(None, TINY + ["model.norm_groups=0"])
    with pytest.raises(ConfigError, match="no GroupNorm"):
        build_model(load_config(None, ["model.backbone=mlp_unet", "model.norm_groups=4"]).model, (2,))


def test_per_layer_counts_that_happen_to_agree_export():
    """channels 128, one level: every norm (128 or 256 channels) gets gcd(32, C // 4) = 32 groups."""
    cfg = load_config(None, TINY + ["model.norm_groups=null", "model.channels=128", "model.channel_mult=[1]",
                                    "model.attn_resolutions=[]"])
    assert unet2d_refusal(build_model(cfg.model, SHAPE)) is None


# --- the model card and the Hub ------------------------------------------------------------------------------

@pytest.mark.plots("save_samples")
def test_model_card(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "eval.json").write_text(json.dumps({"step": STEP, "n": 500, "sampler": "ddim", "steps": 50, "seed": 0,
                                               "weights": "ema", "guidance": 1.0,
                                               "metrics": {"fd_fmnist": 12.3456, "kid": 0.0123}}))
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out), "--samples", "4", "--license", "apache-2.0"]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\n")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "diffusers" and meta["license"] == "apache-2.0"
    assert {"steadydiff", "diffusers", "skip-scaling-org"} <= set(meta["tags"])
    assert meta["datasets"] == ["zalando-datasets/fashion_mnist"]
    assert meta["pipeline_tag"] == "unconditional-image-generation"
    for text in ("| GroupNorm groups | 4 |", "| skip scaling (ScaleLong) | org |", "step 7, EMA",
                 "beta_min 0.1, beta_max 20.0", "| fd_fmnist | 12.346 |", "| kid | 0.0123 |", "![samples](samples.png)",
                 f'DDPMPipeline.from_pretrained("{out}")', "DiffusersUNetAdapter", "alpha(n / 999)^2"):
        assert text in card, text
    assert (out / "samples.png").stat().st_size > 0


def test_card_without_eval_says_so(exported):
    card = (exported[1] / "README.md").read_text()
    assert "No evaluation recorded" in card and "![samples]" not in card  # --samples 0: no grid


class _FakeHub:
    """huggingface_hub.HfApi with the network calls recorded instead of made."""

    calls: list[tuple[str, dict]] = []

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kw}))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", {**kw, "files": sorted(p.name for p in Path(kw["folder_path"]).iterdir())}))


def test_push_to_hub_uploads_the_exported_folder(tmp_path, monkeypatch, capsys):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    monkeypatch.setattr(_FakeHub, "calls", [])
    run = make_run(tmp_path / "run")
    out = tmp_path / "hf"
    rc = main(["export", str(run), "--out", str(out), "--samples", "0", "--push-to-hub", "me/tiny", "--private"])
    assert rc == 0
    (c_name, create), (u_name, upload) = _FakeHub.calls
    assert (c_name, create["repo_id"], create["private"], create["exist_ok"]) == ("create_repo", "me/tiny", True, True)
    assert u_name == "upload_folder" and upload["repo_id"] == "me/tiny" and upload["repo_type"] == "model"
    assert Path(upload["folder_path"]) == out
    assert upload["files"] == ["README.md", "model_index.json", "scheduler", "steadydiff_config.yaml", "unet"]
    assert 'from_pretrained("me/tiny")' in (out / "README.md").read_text()  # the card names the repo
    assert "https://huggingface.co/me/tiny" in capsys.readouterr().out


def test_push_to_hub_without_huggingface_hub_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` raises ImportError
    run = make_run(tmp_path / "run")
    assert main(["export", str(run), "--out", str(tmp_path / "hf"), "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "steadydiff[hub]"' in err
    assert not (tmp_path / "hf").exists()
    assert main(["export", str(run), "--out", str(tmp_path / "hf"), "--private"]) == 2  # --private alone
    assert "--private applies to --push-to-hub" in capsys.readouterr().err
