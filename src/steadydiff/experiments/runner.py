"""Run a list of training jobs in one pool; finished runs are never rerun, unfinished ones resume.

A job is one (arm, seed) of an experiment in its own run directory, with extra `--set` overrides (the
LR of an `lr-range` grid point). `compare` runs every arm x seed in `OUT/runs/<arm>/seed-<s>/`; `lr-range`
every arm x LR x seed in `OUT/runs/<arm>/lr-<lr>/seed-<s>/`. Each is an ordinary `steadydiff train` run
directory, plus `result.json` written once the run has ended (trained to the end, or diverged). A run that
diverges (NaN/Inf loss) is recorded with the step at which it did and kept in every table and plot.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..utils.io import atomic_write_text, read_json
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


def train_one(exp_path: str, job: Job, extra: list[str], show_progress: bool,
              threads: int | None = None) -> dict[str, Any]:
    """Train one job to the end or to divergence; returns and stores its result record."""
    import torch

    from ..train import NonFiniteLossError, Trainer
    from .spec import load_experiment

    if threads:
        torch.set_num_threads(threads)
    exp = load_experiment(exp_path, extra)
    cfg = exp.run_config(job.arm, job.seed, [*extra, *job.overrides])
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
    atomic_write_text(Path(job.rdir) / "result.json", json.dumps(result, indent=1) + "\n")
    return result


def run_jobs(exp: Experiment, jobs: list[Job], extra: list[str] | None = None, workers: int | None = None,
             show_progress: bool = True, desc: str = "runs") -> list[dict[str, Any]]:
    """Train the jobs that have no `result.json` yet (the others are kept as they are; an unfinished one
    resumes from its last checkpoint). `workers` > 1 trains that many runs at once in separate processes
    (each with train.threads threads, or cores // workers)."""
    extra = list(extra or [])
    workers = workers or exp.workers
    todo = [j for j in jobs if read_run_result(j.rdir) is None]
    results = []
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=f"{exp.name} {desc}",
               disable=not show_progress, dynamic_ncols=True, position=0)
    if workers == 1:
        for job in todo:
            bar.set_postfix(run=job.label)
            results.append(train_one(str(exp.source), job, extra, show_progress=False))
            bar.update(1)
    else:
        threads = max(1, (os.cpu_count() or 1) // workers)
        # spawn: forked torch processes can deadlock in OpenMP; every worker re-imports cleanly.
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(train_one, str(exp.source), job, extra, False, threads) for job in todo]
            for f in as_completed(futures):
                results.append(f.result())
                bar.update(1)
    bar.close()
    return results


def run_experiment(exp: Experiment, out: Path, extra: list[str] | None = None, workers: int | None = None,
                   show_progress: bool = True) -> list[dict[str, Any]]:
    """Train every arm x seed of a `compare` experiment that has not finished (`run_jobs`)."""
    jobs = [Job(arm, s, run_dir(out, arm, s)) for arm in exp.arms for s in exp.seeds]
    return run_jobs(exp, jobs, extra, workers, show_progress)
