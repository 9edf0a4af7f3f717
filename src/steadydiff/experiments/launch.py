"""Launchers: where the runs of `compare` and `lr-range` train (`--launcher`, a registry: LAUNCHERS).

- `local` (the default): the pool on this machine, in this process (workers 1) or in that many spawned processes.
- `submitit`: one cluster job per run, all submitted as one job array through submitit (the [slurm] extra) to
  `--cluster` (CLUSTERS): `slurm` (sbatch, from a Slurm login node), `local` (the jobs are subprocesses of this
  command: to try the launcher, and for tests) or `debug` (in this process, one after another).

Every launcher calls the runner's `train_one` for a run, so a run's directory, its resume from the latest
checkpoint and its result.json are the same whichever launcher trained it. A job with `--gpus-per-run N > 1` starts
N tasks (one per GPU); submitit's torch distributed environment sets the RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT that `utils/distributed.py` reads, so the run trains with DDP inside its job.

Time limits and preemption: submitit signals a job (SIGUSR2; on Slurm `--signal=USR2@90`, 90 s before the limit,
and its local cluster likewise). The trainer's stop signals (`train.stop_signals`, `train/preemption.py`) end `fit`
at the step boundary with that step's checkpoint, and the job then hands the signal back to submitit's own handler,
which asks the job for `checkpoint()` (the same run again) and requeues it: at most `--max-requeues` times for a
time limit (a preemption does not count). The requeued job resumes from that checkpoint, so at most the step in
flight is lost. Another stop signal (scancel's SIGTERM) ends the job with the checkpoint saved; re-running the
command submits that run again.

Re-running the command submits only the runs that have no result.json and no job still queued or running
(OUT/submitit/jobs.json remembers each run's job): a finished experiment submits nothing. `--dry-run` prints what
would be submitted (the sbatch script of the array) and submits nothing.

This module does not import the runner: `run_jobs` (runner.py) passes the function that trains one run and the one
that reads its result, so the runner's jobs and results stay defined in one place.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, fields
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..utils.errors import ConfigError, SteadydiffError
from ..utils.io import atomic_write_text
from ..utils.registry import Registry

# Train one run: (experiment file, job, extra overrides, show progress, torch threads) -> its result record.
TrainFn = Callable[..., dict[str, Any]]
ResultFn = Callable[[Path], "dict[str, Any] | None"]  # a run directory's result.json, None while unfinished

DEFAULT_TIMEOUT_MIN = 720  # a job's time limit; a longer run is requeued at the limit and resumes
DEFAULT_MAX_REQUEUES = 3  # requeues after a time limit (submitit's default); preemptions do not count
JOBS_FILE = "jobs.json"  # OUT/submitit/jobs.json: run label -> the job that trains it
# Slurm states in which a job may still train its run: it must not be submitted again beside it.
SLURM_ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING",
                "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED"}


NO_SLURM = ("--cluster slurm: no Slurm here (srun is not on PATH); run the command on a Slurm login node, try "
            "--cluster local, or add --dry-run to print the sbatch script")


class LaunchError(SteadydiffError):
    """Runs that a launcher could not finish; the message names them, their logs and the fix."""


@dataclass(frozen=True)
class LaunchOptions:
    """The `--launcher` and cluster options of `compare` and `lr-range` (`folder`: where submitit keeps its
    pickles and logs, OUT/submitit, set by the command)."""

    launcher: str = "local"
    cluster: str | None = None
    partition: str | None = None
    gpus_per_run: int | None = None
    cpus_per_run: int | None = None
    timeout_min: int | None = None
    max_requeues: int | None = None
    array_parallelism: int | None = None
    slurm_extra: tuple[str, ...] = ()
    dry_run: bool = False
    folder: Path | None = None
    # Processes per run; default one per GPU (at least one). Not a CLI flag: the tests run a 2-process CPU job.
    tasks_per_run: int | None = None

    def cluster_flags(self) -> list[str]:
        """The cluster options given (as their CLI flags): they mean something only to `--launcher submitit`."""
        default = LaunchOptions()
        return ["--" + f.name.replace("_", "-") for f in fields(self)
                if f.name not in ("launcher", "folder", "tasks_per_run")
                and getattr(self, f.name) != getattr(default, f.name)]

    @property
    def tasks(self) -> int:
        return self.tasks_per_run or max(1, self.gpus_per_run or 0)


def slurm_extra(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--slurm-extra KEY=VALUE` pairs as sbatch options (`account=ab12` -> `#SBATCH --account=ab12`)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--slurm-extra {item!r}: expected KEY=VALUE, e.g. --slurm-extra account=ab12")
        out[key.strip().replace("_", "-")] = value.strip()
    return out


def check_options(opts: LaunchOptions, configs: list) -> None:
    """The one-line errors of bad launcher input, before anything is written or submitted. `configs`: the run
    configs of the experiment (one per arm)."""
    LAUNCHERS.choose(opts.launcher, "--launcher")
    if opts.launcher != "submitit":
        given = opts.cluster_flags()
        if given:
            raise ConfigError(f"{given[0]} is an option of --launcher submitit; add --launcher submitit (with "
                              f"--cluster slurm, local or debug), or drop {given[0]}")
        return
    _submitit()
    CLUSTERS.choose(opts.cluster or "slurm", "--cluster")
    slurm_extra(opts.slurm_extra)
    if opts.gpus_per_run:
        cpu = [c for c in configs if c.train.device == "cpu"]
        if cpu:
            raise ConfigError(f"--gpus-per-run {opts.gpus_per_run}: the runs train on train.device=cpu; add --set "
                              "train.device=cuda (or auto), or drop --gpus-per-run")
    if (opts.cluster or "slurm") == "slurm" and not opts.dry_run and shutil.which("srun") is None:
        raise ConfigError(NO_SLURM)


# ---------------------------------------------------------------------------------------------------------
# local: the pool


def launch_local(todo: list, train: TrainFn, result_of: ResultFn, exp_path: str, extra: list[str], workers: int,
                 opts: LaunchOptions, bar: tqdm, name: str) -> list[dict[str, Any]]:
    """Train the runs here: one after another in this process (workers 1), or `workers` at once in spawned
    processes (each with cores // workers threads)."""
    results = []
    if workers == 1:
        for job in todo:
            bar.set_postfix(run=job.label)
            results.append(train(exp_path, job, extra, False))
            bar.update(1)
        return results
    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn: forked torch processes can deadlock in OpenMP; every worker re-imports cleanly.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=stop_when_orphaned,
                             initargs=(os.getpid(),)) as pool:
        futures = [pool.submit(_train_marked, train, exp_path, job, extra, False, threads) for job in todo]
        for f in as_completed(futures):
            results.append(f.result())
            bar.update(1)
    return results


