"""Preemption-safe training (issue 30 item 2): a stop signal ends `fit` at the step boundary with a checkpoint
of that step, and the re-run continues onto exactly the uninterrupted trajectory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import toy_cfg, toy_sets
from steadydiff.cli import main
from steadydiff.runs import latest_checkpoint, read_checkpoint
from steadydiff.train import EXIT_PREEMPTED, Trainer, TrainingInterrupted
from steadydiff.train.preemption import StopSignals

EXTRA = ("train.steps=12", "train.ckpt_every=100", "train.log_every=4")


def losses(run) -> list[tuple[int, float]]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _signalled_at(trainer: Trainer, step: int, sig: int) -> None:
    """Send `sig` to this process right after optimiser step `step` (inside the step loop, like a scheduler)."""
    original = trainer.train_step

    def step_then_signal():
        res = original()
        if trainer.step == step:
            os.kill(os.getpid(), sig)
        return res

    trainer.train_step = step_then_signal


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2, signal.SIGINT])
def test_a_stop_signal_checkpoints_the_step_and_the_rerun_continues_exactly(tmp_path, sig):
    full = tmp_path / "full"
    Trainer(toy_cfg(*EXTRA), full, show_progress=False).fit()
    run = tmp_path / "run"
    tr = Trainer(toy_cfg(*EXTRA), run, show_progress=False)
    handler_before = signal.getsignal(sig)
    _signalled_at(tr, 5, sig)  # between two log records and far from any periodic checkpoint
    with pytest.raises(TrainingInterrupted, match=f"stopped by {signal.Signals(sig).name} at step 5") as info:
        tr.fit()
    assert info.value.step == 5 and tr.step == 5  # the step in flight finished; nothing after it ran
    ckpt = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert ckpt.step == 5 and len(ckpt.state["log_window"]) == 1  # step 5 is not logged yet: it travels along
    assert signal.getsignal(sig) == handler_before  # the trainer's handler is gone after fit
    tr.close()
    resumed = Trainer(toy_cfg(*EXTRA), run, show_progress=False)
    assert resumed.step == 5
    resumed.fit()
    assert losses(run) == losses(full)  # the same records, bit for bit: no step lost or repeated
    a, b = (read_checkpoint(latest_checkpoint(r / "checkpoints")) for r in (run, full))
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k])


def test_a_second_sigint_stops_at_once(tmp_path):
    with StopSignals(["SIGINT"]) as stops:
        os.kill(os.getpid(), signal.SIGINT)
        assert stops.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_no_stop_signals_leaves_the_default_handlers(tmp_path):
    before = signal.getsignal(signal.SIGUSR2)
    with StopSignals([]):
        assert signal.getsignal(signal.SIGUSR2) == before


@pytest.mark.parametrize("value", ["[SIGNOPE]", "[TERM]"])
def test_an_unknown_signal_name_is_one_line(tmp_path, capsys, value):
    assert main(["train", "--out", str(tmp_path / "r"), *toy_sets(f"train.stop_signals={value}")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.stop_signals" in err[0] and not (tmp_path / "r").exists()


def test_sigterm_to_the_train_command_exits_75_with_that_steps_checkpoint(tmp_path):
    """The real thing: `steadydiff train` in its own process, SIGTERM once it has logged a few steps."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "steadydiff.cli", "train", "--out", str(run), "--quiet",
           *toy_sets("train.steps=4000", "train.log_every=1", "train.ckpt_every=100000")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and len(losses(run)) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    line = [ln for ln in err.splitlines() if ln.startswith("steadydiff:")]
    assert len(line) == 1 and "stopped by SIGTERM at step" in line[0] and "re-run the same command" in line[0]
    step = int(line[0].split("at step ")[1].split(";")[0])
    assert read_checkpoint(latest_checkpoint(run / "checkpoints")).step == step >= 3
    assert max(s for s, _ in losses(run)) == step  # every finished step logged, none beyond


@pytest.mark.parametrize("fp32, bf16, warned", [(100e9, 10e9, True), (100e9, 150e9, False)])
def test_bf16_slower_than_fp32_is_one_warning_line_with_both_rates(tmp_path, capsys, monkeypatch, fp32, bf16, warned):
    """Issue 30 item 4: the trainer measures both matmul rates when bf16 is asked for and says so when bf16 loses."""
    from steadydiff.train import flops

    monkeypatch.setattr(flops, "measure_peak_flops",
                        lambda device, dtype=torch.float32, **kw: bf16 if dtype == torch.bfloat16 else fp32)
    Trainer(toy_cfg("train.steps=1", "train.bf16=true"), tmp_path / "r", show_progress=False).flop_report()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "train.bf16" in ln]
    if warned:
        assert len(lines) == 1 and lines[0].startswith("steadydiff: warning: ")
        assert "10 GFLOP/s against 100 GFLOP/s in fp32" in lines[0] and "~10.0x slower" in lines[0]
        assert "set train.bf16=false" in lines[0]
    else:
        assert lines == []
