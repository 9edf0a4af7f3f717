"""Experiment trackers (`diagnostics.trackers`): TensorBoard, Weights & Biases and MLflow mirrors of metrics.jsonl.

metrics.jsonl is the run's record; a tracker only mirrors it. `MetricsLog` (rank 0) feeds every tracker of the run
through one small interface, `Tracker`: every finite number of every record (`log_scalars`; a key with a section
such as `grad/total` keeps its name, a bare one such as `loss` becomes `train/loss`), the sample grids and curves.png
(`log_image`), the resolved config (`log_config`) and, for `compare` and `lr-range`, the report (`log_artifact`).
Each kind is imported only when a run names it, from an optional extra: [tb], [wandb], [mlflow].

Resume-safe: the W&B run id and the MLflow run id are kept in RUN/trackers.json, so a resumed or requeued run goes on
in the same tracker run; W&B writes its files under RUN/wandb. `compare` names the runs (`runner.tracker_overrides`):
W&B group and MLflow experiment = the experiment, W&B job type and MLflow tag `arm` = the arm, name = arm/seed-S.

Failures: a missing package is a one-line ConfigError before the first step, naming the extra. Anything else (no
server, no login, a call failing mid-run) switches that tracker off with one warning line naming the fix; training
goes on and metrics.jsonl keeps every record.

Connections: W&B follows WANDB_MODE (offline: `wandb sync RUN/wandb/offline-run-*` later), WANDB_API_KEY or `wandb
login`; MLflow follows MLFLOW_TRACKING_URI (a server, or a local file store `file:/path`, which MLflow 3 allows only
with MLFLOW_ALLOW_FILE_STORE=true; mlflow-skinny has no SQL store).
"""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, flatten_dict
from ..utils.errors import ConfigError
from ..utils.io import atomic_write_text
from ..utils.registry import Registry

FILE = "trackers.json"  # RUN/trackers.json: {kind: {"id": ...}} so that a resumed run continues its tracker run


def scalar_name(key: str) -> str:
    """The tracker name of a metrics.jsonl key: `grad/total` as it is, `loss` as `train/loss` (one section each)."""
    return key if "/" in key else f"train/{key}"


