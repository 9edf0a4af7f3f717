"""The trainer's contract (issue 26): the checkpoint schema in `TrainState`, the averagers' one interface,
instruments driven by a `RunContext`, the shared subset / labels helpers, the moved config keys, and a run
trained before the refactor (tests/fixtures/run-v0.1-ec52b45, written by commit ec52b45) resuming exactly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from steadydiff import config as config_mod
from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config
from steadydiff.data import ArrayDataset, fixed_subset, model_labels
from steadydiff.diagnostics.base import RunContext
from steadydiff.diagnostics.monitors import ProbeBatch, build_monitors
from steadydiff.diffusion import EDMFormulation, build_formulation
from steadydiff.runs import latest_checkpoint, read_checkpoint
from steadydiff.train import EMA, PowerEMA, Trainer
from steadydiff.train.state import StepResult

FIXTURE = Path(__file__).parent / "fixtures" / "run-v0.1-ec52b45"
# The settings the fixture was trained with (its config.yaml has them, with the fault keys still under train).
OLD = ["data.name=toy2d", "data.toy_size=200", "model.backbone=mlp_unet", "model.hidden=16", "model.depth=4",
       "train.batch_size=16", "train.log_every=3", "train.ckpt_every=2", "train.keep_ckpts=2", "train.warmup_steps=2",
       "train.ema_sigma_rels=[0.1]", "train.sample_n=16", "train.sample_steps=4", "data.workers=0"]


def sets(*extra):
    return [a for s in OLD + list(extra) for a in ("--set", s)]


def records(run: Path) -> dict[int, dict]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.mark.plots  # it checks the sample PNG
def test_a_run_trained_before_the_refactor_resumes_onto_the_same_trajectory_and_samples(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.setattr(config_mod, "_warned_moves", set())
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    # Resume from the step-2 checkpoint: its log window (steps 1-2) and post-hoc EMA state are in the old format.
    (old / "checkpoints" / "latest").write_text("step-0000002\n")
    assert main(["train", "--out", str(old), "--quiet", *sets("train.steps=8")]) == 0
    err = capsys.readouterr().err
    assert "config key train.fault_steps is deprecated; use debug.fault_steps" in err
    fresh = tmp_path / "fresh"
    assert main(["train", "--out", str(fresh), "--quiet", *sets("train.steps=8")]) == 0
    a, b = records(old), records(fresh)
    assert sorted(a) == sorted(b) == [3, 6, 8]  # step 3 averages steps 1-2 (from the old checkpoint) and 3
    for step in a:  # the fixture was written on another machine: equal up to float round-off, not bit for bit
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-4)
        assert a[step]["grad_norm"] == pytest.approx(b[step]["grad_norm"], rel=1e-4)
    ca, cb = (read_checkpoint(latest_checkpoint(r / "checkpoints")) for r in (old, fresh))
    assert ca.step == cb.step == 8
    for k in cb.model:
        torch.testing.assert_close(ca.model[k], cb.model[k], rtol=1e-4, atol=1e-5)
    for k in cb.state["power_ema"]["emas"][0]:
        torch.testing.assert_close(ca.state["power_ema"]["emas"][0][k], cb.state["power_ema"]["emas"][0][k],
                                   rtol=1e-4, atol=1e-5)
    assert "debug:" in (old / "config.yaml").read_text()  # rewritten in today's layout
    assert main(["sample", str(old), "--n", "8", "--steps", "4", "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").stat().st_size > 0


def test_train_state_round_trips_through_its_dict_and_owns_the_schema(tmp_path):
    cfg = load_config(None, OLD + ["train.steps=3", "train.log_every=2"])
    tr = Trainer(cfg, tmp_path / "r", show_progress=False)
    for _ in range(3):
        tr.log_window.append(tr.train_step())
    state = tr.state.to_dict(cfg, tr.dataset.sample_shape, 1)
    assert set(state) == {"step", "optimizer", "config", "data_position", "sample_shape", "world_size", "nonfinite",
                          "log_window", "power_ema"}
    assert state["step"] == 3 and state["data_position"] == 3 * 16 and len(state["log_window"]) == 3
    # A fresh state restored from the dict holds the same optimiser moments, averages and window.
    other = Trainer(cfg, tmp_path / "r2", show_progress=False)
    other.state.load_dict(state)
    assert other.step == 3 and [r.loss for r in other.log_window] == [r.loss for r in tr.log_window]
    for k, v in tr.optimizer.state_dict()["state"][0].items():
        torch.testing.assert_close(other.optimizer.state_dict()["state"][0][k], v, rtol=0, atol=0)
    torch.testing.assert_close(other.power_ema.averaged(0.1), tr.power_ema.averaged(0.1), rtol=0, atol=0)
    # Older checkpoints lack keys: they keep their fresh values (a converted checkpoint has no optimiser).
    bare = Trainer(cfg, tmp_path / "r3", show_progress=False)
    bare.state.load_dict({"step": 5})
    assert bare.step == 5 and bare.log_window == [] and not bare.optimizer.state_dict()["state"]
    r = StepResult(0.5, 1.5, {"grad/total": 1.5}, torch.tensor([0.1, 0.2]), skipped=False)
    back = StepResult.from_dict(r.to_dict())
    assert (back.loss, back.grad_norm, back.skipped) == (0.5, 1.5, False) and torch.equal(back.levels, r.levels)


def test_both_averagers_share_one_interface():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    averagers = [EMA(net, 0.9), PowerEMA(net, [0.1])]
    for step in (1, 2, 3):
        with torch.no_grad():
            net.weight.add_(1.0)
        for a in averagers:
            a.update(net, step)
    for a in averagers:
        clone = type(a)(torch.nn.Linear(4, 3), *([0.9] if isinstance(a, EMA) else [[0.1]]))
        clone.load_state_dict(a.state_dict())
        got, want = clone.state_dict(), a.state_dict()
        if isinstance(a, PowerEMA):
            got, want = got["emas"][0], want["emas"][0]
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_monitors_and_fixed_sets_need_only_a_run_context(tmp_path):
    """No Trainer: a loaded-run style context drives the probe batch, the validation set and every monitor."""
    cfg = load_config(None, OLD + ["diagnostics.probe_every=1", "diagnostics.update_every=1",
                                   "diagnostics.magnitude_every=1", "diagnostics.val_every=1",
                                   "diagnostics.val_size=16", "diagnostics.val_bins=4"])
    from steadydiff.data import load_dataset
    from steadydiff.nn import build_model

    ds = load_dataset(cfg.data)
    form = build_formulation(cfg.diffusion)
    model = form.wrap(build_model(cfg.model, ds.sample_shape))
    ctx = RunContext(cfg, ds, form, model, EMA(model, 0.9).model)
    monitors = build_monitors(cfg.diagnostics, ctx, tmp_path)
    x0, _ = fixed_subset(ds, 8, torch.Generator().manual_seed(0))
    form.loss(model, x0).mean().backward()
    out = {}
    for m in monitors:
        out.update(m.after_backward(ctx, 1))
        m.before_step(ctx, 1)
        out.update(m.after_step(ctx, 1))
    assert {"grad/total", "probe/loss", "val/loss", "val/ema_loss"} <= set(out)
    assert any(k.startswith("mag/act/") for k in out) and any(k.startswith("update/") for k in out)
    assert (tmp_path / "probe.safetensors").exists() and (tmp_path / "val.safetensors").exists()


def test_fixed_subset_is_the_first_n_of_a_seeded_permutation_and_labels_follow_the_model():
    ds = ArrayDataset(torch.arange(40, dtype=torch.uint8).view(40, 1, 1, 1).expand(40, 1, 2, 2).contiguous(),
                      torch.arange(40) % 10, 10, "t")
    g = torch.Generator().manual_seed(7)
    x, y = fixed_subset(ds, 5, g)
    idx = torch.randperm(40, generator=torch.Generator().manual_seed(7))[:5]
    assert torch.equal(x, ds.items(idx)) and torch.equal(y, idx % 10)
    # The generator advanced by exactly one randperm: the next draw is what a caller would draw after it.
    ref = torch.Generator().manual_seed(7)
    torch.randperm(40, generator=ref)
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref))
    assert model_labels(y, 10) is y and model_labels(y, 0) is None and model_labels(None, 10) is None
    unlabelled = ArrayDataset(torch.zeros(6, 1, 2, 2, dtype=torch.uint8), None, 0, "u")
    assert fixed_subset(unlabelled, 3, torch.Generator())[1] is None


def test_probe_batch_labels_only_for_a_class_conditional_model():
    ds = ArrayDataset(torch.zeros(20, 1, 4, 4, dtype=torch.uint8), torch.arange(20) % 2, 2, "t")
    for classes, has in ((2, True), (0, False)):
        cfg = load_config(None, ["data.name=folder", "data.root=x", "data.resolution=4",
                                 f"model.num_classes={classes}"])
        probe = ProbeBatch.create(RunContext(cfg, ds, EDMFormulation()), 6, seed=1)
        assert (probe.labels is not None) == has and probe.x0.shape == (6, 1, 4, 4)


def test_fault_knobs_live_in_debug_and_the_old_train_keys_still_work_once_warned(capsys, monkeypatch):
    monkeypatch.setattr(config_mod, "_warned_moves", set())
    new = load_config(None, ["debug.fault_steps=[3]", "debug.fault_where=grad"])
    old = load_config(None, ["train.fault_steps=[3]", "train.fault_where=grad"])
    assert new == old and old.debug.fault_steps == [3] and old.debug.fault_where == "grad"
    assert not hasattr(old.train, "fault_steps")
    load_config(None, ["train.fault_steps=[3]"])  # said once per key and process, not at every load
    err = capsys.readouterr().err.splitlines()
    assert err == ["steadydiff: warning: config key train.fault_steps is deprecated; use debug.fault_steps",
                   "steadydiff: warning: config key train.fault_where is deprecated; use debug.fault_where"]
    with pytest.raises(ConfigError, match="train.fault_steps and debug.fault_steps are both set"):
        load_config(None, ["train.fault_steps=[3]", "debug.fault_steps=[4]"])
    with pytest.raises(ConfigError, match="debug.fault_steps / debug.fault_nan_at_step: steps must be >= 0"):
        load_config(None, ["debug.fault_steps=[-1]"])


def test_sigma_rel_bound_is_one_over_sqrt_12_exactly():
    from steadydiff.train.phema import sigma_rel_to_gamma

    edge = 1 / 12**0.5  # 0.288675...: 0.28868 lies between it and the 0.2887 once hard-coded
    load_config(None, [f"train.ema_sigma_rels=[{edge - 1e-6}]"])
    assert sigma_rel_to_gamma(edge - 1e-6) > 0
    with pytest.raises(ConfigError, match=r"\(0, 0.2887\)"):
        load_config(None, ["train.ema_sigma_rels=[0.28868]"])


def test_edm_from_config_keeps_t_eps():
    cfg = load_config(None, ["diffusion.kind=edm", "diffusion.t_eps=0.01", "train.sample_sampler=heun"])
    form = build_formulation(cfg.diffusion)
    assert form.t_eps == 0.01
    s = form.sample_t(10_000, generator=torch.Generator().manual_seed(0))
    assert s.min() >= 0.01 and s.max() <= 0.99
    with pytest.raises(ConfigError, match="diffusion.t_eps"):
        load_config(None, ["diffusion.kind=edm", "diffusion.t_eps=0.6", "train.sample_sampler=heun"])


def test_power_ema_snapshots_are_fsynced_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import steadydiff.train.phema as phema_mod
    import steadydiff.utils.io as io_mod

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(io_mod.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    net = torch.nn.Linear(3, 2)
    pe = PowerEMA(net, [0.05, 0.1])
    pe.update(net, 1)
    paths = pe.snapshot(tmp_path, 1)
    assert [p.name for p in paths] == ["phema-000000001-0.050.safetensors", "phema-000000001-0.100.safetensors"]
    assert len(synced) >= 2 * len(paths)  # each file and its directory

    def broken(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(phema_mod, "save_file", broken)
    with pytest.raises(OSError):
        pe.snapshot(tmp_path / "new", 2)
    assert list((tmp_path / "new").iterdir()) == []  # no partial file under any name


def test_a_damaged_post_hoc_ema_snapshot_is_one_line_naming_it(tmp_path, capsys):
    run = tmp_path / "old"
    shutil.copytree(FIXTURE, run)
    snap = run / "phema" / "phema-000000004-0.100.safetensors"
    snap.write_bytes(snap.read_bytes()[:100])  # truncated, as by a full disk
    assert main(["phema", str(run), "--sigma-rel", "0.05", "--out", str(tmp_path / "ph")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "deprecated" not in ln]
    assert len(err) == 1 and err[0].startswith("steadydiff: error: ")
    assert "phema-000000004-0.100.safetensors is unreadable" in err[0] and "delete it" in err[0]
    assert not (tmp_path / "ph").exists()
