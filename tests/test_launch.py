"""Launchers (experiments/launch.py): `compare` under `--launcher submitit --cluster local` trains the same runs as
the local pool, a job signalled at its time limit checkpoints its step, is requeued and resumes exactly, a re-run
submits only unfinished runs, `--dry-run` prints the array's sbatch script without Slurm, and bad launcher input is
one line.

The submitit tests start real local jobs (subprocesses, as on a cluster node): one module fixture trains the tiny
experiment once with each launcher and the tests read it."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers import metrics_rows
from steadydiff.cli import EXIT_USER_ERROR, main

submitit = pytest.importorskip("submitit", reason="the [slurm] extra is not installed (pip install -e '.[slurm]')")

ROOT = Path(__file__).resolve().parent.parent
STEPS, CKPT = 30, 10


def _experiment(path: Path, lr_range: dict | None = None, **changes) -> Path:
    """The tiny experiment file (with `lr_range`: an lr-range one, judged on the validation loss)."""
    spec = {
        "name": "tiny", "description": "two arms on toy2d, one seed",
        "base": str(ROOT / "configs" / "toy2d.yaml"),
        "set": {"train.steps": STEPS, "train.log_every": 1, "train.ckpt_every": CKPT, "train.keep_ckpts": 20,
                "train.sample_n": 16, "train.sample_steps": 2, "train.threads": 1, "train.warmup_steps": 2,
                "model.depth": 4, "model.hidden": 32, "data.toy_size": 500, "train.batch_size": 32},
        "baseline": "org", "arms": {"org": {"model.skip_scaling": "org"}, "cs": {"model.skip_scaling": "cs"}},
        "seeds": [0], "metric": {"key": "loss"}, "stability": ["loss"], "sensitivity": False, "claims": [],
    }
    if lr_range:
        spec.update(lr_range=lr_range, metric={"key": "val/loss"})
        spec["set"]["diagnostics.val_every"] = CKPT
    spec.update(changes)
    path.write_text(yaml.safe_dump(spec))
    return path


def _task_pid(out: Path, label: str, timeout: float = 60) -> int:
    """The pid of the process training `label`: the child of its local job's controller (jobs.json)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            ctrl = int(json.loads((out / "submitit" / "jobs.json").read_text())[label]["job_id"])
            children = Path(f"/proc/{ctrl}/task/{ctrl}/children").read_text().split()
            if children:
                return int(children[0])
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no task process for {label}")


