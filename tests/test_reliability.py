"""Reliability: crash-resume under SIGKILL, injected NaN/Inf, failing disks, and crafted pickles.

Names: `test_soak_*` (kills), `test_nonfinite_*` (numerical faults), `test_storage_*` (write failures),
`test_safe_load_*` (untrusted files). benchmarks/reliability_report.py counts the cases by these prefixes.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import toy, toy_cfg, toy_sets
from steadydiff.cli import EXIT_NONFINITE, EXIT_USER_ERROR, main
from steadydiff.runs import checkpoint as ckpt_mod
from steadydiff.runs import latest_checkpoint, metrics_log, read_checkpoint
from steadydiff.train import NonFiniteLossError, Trainer

ROOT = Path(__file__).resolve().parent.parent

cli_sets = toy_sets  # the toy run's overrides as --set pairs


def records(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def fingerprint(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


def all_saved_tensors(run: Path):
    """Every tensor steadydiff wrote: checkpoint weights, EMA, optimiser state, post-hoc EMA snapshots."""
    for d in (run / "checkpoints").glob("step-*"):
        ck = read_checkpoint(d)
        yield from ck.model.values()
        yield from (ck.ema or {}).values()
        for st in ck.state["optimizer"]["state"].values():
            yield from (v for v in st.values() if torch.is_tensor(v))
    for f in (run / "phema").glob("*.safetensors") if (run / "phema").is_dir() else []:
        yield from load_file(str(f)).values()


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("steadydiff: warning")]
    assert len(lines) == 1 and lines[0].startswith("steadydiff: error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------------------------
# Crash-resume soak (benchmarks/soak.py has the harness; the benchmark kills >= 20 times)


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_soak_sigkill_three_times_resumes_exactly(tmp_path):
    # Order chosen so each kill has work left to interrupt: a fresh start, a step <= 10, then the next
    # checkpoint write (at most step 15). Seed 9 draws a kill at 1.26 s, one at step 6, and one 0.047 s into
    # a checkpoint write (which lasts >= 3 x 0.05 s with the delay hook), so the last lands inside it.
    soak = _soak_module()
    res = soak.soak(tmp_path, kills=3, steps=15, ckpt_every=5, seed=9, delay=0.05, kinds=["startup", "step", "ckpt"])
    assert res["kills"] == 3 and res["kills_inside_checkpoint_write"] >= 1, res["events"]
    assert res["checkpoint_dirs_checked"] >= 1 and res["unloadable_checkpoint_dirs_after_kills"] == 0
    assert res["dangling_latest_after_kills"] == 0 and res["completed_checkpoints_lost"] == 0
    c = res["compare"]
    assert c["final_step"] == 15
    assert c["weights_bit_equal"] and c["weights_max_abs_diff"] == 0.0
    assert c["optimizer_state_equal"] and c["phema_snapshots_equal"] and c["phema_snapshots"] == 6
    assert c["metrics_equal"] and c["duplicate_records"] == 0 and c["loss_steps_once"]
    assert res["resume_exact"]


@pytest.mark.slow
def test_soak_sigterm_inside_a_checkpoint_write_loses_no_step_and_the_rerun_resumes_exactly(tmp_path):
    # One SIGTERM, in the first checkpoint write (benchmarks/soak.py --signals sends 12 at drawn moments, and 6 more
    # under torchrun; tests/test_preemption.py signals at a step). The write completes, the run ends at that step
    # boundary with exit 75, the re-run resumes there, and the run ends as one never stopped.
    soak = _soak_module()
    res = soak.signal_soak(tmp_path, signals=1, steps=12, ckpt_every=5, seed=9, delay=0.05, moments=["ckpt"])
    (ev,) = res["events"]
    assert ev["inside_checkpoint_write"] and ev["exit_code"] == 75 and ev["stopped_at_boundary"], ev
    assert ev["resume_step"] == 5 and res["steps_lost_per_signal"] == [0] and res["unloadable_checkpoints"] == 0
    assert res["resume_exact"] and res["compare"]["final_step"] == 12


def test_soak_torn_metrics_line_is_dropped_on_resume(tmp_path):
    """A kill mid-write leaves half a JSON line without its newline; resuming must not glue onto it."""
    run = tmp_path / "run"
    Trainer(toy_cfg("train.steps=4", "train.ckpt_every=2"), run, show_progress=False).fit()
    (run / "checkpoints" / "step-0000004").rename(run / "checkpoints" / ".gone")  # died before step 4 landed
    (run / "checkpoints" / "latest").write_text("step-0000002\n")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.12')  # torn
    tr = Trainer(toy_cfg("train.steps=6", "train.ckpt_every=2"), run, show_progress=False)
    tr.fit()
    rows = records(run)  # every line parses
    loss_steps = [r["step"] for r in rows if "loss" in r]
    assert loss_steps == list(range(1, 7))


def test_soak_log_record_straddling_a_checkpoint_matches_the_uninterrupted_run(tmp_path):
    """log_every=3, ckpt_every=2: after a crash and a resume from step 2, the record at step 3 still averages
    steps 1-3 (the partial window travels in the checkpoint), as in the run that never stopped."""
    cfg = toy_cfg("train.steps=6", "train.log_every=3", "train.ckpt_every=2", "train.keep_ckpts=5")
    Trainer(cfg, tmp_path / "full", show_progress=False).fit()
    crashed = tmp_path / "crashed"
    Trainer(cfg, crashed, show_progress=False).fit()
    for name in ("step-0000004", "step-0000006"):  # as if it died at step 3, after the step-2 checkpoint
        (crashed / "checkpoints" / name).rename(crashed / "checkpoints" / f".gone-{name}")
    (crashed / "checkpoints" / "latest").write_text("step-0000002\n")
    Trainer(cfg, crashed, show_progress=False).fit()

    def rows(run):
        return [{k: v for k, v in r.items() if k not in ("images_per_sec", "mfu", "peak_flops")} for r in records(run)]

    assert rows(crashed) == rows(tmp_path / "full")
    assert [r["step"] for r in rows(crashed) if "loss" in r] == [3, 6]


def test_soak_half_deleted_checkpoint_is_never_visible(tmp_path, monkeypatch):
    """Pruning renames a checkpoint to hidden trash before deleting it: a kill inside rmtree leaves no
    half-deleted step-* directory that a later fallback could pick."""
    run = tmp_path / "run"
    tr = Trainer(toy_cfg("train.steps=2", "train.ckpt_every=1", "train.keep_ckpts=1"), run, show_progress=False)
    real_rmtree = ckpt_mod.shutil.rmtree

    def dying_rmtree(path, *a, **k):  # whichever name the pruned step-2 directory is deleted under
        p = Path(path)
        if "step-0000002" in p.name:
            next(p.iterdir()).unlink()  # half deleted ...
            raise KeyboardInterrupt("killed inside rmtree")  # ... then the process dies
        return real_rmtree(path, *a, **k)

    tr.fit()  # step-1 then step-2 (prunes step-1)
    tr.cfg.train.steps = 3
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        tr.train_step()
        tr.save()  # writes step-3, prunes step-2 -> dies
    monkeypatch.undo()
    ckdir = run / "checkpoints"
    for d in ckdir.glob("step-*"):
        read_checkpoint(d)  # every visible checkpoint is complete
    assert latest_checkpoint(ckdir).name == "step-0000003"
    (ckdir / "latest").unlink()  # even the fallback (no pointer) finds a complete one
    assert read_checkpoint(latest_checkpoint(ckdir)).step == 3


# ---------------------------------------------------------------------------------------------------------
# Numerical faults


def _snapshot_state(tr: Trainer):
    opt = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
           for i, s in enumerate(tr.optimizer.state.values())}
    return ({k: v.clone() for k, v in tr.model.state_dict().items()},
            {k: v.clone() for k, v in tr.ema.model.state_dict().items()}, opt,
            [{k: v.clone() for k, v in e.items()} for e in tr.power_ema.emas])


@pytest.mark.parametrize("kind, where", [("nan", "loss"), ("inf", "loss"), ("nan", "grad"), ("inf", "grad")])
def test_nonfinite_skip_leaves_weights_ema_and_optimizer_untouched(tmp_path, capsys, kind, where):
    cfg = toy_cfg("train.steps=8", "train.ckpt_every=4", "train.nonfinite=skip", "debug.fault_steps=[5]",
                  f"debug.fault_kind={kind}", f"debug.fault_where={where}", "train.ema_sigma_rels=[0.1]",
                  "train.phema_snapshot_every=1")
    tr = Trainer(cfg, tmp_path / "run", show_progress=False)
    tr.fit()  # up to step 8, with the fault at (0-based) step 5
    # Replay the same config step by step and look at step 5 closely.
    tr = Trainer(cfg, tmp_path / "replay", show_progress=False)
    for _ in range(5):
        assert not tr.train_step().skipped
    before = _snapshot_state(tr)
    res = tr.train_step()
    assert res.skipped and tr.step == 6 and tr.skipped_steps == 1
    after = _snapshot_state(tr)
    for a, b in zip(before[:2], after[:2]):  # weights and EMA: bit-identical
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(before[2][i][k], after[2][i][k]) for i in before[2] for k in before[2][i])
    assert all(torch.equal(x[k], y[k]) for x, y in zip(before[3], after[3]) for k in x)
    assert all(p.grad is None for p in tr.model.parameters())  # the poisoned gradient is gone
    assert not tr.train_step().skipped  # the next step trains normally
    # The run that went through it: counted, logged, and nothing non-finite on disk.
    run = tmp_path / "run"
    rows = [r for r in records(run) if "loss" in r]
    assert [r["skipped_steps"] for r in rows] == [0] * 5 + [1] * 3
    assert rows[5]["step"] == 6 and rows[5]["loss"] is None  # the skipped step has no loss to report
    assert all(torch.isfinite(t).all() for t in all_saved_tensors(run))
    assert read_checkpoint(latest_checkpoint(run / "checkpoints")).state["nonfinite"]["skipped_steps"] == 1
    err = capsys.readouterr().err
    assert re.search(rf"steadydiff: warning: (loss|gradient norm) is -?{kind} at step 5; skipped the update", err)


def test_nonfinite_skip_count_survives_resume_and_resume_stays_exact(assert_resume_exact):
    extra = ("train.ckpt_every=4", "train.nonfinite=skip", "debug.fault_steps=[1,6]", "debug.fault_where=grad")

    def skips_read_back(resumed):
        assert resumed.skipped_steps == 1  # the step-1 skip, read back from the checkpoint

    # The resumed run ends on the same weights and EMA, bit for bit.
    runs = assert_resume_exact(toy(*extra), 8, weights=0, before_resume=skips_read_back)
    a = [r for r in records(runs.full) if "loss" in r]
    b = [r for r in records(runs.split) if "loss" in r]
    drop = {"images_per_sec", "mfu", "peak_flops"}  # timings
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == \
        [{k: v for k, v in r.items() if k not in drop} for r in b]
    assert b[-1]["skipped_steps"] == 2


def test_nonfinite_too_many_consecutive_skips_stops(tmp_path):
    run = tmp_path / "run"
    cfg = toy_cfg("train.steps=10", "train.ckpt_every=2", "train.nonfinite=skip", "debug.fault_steps=[3,4,5,6]",
                  "train.max_consecutive_skips=2")
    with pytest.raises(NonFiniteLossError, match=r"at step 5 after 2 skipped steps in a row "
                                                 r"\(train.max_consecutive_skips=2\)"):
        Trainer(cfg, run, show_progress=False).fit()
    # Steps 3 and 4 were skipped; the step-4 checkpoint (written after the first skip) is the last one.
    ck = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert ck.step == 4 and ck.state["nonfinite"] == {"skipped_steps": 1, "consecutive": 1}
    assert all(torch.isfinite(t).all() for t in all_saved_tensors(run))


@pytest.mark.parametrize("kind, where, needle", [("nan", "loss", "loss is nan at step 4"),
                                                 ("inf", "grad", "gradient norm is inf at step 4")])
def test_nonfinite_stop_exits_3_and_keeps_the_last_good_checkpoint(tmp_path, capsys, kind, where, needle):
    run = tmp_path / "run"
    base = ["train", "--out", str(run), "--quiet", *cli_sets("train.ckpt_every=3", "train.steps=6")]
    assert main(base + ["--set", "train.steps=3"]) == 0
    before = fingerprint(run / "checkpoints")
    capsys.readouterr()
    code = main(base + cli_sets("debug.fault_steps=[4]", f"debug.fault_kind={kind}", f"debug.fault_where={where}"))
    line = one_line(capsys.readouterr().err)
    assert code == EXIT_NONFINITE and needle in line and "train.nonfinite=skip" in line
    assert fingerprint(run / "checkpoints") == before
    assert all(torch.isfinite(t).all() for t in all_saved_tensors(run))
    # The same command with nonfinite=skip resumes from step 3 and gets past the bad step.
    assert main(base + cli_sets("debug.fault_steps=[4]", f"debug.fault_kind={kind}", f"debug.fault_where={where}",
                                "train.nonfinite=skip")) == 0
    assert read_checkpoint(latest_checkpoint(run / "checkpoints")).state["nonfinite"]["skipped_steps"] == 1


# ---------------------------------------------------------------------------------------------------------
# Storage faults


def enospc(path=None):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None if path is None else str(path))


def test_storage_disk_full_during_checkpoint_keeps_the_previous_one(toy_run, capsys, monkeypatch):
    run = toy_run  # the toy run trained to its step-2 checkpoint
    argv = ["train", "--out", str(run), "--quiet", *cli_sets("train.ckpt_every=2", "train.steps=4")]
    before = fingerprint(run / "checkpoints")
    real_save_file = ckpt_mod.save_file
    calls = []

    def full_disk(tensors, filename, *a, **k):  # the second file of the checkpoint hits a full disk midway
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"\0" * 100)
            raise enospc(filename)
        return real_save_file(tensors, filename, *a, **k)

    monkeypatch.setattr(ckpt_mod, "save_file", full_disk)
    capsys.readouterr()
    code = main(argv)
    line = one_line(capsys.readouterr().err)
    assert code == EXIT_USER_ERROR
    assert "could not write checkpoint" in line and "step-0000004" in line
    assert "(No space left on device)" in line and "free space or change --out" in line
    assert fingerprint(run / "checkpoints") == before  # no temp dir, `latest` unchanged, step-2 intact
    assert latest_checkpoint(run / "checkpoints").name == "step-0000002"
    assert read_checkpoint(latest_checkpoint(run / "checkpoints")).step == 2
    monkeypatch.undo()
    assert main(argv) == 0  # space freed: the same command resumes and finishes
    assert read_checkpoint(latest_checkpoint(run / "checkpoints")).step == 4


def test_storage_disk_full_writing_latest_rolls_the_new_checkpoint_back(tmp_path, monkeypatch):
    run = tmp_path / "run"
    tr = Trainer(toy_cfg("train.steps=2", "train.ckpt_every=2"), run, show_progress=False)
    tr.fit()
    before = fingerprint(run / "checkpoints")
    tr.train_step()

    def full_disk(path, text):
        raise enospc(path)

    monkeypatch.setattr(ckpt_mod, "atomic_write_text", full_disk)
    with pytest.raises(ckpt_mod.CheckpointError, match="No space left on device"):
        tr.save()
    assert fingerprint(run / "checkpoints") == before


class _FullDiskFile:
    """A file whose writes fail with ENOSPC after `budget` bytes (the first bytes land, as on a real disk)."""

    def __init__(self, f, budget):
        self.f, self.budget = f, budget

    def write(self, s):
        if len(s) > self.budget:
            self.f.write(s[: self.budget])
            self.f.flush()
            raise enospc()
        self.budget -= len(s)
        return self.f.write(s)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_storage_disk_full_writing_metrics_is_one_line_and_resumable(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    argv = ["train", "--out", str(run), "--quiet", *cli_sets("train.ckpt_every=3", "train.steps=6")]
    assert main(argv[:-2] + cli_sets("train.steps=3")) == 0
    before = fingerprint(run / "checkpoints")
    monkeypatch.setattr(metrics_log, "open", lambda p, mode="r": _FullDiskFile(open(p, mode), 700), raising=False)
    capsys.readouterr()
    code = main(argv)
    line = one_line(capsys.readouterr().err)
    assert code == EXIT_USER_ERROR
    assert f"could not write to {run}: No space left on device; free space or change --out" in line
    assert "re-running the same command resumes" in line
    assert fingerprint(run / "checkpoints") == before
    assert not (run / "metrics.jsonl").read_text().endswith("\n")  # the disk took half a line
    monkeypatch.undo()
    assert main(argv) == 0
    assert [r["step"] for r in records(run) if "loss" in r] == list(range(1, 7))


@pytest.mark.plots("save_samples")  # the PNG write that hits the full disk
def test_storage_disk_full_writing_a_png_keeps_the_old_file(toy_run, tmp_path, capsys, monkeypatch):
    run = toy_run  # a trained toy run (2 steps)
    out = tmp_path / "samples.png"
    out.write_bytes(b"previous samples")

    def full_disk(self, fp, *a, **k):
        Path(fp).write_bytes(b"\x89PNG half")
        raise enospc(fp)

    monkeypatch.setattr(Image.Image, "save", full_disk)
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, fp, *a, **k: full_disk(self, fp))
    capsys.readouterr()
    code = main(["sample", str(run), "--n", "4", "--steps", "2", "--out", str(out)])
    line = one_line(capsys.readouterr().err)
    assert code == EXIT_USER_ERROR and "No space left on device" in line and "free space or change --out" in line
    assert out.read_bytes() == b"previous samples"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "samples.png"]  # no temp file left


# ---------------------------------------------------------------------------------------------------------
# Safe loading


class _Payload:
    """Unpickling runs os.system(...) and creates the marker file: proof a loader executed the file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_file(path: Path, marker: Path, wrap=lambda p: p) -> Path:
    torch.save(wrap(_Payload(marker)), path)
    # The payload is live: an unsafe loader (plain pickle) would create the marker.
    with open(path, "rb") as f:
        import zipfile

        with zipfile.ZipFile(f) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()
    return path


