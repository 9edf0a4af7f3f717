"""Power-function EMA inside the trainer, snapshots, resume, and the `phema` command end to end."""

import pytest
import torch
from safetensors.torch import load_file

from helpers import toy
from steadydiff.cli import main
from steadydiff.config import load_config
from steadydiff.train import Trainer

TOY = toy("data.toy_size=2000", "train.batch_size=64", "train.lr=3e-3", "train.warmup_steps=5", "train.log_every=5",
          "train.sample_n=64", "train.sample_steps=4", "train.ema_sigma_rels=[0.05,0.10,0.13,0.15]",
          "train.phema_snapshot_every=4", "diffusion.kind=edm", "train.sample_sampler=euler")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_power_ema_resumes_exactly(assert_resume_exact):
    runs = assert_resume_exact(TOY + ["train.ckpt_every=12"], 24, split=12)  # compared below
    full, resumed = runs.full_trainer, runs.resumed
    for sr in (0.05, 0.15):
        a, b = full.power_ema.averaged(sr), resumed.power_ema.averaged(sr)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_phema_reconstructs_a_held_out_ema_and_samples(tmp_path, capsys):
    run = tmp_path / "run"
    tr = Trainer(load_config(None, TOY + ["train.steps=120", "train.ckpt_every=60"]), run, show_progress=False)
    tr.fit()
    direct = {sr: tr.power_ema.averaged(sr) for sr in (0.13, 0.15)}
    for f in (run / "phema").glob("*-0.1[35]0.safetensors"):  # hold out 0.13 and 0.15
        f.unlink()
    out = tmp_path / "ph"
    assert main(["phema", str(run), "--sigma-rel", "0.15", "--out", str(out)]) == 0
    rec_dir = out / "step-0000120-sigma-0.150"
    rec = load_file(str(rec_dir / "model.safetensors"))

    def rel(a, b):
        num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
        return (num / sum(float(b[k].pow(2).sum()) for k in b)) ** 0.5

    gap = rel(direct[0.13], direct[0.15])
    err = rel({k: rec[k] for k in direct[0.15]}, direct[0.15])
    # 30 snapshots of two EMAs reconstruct sigma_rel 0.15 to ~1e-3 relative response error (notes §2.5);
    # the parameter error must be far below the gap between neighbouring EMA profiles.
    assert err < 0.1 * gap, (err, gap)
    assert main(["sample", str(rec_dir), "--n", "16", "--steps", "4", "--out", str(tmp_path / "s.png")]) == 0


def test_phema_bad_input(tmp_path, capsys, toy_run):
    run = tmp_path / "snapshots"  # (tmp_path / "run" is the toy run's copy)
    Trainer(load_config(None, TOY + ["train.steps=8", "train.ckpt_every=8"]), run, show_progress=False).fit()
    assert main(["phema", str(run), "--sigma-rel", "0.5", "--out", str(tmp_path / "o")]) == 2
    assert "0.2887" in capsys.readouterr().err
    assert main(["phema", str(run), "--sigma-rel", "0.1", "--step", "5", "--out", str(tmp_path / "o")]) == 2
    assert "no snapshot at that step" in capsys.readouterr().err
    plain = toy_run  # a toy run trained without train.ema_sigma_rels
    assert main(["phema", str(plain), "--sigma-rel", "0.1", "--out", str(tmp_path / "o2")]) == 2
    assert "ema_sigma_rels" in capsys.readouterr().err