def _signal_at_step(out: Path, label: str, step: int, box: dict) -> None:
    """Send submitit's time-limit signal to the job training `label` once its log shows `step`."""
    metrics = out / "runs" / Path(label) / "metrics.jsonl"
    end = time.monotonic() + 120
    while time.monotonic() < end:
        seen = max((r.get("step", 0) for r in metrics_rows(metrics.parent)), default=0) if metrics.is_file() else 0
        if seen >= step:
            pid = _task_pid(out, label)
            box["seen"] = seen
            os.kill(pid, signal.SIGUSR2)
            box["signalled"] = pid
            return
        time.sleep(0.02)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny experiment trained by the local pool and by submitit's local cluster; the org run's job gets the
    time-limit signal at step 5 (its checkpoints are slowed by the test hook so that the run is still in flight)."""
    root = tmp_path_factory.mktemp("launch")
    exp = _experiment(root / "exp.yaml")
    assert main(["compare", str(exp), "--out", str(root / "local"), "--quiet"]) == 0
    box: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STEADYDIFF_TEST_CKPT_WRITE_DELAY", "0.15")  # inherited by the jobs: a checkpoint lasts ~0.5 s
        watcher = threading.Thread(target=_signal_at_step, args=(root / "cluster", "org/seed-0", 5, box))
        watcher.start()
        # --timeout-min 1: submitit counts the signal as a time limit (a requeue spent of --max-requeues 2).
        code = main(["compare", str(exp), "--out", str(root / "cluster"), "--quiet", "--launcher", "submitit",
                     "--cluster", "local", "--timeout-min", "1", "--max-requeues", "2"])
        watcher.join()
    assert code == 0
    return root, exp, box


def _run(out: Path, label: str) -> Path:
    return out / "runs" / label


@pytest.mark.slow  # the `trained` fixture: two submitit jobs, one requeued (~20 s on 2 shared cores)
@pytest.mark.parametrize("label", ["org/seed-0", "cs/seed-0"])
def test_submitit_local_trains_what_the_local_pool_trains(trained, label):
    root, _, _ = trained
    a, b = _run(root / "local", label), _run(root / "cluster", label)
    ra, rb = (json.loads((r / "result.json").read_text()) for r in (a, b))
    drop = {"wall_s"}
    assert {k: v for k, v in ra.items() if k not in drop} == {k: v for k, v in rb.items() if k not in drop}
    assert rb["status"] == "ok" and rb["final_step"] == STEPS

    def losses(run):  # every step logged exactly once, with the same loss
        return [(r["step"], r["loss"]) for r in metrics_rows(run) if "loss" in r]

    assert losses(a) == losses(b) and [s for s, _ in losses(b)] == list(range(1, STEPS + 1))
    import torch

    from steadydiff.runs import latest_checkpoint, read_checkpoint

    ca, cb = (read_checkpoint(latest_checkpoint(r / "checkpoints")) for r in (a, b))
    assert all(torch.equal(ca.model[k], cb.model[k]) and torch.equal(ca.ema[k], cb.ema[k]) for k in ca.model)
    # The experiment's analysis reads the same numbers either way.
    arm = label.split("/")[0]
    res = [json.loads((root / d / "results.json").read_text())["arms"][arm] for d in ("local", "cluster")]
    assert res[0]["curves_per_seed"] == res[1]["curves_per_seed"] and res[0]["final_per_seed"] == res[1][
        "final_per_seed"]


@pytest.mark.slow
def test_a_job_at_its_time_limit_checkpoints_its_step_is_requeued_and_resumes(trained):
    root, _, box = trained
    assert box.get("signalled"), "the watcher never signalled the job"
    run = _run(root / "cluster", "org/seed-0")
    steps = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    # The step boundary the signal stopped at has a checkpoint besides the periodic ones, unless (on loaded cores,
    # where the watcher lags the job) the job had reached a periodic step by the time the signal came: then that
    # step's checkpoint is the one it stopped at. Either way it is at or after the step the watcher saw.
    stopped = [s for s in steps if s % CKPT]
    assert len(stopped) <= 1 and all(box["seen"] <= s < STEPS for s in stopped), (steps, box)
    job = json.loads((root / "cluster" / "submitit" / "jobs.json").read_text())["org/seed-0"]["job_id"]
    log = (root / "cluster" / "submitit" / f"{job}_0_log.out").read_text()
    err = (root / "cluster" / "submitit" / f"{job}_0_log.err").read_text()
    # submitit saw a time limit (not a preemption) and requeued the job once, with one requeue left of 2.
    assert "this job is timed-out" in err + log and "(1 remaining timeouts)" in err + log, err[-2000:]
    assert "stopped by SIGUSR2" not in err  # handed to submitit, not an error
    # The other job was never signalled: its checkpoints are the periodic ones.
    other = _run(root / "cluster", "cs/seed-0")
    assert all(int(p.name.split("-")[1]) % CKPT == 0 for p in (other / "checkpoints").glob("step-*"))


@pytest.mark.slow
def test_a_rerun_submits_only_unfinished_runs_and_dry_run_prints_the_array(trained, capsys):
    root, exp, _ = trained
    out = root / "cluster"
    before = sorted(p.name for p in (out / "submitit").iterdir())
    assert main(["compare", str(exp), "--out", str(out), "--launcher", "submitit", "--cluster", "local",
                 "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == "nothing to submit: every run has finished"
    # A run whose job died without finishing (no result.json) is the only one submitted again.
    (out / "runs" / "cs" / "seed-0" / "result.json").rename(out / "kept.json")
    try:
        assert main(["compare", str(exp), "--out", str(out), "--launcher", "submitit", "--cluster", "slurm",
                     "--partition", "gpu", "--gpus-per-run", "2", "--cpus-per-run", "8", "--timeout-min", "90",
                     "--array-parallelism", "4", "--slurm-extra", "account=ab12", "--dry-run", "--set",
                     "train.device=cuda"]) == 0
    finally:
        (out / "kept.json").rename(out / "runs" / "cs" / "seed-0" / "result.json")
    text = capsys.readouterr().out
    assert "would submit 1 job to submitit's slurm cluster (one per run; 2 tasks each)" in text
    assert "[0] cs/seed-0 ->" in text and "org/seed-0" not in text
    for line in ("#SBATCH --array=0-0%1", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --ntasks-per-node=2", "#SBATCH --cpus-per-task=8", "#SBATCH --time=90",
                 "#SBATCH --account=ab12", "#SBATCH --signal=USR2@90", "-m submitit.core._submit"):
        assert line in text, line
    assert sorted(p.name for p in (out / "submitit").iterdir()) == before  # nothing submitted or written


def test_lr_range_dry_run_lists_every_grid_run(tmp_path, capsys):
    exp = _experiment(tmp_path / "lr.yaml", lr_range={"lrs": [1e-3, 3e-3]})
    assert main(["lr-range", str(exp), "--out", str(tmp_path / "out"), "--launcher", "submitit", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "would submit 4 jobs" in text and "#SBATCH --array=0-3%4" in text and "cs/lr-0.003/seed-0" in text
    assert not (tmp_path / "out").exists()


def test_the_debug_cluster_trains_in_this_process(tmp_path):
    from steadydiff.experiments import load_experiment, run_experiment
    from steadydiff.experiments.launch import LaunchOptions

    exp = load_experiment(_experiment(tmp_path / "exp.yaml", arms={"org": {}}, set={
        "train.steps": 6, "train.log_every": 3, "train.threads": 1, "model.depth": 4, "model.hidden": 32,
        "data.toy_size": 200, "train.batch_size": 16, "train.sample_n": 8, "train.sample_steps": 2}))
    res = run_experiment(exp, tmp_path / "out", show_progress=False,
                         launch=LaunchOptions("submitit", "debug", folder=tmp_path / "out" / "submitit"))
    assert [(r["arm"], r["status"], r["final_step"]) for r in res] == [("org", "ok", 6)]
    assert json.loads((tmp_path / "out" / "runs" / "org" / "seed-0" / "result.json").read_text())["final_step"] == 6


def test_a_multi_task_job_gets_the_variables_torchrun_would_set(monkeypatch):
    """--gpus-per-run N > 1: each of the job's N tasks finds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    (from submitit's torch distributed environment) before the trainer reads them (utils/distributed.py)."""
    from steadydiff.experiments.launch import RunJob

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so that what the job exports is undone after the test
        monkeypatch.delenv(k)
    env = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "4242", "SUBMITIT_LOCAL_NTASKS": "2",
           "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "1",
           "SUBMITIT_LOCAL_LOCALID": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = {}

    def train(exp_path, job, extra, show, threads):
        seen.update({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")})
        return {"ok": True}

    assert RunJob(train, "exp.yaml", None, [])() == {"ok": True}
    assert (seen["RANK"], seen["WORLD_SIZE"], seen["LOCAL_RANK"]) == ("1", "2", "1")
    assert seen["MASTER_ADDR"] and 20000 <= int(seen["MASTER_PORT"]) <= 60000
    # checkpoint(): the same run again, as submitit's requeue protocol asks
    job = RunJob(train, "exp.yaml", None, [])
    assert job.checkpoint().function is job


@pytest.mark.slow  # a 2-process job: two interpreters importing torch and joining a gloo group
def test_a_two_task_job_trains_its_run_with_ddp_inside_the_job(tmp_path):
    """The path of --gpus-per-run 2, on CPUs: submitit starts 2 tasks, they join one process group from the
    variables RunJob exports, train the run with DDP, and rank 0 alone writes result.json; the losses are the
    single-process run's up to the order of the gradient sum."""
    from steadydiff.experiments import load_experiment, run_experiment
    from steadydiff.experiments.launch import LaunchOptions

    exp = load_experiment(_experiment(tmp_path / "exp.yaml", arms={"org": {}}))
    run_experiment(exp, tmp_path / "one", show_progress=False)
    res = run_experiment(exp, tmp_path / "two", show_progress=False, launch=LaunchOptions(
        "submitit", "local", folder=tmp_path / "two" / "submitit", tasks_per_run=2))
    assert [(r["arm"], r["final_step"]) for r in res] == [("org", STEPS)]
    one, two = (metrics_rows(tmp_path / d / "runs" / "org" / "seed-0") for d in ("one", "two"))
    assert two[0]["world_size"] == 2 and one[0]["world_size"] == 1
    la, lb = ([r["loss"] for r in rows if "loss" in r] for rows in (one, two))
    assert len(la) == len(lb) == STEPS and max(abs(a - b) / abs(a) for a, b in zip(la, lb)) < 1e-5