ORPHAN_POLL_S = 1.0  # how often a pool worker checks that the command that started it is still there


class _WorkerState:
    """In a pool worker: whether it trains a run now, and whether its command is gone (then it starts no run)."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.training = False
        self.orphaned = False


_WORKER: _WorkerState | None = None  # set by `stop_when_orphaned` in each pool worker


def _train_marked(train: TrainFn, *args: Any) -> dict[str, Any]:
    """`train(*args)` in a pool worker, marked as training for `stop_when_orphaned`. An orphaned worker exits here
    instead: the executor queues a run ahead to each worker, and one whose command died while it stopped its last
    run would otherwise pick that run up and train it to the end."""
    w = _WORKER
    if w is not None:
        with w.lock:
            if w.orphaned:
                os._exit(1)
            w.training = True
    try:
        return train(*args)
    finally:
        if w is not None:
            with w.lock:
                w.training = False


def stop_when_orphaned(parent: int) -> None:
    """In each local pool worker: when the command that started the pool is gone (killed by a signal sent to it
    alone, e.g. `kill PID`, or by SIGKILL), stop. A worker that is training signals itself SIGTERM, which the
    trainer's stop signals turn into a checkpoint of the step and a stop (`train/preemption.py`); it starts no
    further run, and exits once none is training. Without it the worker trains its run on as an orphan, writing
    into a run directory that a re-run of the command trains too, and then waits for work for ever (its queue's
    write end is its own, so it never sees the end of the pipe)."""
    import threading

    global _WORKER
    w = _WORKER = _WorkerState()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        with w.lock:  # from here on `_train_marked` starts nothing
            w.orphaned, training = True, w.training
        if training:
            os.kill(os.getpid(), signal.SIGTERM)
        while w.training:  # the trainer saves the step's checkpoint, then `train` returns or raises
            time.sleep(0.1)
        os._exit(1)  # nobody is left to report to

    threading.Thread(target=watch, name="steadydiff-orphan-watch", daemon=True).start()


# ---------------------------------------------------------------------------------------------------------
# submitit: one job per run


def _submitit():
    try:
        import submitit
    except ImportError as e:
        raise ConfigError("--launcher submitit needs the [slurm] extra: pip install 'steadydiff[slurm]'") from e
    return submitit


def requeue_signal() -> signal.Signals:
    """The signal submitit sends ahead of a time limit and requeues on (SUBMITIT_PREEMPT_SIGNAL, default USR2)."""
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]


@dataclass
class RunJob:
    """One run as a submitit job: a callable that submitit pickles, runs on a node and, after its requeue signal,
    resubmits through `checkpoint()`: the same run again, which resumes from its latest checkpoint."""

    train: TrainFn
    exp_path: str
    job: Any  # runner.Job
    extra: list[str]
    threads: int | None = None

    def __call__(self) -> dict[str, Any] | None:
        from ..train import TrainingInterrupted

        submitit = _submitit()
        env = submitit.JobEnvironment()
        if env.num_tasks > 1:
            # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT for utils/distributed.py; each task picks its GPU by
            # LOCAL_RANK, so every task keeps seeing all the job's GPUs.
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        try:
            return self.train(self.exp_path, self.job, self.extra, False, self.threads)
        except TrainingInterrupted as e:
            # The trainer has saved the checkpoint of this step. On submitit's signal, hand it back to submitit's
            # handler (restored when fit returned): it calls checkpoint() and requeues this job, or ends it once the
            # time-limit requeues are spent. Only task 0 requeues; the other tasks end quietly.
            if e.signal_name in (requeue_signal().name, "a stop signal on another rank"):
                # callable: submitit's handler is there (the debug cluster, in this process, installs none, and
                # raising the signal with its default action would end the command itself).
                if env.global_rank == 0 and callable(signal.getsignal(requeue_signal())):
                    signal.raise_signal(requeue_signal())
                return None
            raise

    def checkpoint(self) -> Any:
        """submitit's checkpointing protocol: what to run after the requeue (this run, resumed)."""
        return _submitit().helpers.DelayedSubmission(self)