def tracker_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record a tracker gets: every finite int or float but the step."""
    return {scalar_name(k): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


@dataclass(frozen=True)
class TrackerRun:
    """Who a tracker run is and where its files live: `dir` holds trackers.json (and W&B's files); `config` is
    logged once the tracker starts."""

    dir: Path
    name: str
    project: str = "steadydiff"
    group: str | None = None
    job: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] | None = None

    @classmethod
    def of(cls, run_dir: str | Path, cfg: Config) -> TrackerRun:
        d, run_dir = cfg.diagnostics, Path(run_dir)
        tags = {"seed": str(cfg.train.seed), **({"arm": d.tracker_job} if d.tracker_job else {})}
        return cls(run_dir, d.tracker_name or run_dir.resolve().name, d.tracker_project, d.tracker_group,
                   d.tracker_job, tags, cfg.to_dict())


def read_ids(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """RUN/trackers.json ({} when there is none, or when it is damaged: a new tracker run is then started)."""
    path = Path(run_dir) / FILE
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def store_ids(run_dir: str | Path, kind: str, ids: dict[str, Any]) -> None:
    data = read_ids(run_dir)
    data[kind] = ids
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / FILE, json.dumps(data, indent=1) + "\n")


class Tracker:
    """One tracker run. A kind implements what it can; the rest does nothing (TensorBoard keeps no artefacts)."""

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        pass

    def log_image(self, step: int, name: str, path: Path) -> None:
        pass

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def log_artifact(self, path: Path) -> None:
        pass

    def close(self, status: str = "finished") -> None:
        """End the run: status `finished`, `interrupted` (a stop signal: the run continues later) or `failed`."""


def _missing(kind: str, package: str, install: str) -> ConfigError:
    return ConfigError(f"diagnostics.trackers: {kind} needs the {package} package: {install} (or take {kind} out of "
                       "diagnostics.trackers)")


class TensorBoardTracker(Tracker):
    """Event files in RUN/tb (`tensorboard --logdir RUN/tb`)."""

    fix = "check that RUN/tb is writable"

    @staticmethod
    def load():
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError("diagnostics.trackers: tensorboard needs the tensorboard package: pip install "
                              "tensorboard (the [tb] extra), or take it out of diagnostics.trackers (and set "
                              "diagnostics.tensorboard=false)") from e
        return SummaryWriter

    def __init__(self, run: TrackerRun, SummaryWriter):
        self.writer = SummaryWriter(str(run.dir / "tb"))

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        for key, v in values.items():
            self.writer.add_scalar(key, v, step)

    def log_image(self, step: int, name: str, path: Path) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as im:
            self.writer.add_image(name, np.asarray(im.convert("RGB")), step, dataformats="HWC")

    def log_config(self, config: dict[str, Any]) -> None:
        import yaml

        # Indented: TensorBoard's text panel renders Markdown, where that is a code block.
        text = "".join("    " + ln + "\n" for ln in yaml.safe_dump(config, sort_keys=False).splitlines())
        self.writer.add_text("config", text, 0)

    def close(self, status: str = "finished") -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run (its files in RUN/wandb), resumed by the id kept in RUN/trackers.json."""

    fix = "run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline and `wandb sync` RUN/wandb later"

    @staticmethod
    def load():
        try:
            import wandb
        except ImportError as e:
            raise _missing("wandb", "wandb", "pip install 'steadydiff[wandb]'") from e
        return wandb

    def __init__(self, run: TrackerRun, wandb):
        self.wandb, self.name = wandb, run.name
        ids = read_ids(run.dir).get("wandb", {})
        run_id = ids.get("id") or secrets.token_hex(8)
        # Stored before the run starts: a job killed during wandb.init still comes back as this run.
        store_ids(run.dir, "wandb", {"id": run_id, "project": run.project})
        # console="off": W&B would wrap stdout and stderr; steadydiff's own lines stay as they are.
        self.run = wandb.init(id=run_id, resume="allow", project=run.project, group=run.group, job_type=run.job,
                              name=run.name, dir=str(run.dir), tags=[f"{k}={v}" for k, v in run.tags.items()],
                              settings=wandb.Settings(console="off"))

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_image(self, step: int, name: str, path: Path) -> None:
        self.run.log({name: self.wandb.Image(str(path))}, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)  # resumable fields may change on resume

    def log_artifact(self, path: Path) -> None:
        name = "".join(c if c.isalnum() or c in "-_." else "-" for c in f"{self.name}-{Path(path).stem}")
        art = self.wandb.Artifact(name, type="report")
        art.add_file(str(path))
        self.run.log_artifact(art)

    def close(self, status: str = "finished") -> None:
        if status == "interrupted":
            self.run.mark_preempting()  # shown as preempted: the requeued job resumes this run
        self.run.finish(exit_code=0 if status != "failed" else 1)


class MlflowTracker(Tracker):
    """An MLflow run in the experiment named by the run's group (else its project), tagged arm and seed; its id
    is kept in RUN/trackers.json with the tracking URI."""

    fix = ("set MLFLOW_TRACKING_URI to a reachable server (http://host:5000), or to a local file store (file:/path, "
           "with MLFLOW_ALLOW_FILE_STORE=true)")
    STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}

    @staticmethod
    def load():
        try:
            import mlflow
        except ImportError as e:
            raise _missing("mlflow", "mlflow-skinny (or mlflow)", "pip install 'steadydiff[mlflow]'") from e
        return mlflow

    def __init__(self, run: TrackerRun, mlflow):
        from mlflow.entities import Param

        self.client = mlflow.MlflowClient()
        uri = mlflow.get_tracking_uri()
        ids = read_ids(run.dir).get("mlflow", {})
        self.run_id = ids.get("run_id") if ids.get("tracking_uri") == uri else None
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = run.group or run.project
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                eid = self.client.create_experiment(experiment)
            except Exception:  # noqa: BLE001 - another run of the experiment created it first
                eid = self.client.get_experiment_by_name(experiment).experiment_id
        else:
            eid = exp.experiment_id
        self.run_id = self.client.create_run(eid, run_name=run.name, tags={**run.tags, "run_dir": str(run.dir)}
                                             ).info.run_id
        store_ids(run.dir, "mlflow", {"run_id": self.run_id, "experiment_id": eid, "tracking_uri": uri})
        # Params once, at the run's creation: MLflow refuses a changed param, and resumable fields may change.
        params = [Param(k, str(v)[:6000]) for k, v in flatten_dict(run.config or {}).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_image(self, step: int, name: str, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=name)

    def log_config(self, config: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, config, "config.json")

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str = "finished") -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS[status])