@pytest.mark.parametrize("args, needle", [
    (["--partition", "gpu"], "--partition is an option of --launcher submitit; add --launcher submitit"),
    (["--cluster", "local"], "--cluster is an option of --launcher submitit"),
    (["--dry-run"], "--dry-run is an option of --launcher submitit"),
    (["--launcher", "submitit", "--gpus-per-run", "1", "--set", "train.device=cpu"],
     "--gpus-per-run 1: the runs train on train.device=cpu; add --set train.device=cuda"),
    (["--launcher", "submitit", "--slurm-extra", "account"], "--slurm-extra 'account': expected KEY=VALUE"),
    (["--launcher", "slurm"], "argument --launcher: invalid choice: 'slurm' (choose from 'local', 'submitit')"),
    (["--launcher", "submitit", "--cluster", "k8s"], "argument --cluster: invalid choice: 'k8s'"),
    (["--launcher", "submitit", "--gpus-per-run", "-1"], "argument --gpus-per-run: must be >= 0"),
])
def test_bad_launcher_input_is_one_line(tmp_path, capsys, args, needle):
    exp = _experiment(tmp_path / "exp.yaml")
    assert main(["compare", str(exp), "--out", str(tmp_path / "out"), *args]) == EXIT_USER_ERROR
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("steadydiff: error: ") and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_submitit_missing_or_no_slurm_is_one_line_naming_the_fix(tmp_path, capsys, monkeypatch):
    exp = _experiment(tmp_path / "exp.yaml")
    monkeypatch.setitem(sys.modules, "submitit", None)  # as if the [slurm] extra were not installed
    assert main(["compare", str(exp), "--out", str(tmp_path / "out"), "--launcher", "submitit"]) == EXIT_USER_ERROR
    assert "--launcher submitit needs the [slurm] extra: pip install 'steadydiff[slurm]'" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun: not a Slurm login node
    assert main(["lr-range", str(_experiment(tmp_path / "lr.yaml", lr_range={"lrs": [1e-3]})), "--out",
                 str(tmp_path / "lr"), "--launcher", "submitit", "--quiet"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cluster slurm: no Slurm here (srun is not on PATH)" in err[0] and "--dry-run" in err[0]
