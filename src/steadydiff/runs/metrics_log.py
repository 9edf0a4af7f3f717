"""`RUN_DIR/metrics.jsonl`: one JSON record per line, appended by the trainer (rank 0), read by
diagnostics, experiments and plots. A record always has `step`; a line torn by a crash mid-write is
dropped on reading, and a resumed run first cuts the log back to its checkpoint (`truncate_after`), so every
step is logged exactly once. The run's trackers (`trackers.py`) mirror it; the file stays the record."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import Config
from ..utils.io import atomic_write, atomic_write_text
from .trackers import TrackerRun, Trackers, tracker_scalars

FILE = "metrics.jsonl"


def parse_line(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl record, or None for a blank line or one torn by a crash mid-write."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every readable record of `run_dir/metrics.jsonl`, in order ([] when there is no log)."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    rows = (parse_line(ln) for ln in path.read_text().splitlines())
    return [r for r in rows if r is not None]


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the records that have a finite value for it."""
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def truncate_after(run_dir: str | Path, step: int) -> None:
    """Drop records written after `step` (a resumed run writes them again), and a torn last line."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return
    text = path.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if (rec := parse_line(ln)) is not None and rec.get("step", 0) <= step]
    # A process killed mid-write leaves a torn last line (or one without its newline, which the next
    # append would glue onto): rewrite the file whenever it is not exactly the lines we keep.
    if len(keep) != len(lines) or (text and not text.endswith("\n")):
        atomic_write_text(path, "".join(ln + "\n" for ln in keep))


class MetricsLog:
    """Appends records to `run_dir/metrics.jsonl` (`enabled=False`, on ranks other than 0: writes nothing) and feeds
    the run's trackers (`trackers.py`: TensorBoard, W&B, MLflow; `tensorboard=True` is the old switch for the
    first) with every record's numbers, images and the config. Use as a context manager; `sync()` makes every record
    so far durable (before a checkpoint that makes them final). `for_run` builds it from a run's config."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = False,
                 trackers: Sequence[str] = (), run: TrackerRun | None = None):
        self.path = Path(run_dir) / FILE
        self.enabled = enabled
        kinds = [*trackers, *(["tensorboard"] if tensorboard and "tensorboard" not in trackers else [])]
        run = run or TrackerRun(Path(run_dir), Path(run_dir).resolve().name)
        self.trackers = Trackers(kinds, run) if enabled and kinds else None
        self._file = None
        self._status = "failed"  # unless the block ends normally, or `interrupted()` says a signal ended it

    @classmethod
    def for_run(cls, run_dir: str | Path, cfg: Config, enabled: bool = True) -> MetricsLog:
        """The log of a training run: its trackers (`diagnostics.trackers`, named as the config says)."""
        return cls(run_dir, enabled, trackers=cfg.diagnostics.tracker_kinds(), run=TrackerRun.of(run_dir, cfg))

    def __enter__(self) -> MetricsLog:
        if self.trackers is not None:
            self.trackers.open()  # a missing package: a ConfigError before anything is written
        if self.enabled:
            self._file = open(self.path, "a")
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.trackers is not None:
            self.trackers.close("finished" if exc_type is None else self._status)

    def interrupted(self) -> None:
        """A stop signal ends the run here (it continues when re-run): trackers mark it interrupted, not failed."""
        self._status = "interrupted"

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` (it has a `step`); its numbers also go to the trackers at that step."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            values = tracker_scalars(record)
            if values:
                self.trackers.call("log_scalars", record["step"], values)

    def log_image(self, step: int, name: str, path: str | Path) -> None:
        """An image the run wrote (a sample grid, curves.png) to the trackers; nothing when the file is absent."""
        if self.trackers is not None:
            self.trackers.log_image(step, name, Path(path))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())


def plot_curves(run_dir: str | Path, out_path: str | Path | None = None) -> None:
    """Loss, gradient norm and learning rate against step, from metrics.jsonl, into `curves.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(run_dir) if r.get("loss") is not None]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2), dpi=100)
    for ax, key, log in zip(axes, ("loss", "grad_norm", "lr"), (True, True, False)):
        ax.plot(steps, [r[key] for r in rows], lw=1)
        ax.set_title(key)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(out_path or Path(run_dir) / "curves.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)
