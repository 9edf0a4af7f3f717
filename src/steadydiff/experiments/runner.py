"""Run a list of training jobs in one pool; finished runs are never rerun, unfinished ones resume.

A job is one (arm, seed) of an experiment in its own run directory, with extra `--set` overrides (the
LR of an `lr-range` grid point). `compare` runs every arm x seed in `OUT/runs/<arm>/seed-<s>/`; `lr-range`
every arm x LR x seed in `OUT/runs/<arm>/lr-<lr>/seed-<s>/`. Each is an ordinary `steadydiff train` run
directory, plus `result.json` written once the run has ended (trained to the end, or diverged). A run that
diverges (NaN/Inf loss) is recorded with the step at which it did and kept in every table and plot. Where the
runs train (this machine's pool, or one cluster job each) is the launcher's business (`launch.py`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..utils.io import atomic_write_text, read_json
from .launch import LAUNCHERS, LaunchOptions
from .spec import Experiment


@dataclass(frozen=True)
class Job:
    """One run: the experiment's arm and seed, its run directory, and overrides applied after the command
    line's (e.g. `train.lr=0.001`)."""

    arm: str
    seed: int
    rdir: Path
    overrides: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return "/".join([self.arm, *(o.replace("train.", "") for o in self.overrides), f"seed-{self.seed}"])


def run_dir(out: Path, arm: str, seed: int) -> Path:
    """The run directory of (arm, seed) in a `compare` experiment."""
    return Path(out) / "runs" / arm / f"seed-{seed}"


def read_run_result(rdir: Path) -> dict[str, Any] | None:
    """The run's result.json, or None while it has not ended."""
    path = Path(rdir) / "result.json"
    return read_json(path, "delete it to train that run again") if path.exists() else None


def read_result(out: Path, arm: str, seed: int) -> dict[str, Any] | None:
    return read_run_result(run_dir(out, arm, seed))


def tracker_overrides(exp: Experiment, job: Job) -> list[str]:
    """How the run's trackers name it (`runs/trackers.py`): W&B group and MLflow experiment = the experiment, job
    type and tag `arm` = the arm, run name = the job's label (arm/seed-S, arm/lr-X/seed-S). The diagnostics section
    may change on resume, so runs trained before these keys existed resume as they are."""
    values = {"tracker_group": exp.name, "tracker_job": job.arm, "tracker_name": job.label}
    return [f"diagnostics.{k}={json.dumps(v)}" for k, v in values.items()]  # JSON: YAML reads it back as a string


def train_one(exp_path: str, job: Job, extra: list[str], show_progress: bool,
              threads: int | None = None) -> dict[str, Any]:
    """Train one job to the end or to divergence; returns and stores its result record (rank 0 stores it when the
    run trains on several processes). A stop signal raises `TrainingInterrupted` with the step's checkpoint saved
    and no result.json: the run is unfinished and resumes when trained again."""
    import torch

    from ..train import NonFiniteLossError, Trainer
    from .spec import load_experiment

    if threads:
        torch.set_num_threads(threads)
    exp = load_experiment(exp_path, extra)
    # The command line's overrides come after the tracker names, so `--set diagnostics.tracker_name=...` wins.
    cfg = exp.run_config(job.arm, job.seed, [*tracker_overrides(exp, job), *extra, *job.overrides])
    t0 = time.perf_counter()
    trainer = Trainer(cfg, job.rdir, show_progress=show_progress)
    result: dict[str, Any] = {"arm": job.arm, "seed": job.seed, "status": "ok", "steps": cfg.train.steps}
    if job.overrides:
        result["overrides"] = list(job.overrides)
    try:
        trainer.fit()
    except NonFiniteLossError as e:
        result.update(status="diverged", diverged_at=trainer.step, error=str(e))
    finally:
        trainer.close()
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result["final_step"] = trainer.step
    if trainer.dist.is_main:
        atomic_write_text(Path(job.rdir) / "result.json", json.dumps(result, indent=1) + "\n")
    return result


def run_jobs(exp: Experiment, jobs: list[Job], extra: list[str] | None = None, workers: int | None = None,
             show_progress: bool = True, desc: str = "runs", launch: LaunchOptions | None = None
             ) -> list[dict[str, Any]]:
    """Train the jobs that have no `result.json` yet (the others are kept as they are; an unfinished one
    resumes from its last checkpoint) with the launcher of `launch` (`launch.py`; default: the local pool).
    `workers` > 1 trains that many runs at once in separate processes (each with train.threads threads, or
    cores // workers)."""
    extra = list(extra or [])
    launch = launch or LaunchOptions()
    workers = workers or exp.workers
    todo = [j for j in jobs if read_run_result(j.rdir) is None]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=f"{exp.name} {desc}",
               disable=not show_progress, dynamic_ncols=True, position=0)
    try:
        return LAUNCHERS.choose(launch.launcher, "--launcher")(todo, train_one, read_run_result, str(exp.source),
                                                                extra, workers, launch, bar, exp.name)
    finally:
        bar.close()


def unfinished(jobs: list[Job]) -> list[Job]:
    return [j for j in jobs if read_run_result(j.rdir) is None]


def experiment_jobs(exp: Experiment, out: Path) -> list[Job]:
    """Every arm x seed of a `compare` experiment, as runner jobs."""
    return [Job(arm, s, run_dir(out, arm, s)) for arm in exp.arms for s in exp.seeds]


def run_experiment(exp: Experiment, out: Path, extra: list[str] | None = None, workers: int | None = None,
                   show_progress: bool = True, launch: LaunchOptions | None = None) -> list[dict[str, Any]]:
    """Train every arm x seed of a `compare` experiment that has not finished (`run_jobs`)."""
    return run_jobs(exp, experiment_jobs(exp, out), extra, workers, show_progress, launch=launch)