def _executor(opts: LaunchOptions, name: str):
    submitit = _submitit()
    cluster = opts.cluster or "slurm"
    folder = Path(opts.folder)
    kwargs = {}
    if cluster != "debug":
        kwargs[f"{cluster}_max_num_timeout"] = DEFAULT_MAX_REQUEUES if opts.max_requeues is None else opts.max_requeues
    try:
        ex = submitit.AutoExecutor(folder=folder, cluster=cluster, **kwargs)
    except RuntimeError as e:
        if cluster == "slurm":
            raise ConfigError(NO_SLURM) from e
        raise
    params: dict[str, Any] = {"name": name, "timeout_min": opts.timeout_min or DEFAULT_TIMEOUT_MIN,
                              "tasks_per_node": opts.tasks, "nodes": 1}
    if opts.gpus_per_run:
        params["gpus_per_node"] = opts.gpus_per_run
    if opts.cpus_per_run:
        params["cpus_per_task"] = opts.cpus_per_run
    if cluster == "slurm":
        params.update(slurm_partition=opts.partition, slurm_array_parallelism=opts.array_parallelism,
                      slurm_additional_parameters=slurm_extra(opts.slurm_extra) or None)
    ex.update_parameters(**params)
    return ex


def _jobs_file(opts: LaunchOptions) -> Path:
    return Path(opts.folder) / JOBS_FILE


