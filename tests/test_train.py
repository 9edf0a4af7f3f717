"""The trainer: learning, exact resume, atomic checkpoints, NaN handling."""

import json
import os

import pytest
import torch

import helpers
from helpers import toy
from steadydiff.config import load_config
from steadydiff.data import load_dataset
from steadydiff.diffusion import generate
from steadydiff.metrics import sliced_wasserstein
from steadydiff.runs import checkpoint as ckpt_mod
from steadydiff.runs import latest_checkpoint, read_checkpoint
from steadydiff.train import NonFiniteLossError, Trainer

TOY = toy("data.toy_size=4000", "model.hidden=64", "model.depth=6", "train.batch_size=128", "train.warmup_steps=20",
          "train.ckpt_every=1000", "train.sample_n=256", "train.sample_steps=10")


def toy_cfg(*extra):
    return load_config(None, TOY + list(extra))


def losses(run_dir):
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # training log lines (monitor lines carry grad/... keys)
    return [r["step"] for r in rows], [r["loss"] for r in rows]


@pytest.mark.plots  # curves.png and the samples
@pytest.mark.slow
def test_toy2d_training_lowers_loss_and_moves_samples_to_the_data(tmp_path):
    cfg = toy_cfg("train.steps=300", "model.skip_scaling=cs", "train.ema_decay=0.95")
    tr = Trainer(cfg, tmp_path / "run", show_progress=False)
    data = load_dataset(cfg.data).data
    g = torch.Generator().manual_seed(0)
    sw_init = sliced_wasserstein(tr.sample(1000, "dpmpp2m", 20, seed=1), data, generator=g)
    tr.fit()
    _, ls = losses(tmp_path / "run")
    first, last = sum(ls[:30]) / 30, sum(ls[-30:]) / 30
    assert last < 0.8 * first, (first, last)
    g = torch.Generator().manual_seed(0)
    sw_end = sliced_wasserstein(tr.sample(1000, "dpmpp2m", 20, seed=1), data, generator=g)
    assert sw_end < 0.5 * sw_init, (sw_init, sw_end)
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0
    assert (tmp_path / "run" / "samples" / "step-0000300.png").exists()


@pytest.mark.parametrize("extra", [[], ["model.dropout=0.1", "train.grad_accum=2", "model.skip_scaling=ls_ns"]])
def test_resume_reproduces_the_uninterrupted_run(assert_resume_exact, extra):
    n = 20
    runs = assert_resume_exact(TOY + extra, n, losses=1e-6, weights=1e-6)  # split at n // 2; model and EMA
    s_full, _ = losses(runs.full)
    assert s_full == list(range(1, n + 1))


def test_resume_truncates_log_lines_written_after_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    Trainer(toy_cfg("train.steps=8", "train.ckpt_every=4"), run, show_progress=False).fit()
    # Pretend the process died at step 8 before its checkpoint landed: drop the step-8 checkpoint.
    ckdir = run / "checkpoints"
    import shutil

    shutil.rmtree(ckdir / "step-0000008")
    (ckdir / "latest").write_text("step-0000004\n")
    tr = Trainer(toy_cfg("train.steps=8", "train.ckpt_every=4"), run, show_progress=False)
    assert tr.step == 4
    tr.fit()
    steps, _ = losses(run)
    assert steps == list(range(1, 9))


def _files(d):
    return {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_interrupted_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    tr = Trainer(toy_cfg("train.steps=4", "train.ckpt_every=2"), run, show_progress=False)
    tr.fit()
    before = _files(run / "checkpoints")
    for _ in range(2):
        tr.train_step()

    def dying_save(obj, f, *a, **k):  # the process "dies" after the weights, before the state file
        open(f, "wb").write(b"partial")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ckpt_mod.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        tr.save()
    monkeypatch.undo()
    assert _files(run / "checkpoints") == before
    ck = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert ck.step == 4


def test_leftover_temp_dir_from_a_killed_write_is_ignored(toy_run):
    run = toy_run  # the toy run at step 2 (helpers.TOY_RUN)
    junk = run / "checkpoints" / ".tmp-step-0000004-99999"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\x00" * 10)
    assert latest_checkpoint(run / "checkpoints").name == "step-0000002"
    tr = Trainer(helpers.toy_cfg("train.steps=4", "train.ckpt_every=2"), run, show_progress=False)
    assert tr.step == 2
    tr.fit()
    assert not junk.exists()  # cleaned up by the next successful write
    assert read_checkpoint(latest_checkpoint(run / "checkpoints")).step == 4


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    cfg = toy_cfg("train.steps=10", "train.ckpt_every=5", "debug.fault_nan_at_step=7")
    tr = Trainer(cfg, run, show_progress=False)
    with pytest.raises(NonFiniteLossError, match="at step 7"):
        tr.fit()
    assert latest_checkpoint(run / "checkpoints").name == "step-0000005"
    ck = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert all(torch.isfinite(v).all() for v in list(ck.model.values()) + list(ck.ema.values()))


def test_checkpoint_state_loads_with_weights_only(toy_run):
    path = latest_checkpoint(toy_run / "checkpoints")  # the toy run at step 2
    state = torch.load(path / "state.pt", weights_only=True)
    assert state["step"] == 2 and "optimizer" in state
    assert sorted(os.listdir(path)) == ["ema.safetensors", "model.safetensors", "state.pt"]


def test_generate_is_deterministic_and_conditional_labels_cycle(tmp_path):
    cfg = toy_cfg("train.steps=1")
    tr = Trainer(cfg, tmp_path / "run", show_progress=False)
    a = generate(tr.ema.model, tr.diffusion, (2,), 10, "ddim", 5, seed=3)
    b = generate(tr.ema.model, tr.diffusion, (2,), 10, "ddim", 5, seed=3)
    assert torch.equal(a, b) and a.shape == (10, 2)
