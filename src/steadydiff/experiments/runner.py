"""Run every arm x seed of an experiment; finished runs are never rerun, unfinished ones resume.

Each run lives in `OUT/runs/<arm>/seed-<s>/` as an ordinary `steadydiff train` run directory, plus
`result.json` written once the run has ended (trained to the end, or diverged). A run that diverges (NaN/Inf
loss) is recorded with the step at which it did and kept in every table and plot.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..utils.io import atomic_write_text, read_json
from .spec import Experiment


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return Path(out) / "runs" / arm / f"seed-{seed}"


def read_result(out: Path, arm: str, seed: int) -> dict[str, Any] | None:
    path = run_dir(out, arm, seed) / "result.json"
    return read_json(path, "delete it to train that run again") if path.exists() else None


def train_one(exp_path: str, arm: str, seed: int, out: str, extra: list[str], show_progress: bool,
              threads: int | None = None) -> dict[str, Any]:
    """Train one (arm, seed) to the end or to divergence; returns and stores its result record."""
    import torch

    from ..train import NonFiniteLossError, Trainer
    from .spec import load_experiment

    if threads:
        torch.set_num_threads(threads)
    exp = load_experiment(exp_path, extra)
    cfg = exp.run_config(arm, seed, extra)
    rdir = run_dir(Path(out), arm, seed)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, rdir, show_progress=show_progress)
    result: dict[str, Any] = {"arm": arm, "seed": seed, "status": "ok", "steps": cfg.train.steps}
    try:
        trainer.fit()
    except NonFiniteLossError as e:
        result.update(status="diverged", diverged_at=trainer.step, error=str(e))
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result["final_step"] = trainer.step
    atomic_write_text(rdir / "result.json", json.dumps(result, indent=1) + "\n")
    return result


def run_experiment(exp: Experiment, out: Path, extra: list[str] | None = None, workers: int | None = None,
                   show_progress: bool = True) -> list[dict[str, Any]]:
    """Train all runs that have no `result.json` yet. `workers` > 1 trains that many runs at once in separate
    processes (each with train.threads threads, or cores // workers)."""
    out = Path(out)
    extra = list(extra or [])
    workers = workers or exp.workers
    todo = [(arm, s) for arm in exp.arms for s in exp.seeds if read_result(out, arm, s) is None]
    results = []
    bar = tqdm(total=len(exp.arms) * len(exp.seeds), initial=len(exp.arms) * len(exp.seeds) - len(todo),
               desc=f"{exp.name} runs", disable=not show_progress, dynamic_ncols=True, position=0)
    if workers == 1:
        for arm, s in todo:
            bar.set_postfix(run=f"{arm}/seed-{s}")
            results.append(train_one(str(exp.source), arm, s, str(out), extra, show_progress=False))
            bar.update(1)
    else:
        threads = max(1, (os.cpu_count() or 1) // workers)
        # spawn: forked torch processes can deadlock in OpenMP; every worker re-imports cleanly.
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(train_one, str(exp.source), arm, s, str(out), extra, False, threads): (arm, s)
                       for arm, s in todo}
            for f in as_completed(futures):
                results.append(f.result())
                bar.update(1)
    bar.close()
    return results