def _read_jobs(opts: LaunchOptions) -> dict[str, dict[str, str]]:
    path = _jobs_file(opts)
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # a damaged record only costs the check for live jobs
        return {}


def _alive(record: dict[str, str], opts: LaunchOptions) -> bool:
    """Whether the job recorded for a run may still be training it (queued, running, requeued)."""
    cluster, job_id = record.get("cluster"), str(record.get("job_id", ""))
    if not job_id:
        return False
    if cluster == "local":  # the job's controller process, while it lives
        try:
            cmd = Path(f"/proc/{int(job_id)}/cmdline").read_bytes()
        except (OSError, ValueError):
            return False
        return b"submitit" in cmd
    if cluster == "slurm":
        try:
            state = _submitit().SlurmJob(Path(opts.folder), job_id).state
        except Exception:  # noqa: BLE001 - no sacct here: nothing can be running
            return False
        return state.split()[0].upper() in SLURM_ACTIVE
    return False


def _split_live(todo: list, opts: LaunchOptions) -> tuple[list, dict[str, dict[str, str]]]:
    """(the runs to submit, {label: job record} of runs whose job is still alive)."""
    records = _read_jobs(opts)
    live = {j.label: records[j.label] for j in todo if j.label in records and _alive(records[j.label], opts)}
    return [j for j in todo if j.label not in live], live


def sbatch_script(opts: LaunchOptions, n: int, name: str) -> str:
    """The sbatch script of an array of `n` runs, as submitit would write it (rendered by submitit, so it needs no
    Slurm here)."""
    from submitit.slurm.slurm import _make_sbatch_string  # the renderer SlurmExecutor submits with

    _submitit()
    folder = Path(opts.folder).absolute()
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    params: dict[str, Any] = {"job_name": name, "time": opts.timeout_min or DEFAULT_TIMEOUT_MIN, "nodes": 1,
                              "ntasks_per_node": opts.tasks, "partition": opts.partition,
                              "cpus_per_task": opts.cpus_per_run, "gpus_per_node": opts.gpus_per_run or None,
                              "additional_parameters": slurm_extra(opts.slurm_extra) or None}
    if opts.array_parallelism:
        params["array_parallelism"] = opts.array_parallelism
    return _make_sbatch_string(command=command, folder=folder, map_count=n,
                               **{k: v for k, v in params.items() if v is not None})


def plan_lines(todo: list, opts: LaunchOptions, name: str) -> list[str]:
    """What `--dry-run` prints: the runs each job would train and, for Slurm, the array's sbatch script."""
    cluster = opts.cluster or "slurm"
    submit, live = _split_live(todo, opts)
    lines = [f"would submit {len(submit)} job{'s' * (len(submit) != 1)} to submitit's {cluster} cluster "
             f"(one per run; {opts.tasks} task{'s' * (opts.tasks != 1)} each)" if submit else
             "nothing to submit: every run has finished" + (" or has a live job" if live else "")]
    lines += [f"  [{i}] {j.label} -> {j.rdir}" for i, j in enumerate(submit)]
    lines += [f"  (still queued or running: {label}, job {r['job_id']})" for label, r in live.items()]
    if submit and cluster == "slurm":
        where = f"{Path(opts.folder)}/<job id>_submission.sh"
        lines += ["", f"# the sbatch script of the array (submitted, it is {where}):",
                  sbatch_script(opts, len(submit), name)]
    return lines


def _log_hint(job) -> str:
    try:
        return str(job.paths.stderr)
    except Exception:  # noqa: BLE001 - a job handle without paths (attached from an earlier command)
        return "OUT/submitit/"


class _Attached:
    """A job of an earlier command (from jobs.json) that is still alive: done once it is no more."""

    def __init__(self, record: dict[str, str], opts: LaunchOptions):
        self.record, self.opts, self.job_id = record, opts, record["job_id"]

    def done(self) -> bool:
        return not _alive(self.record, self.opts)