# The tracker kinds (`diagnostics.trackers`): a class with `load()` (import its package, or a one-line
# ConfigError naming the extra), a constructor (run, package), the Tracker methods and `fix` (what to do when it
# fails).
TRACKERS: Registry[type] = Registry("tracker", key="diagnostics.trackers")
TRACKERS.add("tensorboard", TensorBoardTracker)
TRACKERS.add("wandb", WandbTracker)
TRACKERS.add("mlflow", MlflowTracker)


def _warn(text: str) -> None:
    print(f"steadydiff: warning: {text}", file=sys.stderr, flush=True)


def _reason(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


class Trackers:
    """The trackers of one run, fed together. A tracker that fails (to start, or later) is switched off with one
    warning line naming the fix; the others and training go on. `open()` raises only for a missing package."""

    def __init__(self, kinds: Sequence[str], run: TrackerRun, warn: Callable[[str], None] = _warn):
        self.kinds, self.run, self.warn = list(kinds), run, warn
        self.active: dict[str, Tracker] = {}

    def open(self) -> Trackers:
        # Every package first: a missing one is refused before any tracker run starts.
        loaded = {kind: TRACKERS.choose(kind, "diagnostics.trackers").load() for kind in self.kinds}
        for kind, package in loaded.items():
            try:
                self.active[kind] = TRACKERS[kind](self.run, package)
            except Exception as e:  # noqa: BLE001 - no server, no login: training goes on without this tracker
                self._off(kind, e, "could not start")
        if self.run.config is not None:
            self.call("log_config", self.run.config)
        return self

    def call(self, method: str, *args: Any) -> None:
        for kind, tracker in list(self.active.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                self._off(kind, e, "stopped")

    def log_image(self, step: int, name: str, path: Path) -> None:
        if Path(path).is_file():  # curves.png and sample grids are only drawn when their plots are on
            self.call("log_image", step, name, Path(path))

    def close(self, status: str = "finished") -> None:
        self.call("close", status)
        self.active.clear()

    def _off(self, kind: str, e: BaseException, what: str) -> None:
        tracker = self.active.pop(kind, None)
        if tracker is not None and what == "stopped":
            try:
                tracker.close("failed")
            except Exception:  # noqa: BLE001 - it is already failing; metrics.jsonl has the record
                pass
        self.warn(f"{kind} tracker {what} ({_reason(e)}); {TRACKERS[kind].fix}; training goes on and "
                  f"{self.run.dir}/metrics.jsonl keeps every record")


def publish(kinds: Sequence[str], run: TrackerRun, files: Sequence[str | Path]) -> None:
    """Log an experiment's report files as artefacts of one tracker run (`compare`, `lr-range`); TensorBoard, which
    keeps no artefacts, is left out. Any failure is a warning: the report is written either way."""
    kinds = [k for k in kinds if k != "tensorboard"]
    if not kinds:
        return
    try:
        trackers = Trackers(kinds, run).open()
    except ConfigError as e:
        _warn(f"the report is not sent to the trackers: {e}")
        return
    for path in files:
        if Path(path).is_file():
            trackers.call("log_artifact", Path(path))
    trackers.close()
