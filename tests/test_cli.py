"""The command line: train/sample end to end, and bad input as one-line errors with nothing overwritten."""

import gzip
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from helpers import toy_sets
from steadydiff.cli import EXIT_NONFINITE, EXIT_USER_ERROR, main

TOY = toy_sets("train.sample_n=64", "train.sample_steps=4")


def run_cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(d):
    return {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def one_line_error(err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("steadydiff: error: ")
    return lines[0]


@pytest.mark.plots  # curves.png, the samples grid and `sample --out`
def test_train_then_sample_on_fashion_mnist(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--config", "configs/demo.yaml", "--out", str(run), "--quiet",
            "--set", "data.max_items=64", "--set", "train.steps=2", "--set", "train.batch_size=4",
            "--set", "model.channels=8", "--set", "model.num_heads=2", "--set", "train.sample_n=4",
            "--set", "train.sample_steps=2", "--set", "train.threads=1"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0, out
    for name in ["config.yaml", "metrics.jsonl", "curves.png", "samples/step-0000002.png"]:
        assert (run / name).exists(), name
    png = tmp_path / "s.png"
    code, out, _ = run_cli(["sample", str(run), "--n", "9", "--sampler", "ddim", "--steps", "3",
                            "--out", str(png), "--threads", "1"], capsys)
    assert code == 0 and "EMA" in out
    img = Image.open(png)
    # 3x3 grid of 28x28 images with 2-pixel padding.
    assert img.size == (3 * 30 + 2, 3 * 30 + 2) and img.mode == "L"
    # Re-running the finished command does nothing and changes nothing.
    before = snapshot(run)
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and "already trained" in out and snapshot(run) == before


def test_resolved_config_is_written_and_reused(tmp_path, capsys):
    run = tmp_path / "run"
    code, _, _ = run_cli(["train", "--out", str(run), "--quiet", *TOY, "--set", "train.steps=2",
                          "--set", "train.lr=3e-3"], capsys)
    assert code == 0
    text = (run / "config.yaml").read_text()
    assert "lr: 0.003" in text and "backbone: mlp_unet" in text


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.skip_scaling=magic"], "choose one of org, inv_sqrt2, cs, ls, ls_ns"),
        (["model.nonsense=1"], "unknown config key model.nonsense"),
        (["train.steps=many"], "train.steps: expected an integer"),
        (["train.batch_size=0"], "train.batch_size: must be > 0"),
        (["model.kappa=1.5"], "model.kappa: must be in (0, 1]"),
        (["data.name=cifar"], "choose one of fashion_mnist, toy2d, folder"),
        (["data.name=fashion_mnist", "data.resolution=32"], "data.resolution=28"),
        (["data.name=fashion_mnist", "data.root=/nonexistent/fmnist"], "Fashion-MNIST"),
        (["data.name=folder"], "data.root"),
        (["model.backbone=unet"], "image data"),
    ],
)
def test_bad_config_is_a_one_line_error(tmp_path, capsys, overrides, needle):
    run = tmp_path / "run"
    sets = [a for o in overrides for a in ("--set", o)]
    code, _, err = run_cli(["train", "--out", str(run), "--quiet", *TOY, *sets], capsys)
    assert code == EXIT_USER_ERROR
    assert needle in one_line_error(err)
    assert not (run / "checkpoints").exists()


def test_missing_config_file(tmp_path, capsys):
    code, _, err = run_cli(["train", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "r")], capsys)
    assert code == EXIT_USER_ERROR and "not found" in one_line_error(err)


def test_corrupt_image_in_folder_names_the_file(tmp_path, capsys):
    root = tmp_path / "imgs"
    root.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(root / "good.png")
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).save(root / "bad.jpg")
    (root / "bad.jpg").write_bytes((root / "bad.jpg").read_bytes()[:100])
    code, _, err = run_cli(["train", "--out", str(tmp_path / "run"), "--quiet", "--set", "data.name=folder",
                            "--set", f"data.root={root}", "--set", "data.resolution=16"], capsys)
    assert code == EXIT_USER_ERROR and "bad.jpg" in one_line_error(err)


def test_wrong_resolution_for_the_unet(tmp_path, capsys):
    root = tmp_path / "imgs"
    root.mkdir()
    for i in range(2):
        Image.fromarray(np.zeros((18, 18), np.uint8)).save(root / f"{i}.png")
    code, _, err = run_cli(["train", "--out", str(tmp_path / "run"), "--quiet", "--set", "data.name=folder",
                            "--set", f"data.root={root}", "--set", "data.resolution=18"], capsys)
    assert code == EXIT_USER_ERROR and "divisible" in one_line_error(err)


def test_nan_loss_exits_nonzero_and_keeps_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["train", "--out", str(run), "--quiet", *TOY, "--set", "train.ckpt_every=3", "--set", "train.steps=6"]
    assert run_cli(base + ["--set", "train.steps=3"], capsys)[0] == 0
    before = snapshot(run / "checkpoints")
    code, _, err = run_cli(base + ["--set", "debug.fault_nan_at_step=4"], capsys)
    assert code == EXIT_NONFINITE
    assert "at step 4" in one_line_error(err)
    assert snapshot(run / "checkpoints") == before


def test_different_config_on_an_existing_run_is_refused(toy_run, capsys):
    run = toy_run  # `train --out run --quiet *toy_sets("train.steps=2")`, trained once per session
    before = snapshot(run)
    code, _, err = run_cli(["train", "--out", str(run), "--quiet", *toy_sets("train.steps=2"),
                            "--set", "train.lr=0.5"], capsys)
    assert code == EXIT_USER_ERROR
    assert "different config" in one_line_error(err) and "train.lr" in err
    assert snapshot(run) == before


def test_sample_without_a_run(tmp_path, capsys):
    code, _, err = run_cli(["sample", str(tmp_path), "--out", str(tmp_path / "x.png")], capsys)
    assert code == EXIT_USER_ERROR and "config.yaml" in one_line_error(err)


def test_missing_dataset_via_the_installed_entry_point(tmp_path):
    """The console script itself exits non-zero with one line on stderr."""
    bad_idx = tmp_path / "fm"
    bad_idx.mkdir()
    with gzip.open(bad_idx / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(b"not an idx file")
    proc = subprocess.run(
        [sys.executable, "-m", "steadydiff.cli", "train", "--out", str(tmp_path / "run"), "--quiet",
         "--set", f"data.root={bad_idx}"], capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == EXIT_USER_ERROR
    assert len(proc.stderr.strip().splitlines()) == 1 and "error" in proc.stderr
    assert not (tmp_path / "run").exists()