def launch_submitit(todo: list, train: TrainFn, result_of: ResultFn, exp_path: str, extra: list[str], workers: int,
                    opts: LaunchOptions, bar: tqdm, name: str) -> list[dict[str, Any]]:
    """Submit one job per run (one array), wait for every job, and return the results of the runs; a run that did
    not finish is a LaunchError naming its job and log. A run whose job from an earlier command is still queued or
    running is not submitted again: this command waits for that job."""
    submitit = _submitit()
    cluster = opts.cluster or "slurm"
    submit, live = _split_live(todo, opts)
    handles: dict[str, Any] = {}
    waiting: list = []
    if submit:
        ex = _executor(opts, name)
        fns = [RunJob(train, exp_path, job, list(extra), opts.cpus_per_run) for job in submit]
        # submitit's local cluster has no arrays (every job starts at once): --array-parallelism runs it in waves.
        size = opts.array_parallelism if cluster == "local" and opts.array_parallelism else len(fns)
        for i in range(0, len(fns), size):
            wave = ex.submit_array(fns[i:i + size])
            records = _read_jobs(opts)
            for job, h in zip(submit[i:i + size], wave):
                handles[job.label] = h
                records[job.label] = {"job_id": str(h.job_id), "cluster": cluster}
            _jobs_file(opts).parent.mkdir(parents=True, exist_ok=True)  # the debug cluster makes no folder
            atomic_write_text(_jobs_file(opts), json.dumps(records, indent=1) + "\n")
            if cluster == "debug":  # a debug job runs in this process when its result is asked for
                for h in wave:
                    try:
                        h.result()
                    except Exception:  # noqa: BLE001 - reported below, from result.json and the job's record
                        pass
                    bar.update(1)
            elif i + size < len(fns):  # the next wave starts when this one has ended
                _wait(wave, bar)
            else:
                waiting += wave
    for label, record in live.items():
        h = submitit.SlurmJob(Path(opts.folder), record["job_id"]) if record["cluster"] == "slurm" else \
            _Attached(record, opts)
        handles[label] = h
        waiting.append(h)
    _wait(waiting, bar)
    return _collect(todo, handles, result_of)


def _collect(todo: list, handles: dict[str, Any], result_of: ResultFn) -> list[dict[str, Any]]:
    """The result records of the runs; a LaunchError naming every run that has none (its job, why, its log)."""
    results, failed = [], []
    for job in todo:
        res = result_of(job.rdir)
        if res is not None:
            results.append(res)
            continue
        h = handles.get(job.label)
        why = ""
        if hasattr(h, "exception"):
            try:
                err = h.exception()
            except Exception as e:  # noqa: BLE001 - the job left no record of its own
                err = e
            lines = [ln.strip() for ln in str(err or "").splitlines() if ln.strip()]
            why = f": {lines[-1][:200]}" if lines else ""
        failed.append(f"{job.label} (job {getattr(h, 'job_id', '?')}{why}; log {_log_hint(h)})")
    if failed:
        raise LaunchError(f"{len(failed)} of {len(todo)} runs did not finish under submitit: {'; '.join(failed[:3])}"
                          f"{' ...' if len(failed) > 3 else ''}; re-run the same command to submit them again (each "
                          "resumes from its last checkpoint)")
    return results


def _wait(jobs: list, bar: tqdm, poll_s: float = 0.5) -> None:
    """Poll until every job is done, moving the bar as they end."""
    left = list(jobs)
    while left:
        for h in [h for h in left if h.done()]:
            left.remove(h)
            bar.update(1)
        if left:
            time.sleep(poll_s)


# The launchers (`--launcher`): (todo, train, result_of, experiment file, extra overrides, workers, options, bar,
# experiment name) -> the result records of the runs trained.
LAUNCHERS: Registry[Callable[..., list[dict[str, Any]]]] = Registry("launcher")
LAUNCHERS.add("local", launch_local)
LAUNCHERS.add("submitit", launch_submitit)

# submitit's clusters (`--cluster`, with --launcher submitit): what each is, for the help text.
CLUSTERS: Registry[str] = Registry("cluster")
CLUSTERS.add("slurm", "sbatch job arrays, from a Slurm login node")
CLUSTERS.add("local", "the jobs as subprocesses of this command (to try the launcher out)")
CLUSTERS.add("debug", "the jobs in this process, one after another")
