"""Monitors in the trainer and the `diagnose` command."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import toy
from steadydiff.cli import main
from steadydiff.config import load_config
from steadydiff.diagnostics.monitors import block_groups, build_monitors
from steadydiff.train import Trainer

TOY = toy("data.toy_size=2000", "model.depth=6", "model.dropout=0.1", "model.skip_scaling=ls_ns",
          "train.batch_size=64", "train.ckpt_every=1000", "train.sample_n=64", "train.sample_steps=4")
ALL_ON = ["diagnostics.probe_every=2", "diagnostics.update_every=3", "diagnostics.magnitude_every=4",
          "diagnostics.probe_size=16"]


def rows(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_monitors_leave_training_unchanged(tmp_path):
    off = Trainer(load_config(None, TOY + ["train.steps=12", "diagnostics.grad_every=0"]), tmp_path / "off",
                  show_progress=False)
    off.fit()
    on = Trainer(load_config(None, TOY + ["train.steps=12"] + ALL_ON), tmp_path / "on", show_progress=False)
    on.fit()
    loss_off = [r["loss"] for r in rows(tmp_path / "off") if "loss" in r]
    loss_on = [r["loss"] for r in rows(tmp_path / "on") if "loss" in r]
    assert loss_off == loss_on
    for a, b in zip(off.model.parameters(), on.model.parameters()):
        assert torch.equal(a, b)
    keys = {k for r in rows(tmp_path / "on") for k in r}
    assert {"grad/total", "probe/loss", "probe/feat/norm/out0", "probe/skip/rms/skip2", "probe/kappa/0"} <= keys
    assert any(k.startswith("update/") for k in keys) and any(k.startswith("mag/act/") for k in keys)
    assert not any(k.startswith("probe/") for k in {k for r in rows(tmp_path / "off") for k in r})


def test_grad_total_is_the_preclip_norm_and_blocks_add_up(tmp_path):
    tr = Trainer(load_config(None, TOY + ["train.steps=3", "train.grad_clip=1e-3"]), tmp_path / "r",
                 show_progress=False)
    tr.fit()
    log = [r for r in rows(tmp_path / "r") if "loss" in r]
    diag = [r for r in rows(tmp_path / "r") if "grad/total" in r]
    assert len(diag) == 3
    for d, g in zip(diag, log):
        # grad_norm in the log line is clip_grad_norm_'s pre-clip total; clipping to 1e-3 would make it tiny.
        assert d["grad/total"] == pytest.approx(g["grad_norm"], rel=1e-5)
        assert d["grad/total"] > 1e-2
        blocks = [v for k, v in d.items() if k.startswith("grad/") and k != "grad/total"]
        assert sum(v * v for v in blocks) == pytest.approx(d["grad/total"] ** 2, rel=1e-5)


def test_update_ratio_matches_a_manual_computation(tmp_path):
    tr = Trainer(load_config(None, TOY + ["train.steps=1", "diagnostics.update_every=1"]), tmp_path / "r",
                 show_progress=False)
    tr.monitors = build_monitors(tr.cfg.diagnostics, tr.context, tr.run_dir)
    before = {k: [p.detach().clone() for p in ps] for k, ps in block_groups(tr.model).items()}
    res = tr.train_step()
    for key, params in block_groups(tr.model).items():
        delta = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(params, before[key])))
        norm = torch.sqrt(sum((b**2).sum() for b in before[key]))
        if norm == 0:  # the zero-initialised output layer: ratio undefined, not reported
            assert f"update/{key}" not in res.diagnostics
            continue
        assert res.diagnostics[f"update/{key}"] == pytest.approx(float(delta / norm), rel=1e-4)


def test_probe_batch_is_stored_and_reused_on_resume(tmp_path):
    run = tmp_path / "r"
    cfg = TOY + ALL_ON
    Trainer(load_config(None, cfg + ["train.steps=4", "train.ckpt_every=4"]), run, show_progress=False).fit()
    probe = load_file(str(run / "probe.safetensors"))
    tr = Trainer(load_config(None, cfg + ["train.steps=8", "train.ckpt_every=4"]), run, show_progress=False)
    tr.fit()
    assert all(torch.equal(probe[k], v) for k, v in load_file(str(run / "probe.safetensors")).items())
    # The logged probe loss is the VP loss on exactly those tensors (here: with the final weights).
    with torch.no_grad():
        tr.model.eval()
        expect = tr.diffusion.loss(tr.model, probe["x0"], t=probe["t"], noise=probe["noise"]).mean()
    last = [r for r in rows(run) if "probe/loss" in r][-1]
    assert last["step"] == 8 and last["probe/loss"] == pytest.approx(float(expect), rel=1e-5)


@pytest.mark.plots("plot_runs")  # the diagnose report's figures
def test_diagnose_two_runs_and_at_init(tmp_path, capsys):
    for name, method in [("org", "org"), ("cs", "cs")]:
        tr = Trainer(load_config(None, TOY + ALL_ON + ["train.steps=8", f"model.skip_scaling={method}"]),
                     tmp_path / name, show_progress=False)
        tr.fit()
    out = tmp_path / "diag"
    assert main(["diagnose", str(tmp_path / "org"), str(tmp_path / "cs"), "--out", str(out)]) == 0
    report = json.loads((out / "stability.json").read_text())
    assert set(report["runs"]) == {"org", "cs"}
    for entry in report["runs"].values():
        assert "grad/total" in entry["oscillation"] and len(entry["sensitivity_vs_t"]) == 8
        assert all(v > 0 for v in entry["sensitivity_vs_t"].values())
    assert -1.0 <= report["consistency"]["org vs cs"] <= 1.0
    for png in ["feature_norms.png", "grad_norm.png", "sensitivity.png", "magnitudes.png"]:
        assert (out / png).stat().st_size > 1000, png
    assert "| grad/total |" in (out / "stability.md").read_text()

    init = tmp_path / "init"
    assert main(["diagnose", "--at-init", "configs/toy2d.yaml", "--set", "model.depth=12", "--out", str(init)]) == 0
    theory = json.loads((init / "stability.json").read_text())["runs"]["init"]["theory"]
    assert 0.0 <= theory["r2"] <= 1.0


def test_diagnose_bad_input(tmp_path, capsys):
    assert main(["diagnose", "--out", str(tmp_path / "d")]) == 2
    assert main(["diagnose", str(tmp_path), "--out", str(tmp_path / "d")]) == 2
    assert "no config.yaml" in capsys.readouterr().err


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install -e '.[tb]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "r"
    Trainer(load_config(None, TOY + ["train.steps=5", "diagnostics.tensorboard=true"]), run,
            show_progress=False).fit()
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "grad/total" in tags and "train/loss" in tags
    logged = [r["loss"] for r in rows(run) if "loss" in r]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    code = main(["train", "--out", str(tmp_path / "r"), "--quiet", *[a for o in TOY for a in ("--set", o)],
                 "--set", "train.steps=2", "--set", "diagnostics.tensorboard=true"])
    assert code == 2 and "pip install tensorboard" in capsys.readouterr().err