def test_safe_load_crafted_state_pt_is_refused_without_running_it(toy_run, tmp_path, capsys):
    run = toy_run  # `train ... cli_sets("train.steps=2")`, trained once per session
    marker = tmp_path / "pwned"
    ck = latest_checkpoint(run / "checkpoints")
    _evil_file(ck / "state.pt", marker, wrap=lambda p: {"step": 2, "optimizer": p})
    for argv in (["sample", str(run), "--n", "4", "--steps", "2", "--out", str(tmp_path / "x.png")],
                 ["train", "--out", str(run), "--quiet", *cli_sets("train.steps=4")]):
        capsys.readouterr()
        code = main(argv)
        line = one_line(capsys.readouterr().err)
        assert code == EXIT_USER_ERROR, argv
        assert "is not a plain-tensor state file" in line and "steadydiff only loads safetensors" in line
        assert not marker.exists()


def test_safe_load_crafted_official_uvit_pth_is_refused_without_running_it(tmp_path, capsys):
    marker = tmp_path / "pwned"
    pth = _evil_file(tmp_path / "nnet_ema.pth", marker, wrap=lambda p: {"patch_embed.proj.weight": p})
    code = main(["convert", "uvit-official", str(pth), "--out", str(tmp_path / "conv"), "--num-heads", "2"])
    line = one_line(capsys.readouterr().err)
    assert code == EXIT_USER_ERROR
    assert "is not a plain state dict" in line and "steadydiff never unpickles code" in line
    assert not marker.exists() and not (tmp_path / "conv").exists()


def test_safe_load_audit_no_unsafe_loader_in_the_source():
    """Every torch.load passes weights_only=True; no pickle/marshal/yaml.load/jit of untrusted files."""
    src = ROOT / "src" / "steadydiff"
    offenders = []
    for f in sorted(src.rglob("*.py")):
        text = f.read_text()
        for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
            if "weights_only=True" not in m.group(1):
                offenders.append(f"{f.name}: {m.group(0)}")
        for pat in (r"\bpickle\.loads?\(", r"\bmarshal\.loads?\(", r"\byaml\.load\(", r"\byaml\.unsafe_load\(",
                    r"allow_pickle=True", r"weights_only=False"):
            offenders += [f"{f.name}: {m.group(0)}" for m in re.finditer(pat, text)]
        # TorchScript archives only for the SHA-1-pinned Inception file.
        if "torch.jit.load(" in text:
            assert f.name == "inception.py" and "INCEPTION_SHA1" in text, f
    assert not offenders, offenders
