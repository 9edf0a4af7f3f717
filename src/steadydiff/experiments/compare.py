"""`steadydiff compare`: the whole flow of one experiment, from its file to results.json and report.md.

Train the arms x seeds that are not finished (recording the design and claims first, so that later claim
changes are marked post hoc), optionally calibrate the metric's noise, analyse, plot, and write the report.
With `report_only` nothing trains: the finished runs are analysed again, or, when the runs are gone, the
claims are re-judged from the stored results.json.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..runs.trackers import TrackerRun, publish
from ..utils.errors import ConfigError
from ..utils.io import atomic_write_text
from .analysis import analyse, rerender
from .calibrate import run_calibration
from .launch import LaunchOptions, check_options, plan_lines
from .prereg import FILE as PREREG_FILE
from .prereg import record
from .report import plot_experiment, write_markdown
from .runner import experiment_jobs, run_experiment, unfinished
from .spec import Experiment, calibrated_metrics, load_experiment

COMMAND_FILE = "command.txt"  # the command that trained the runs, quoted by reports regenerated later


def launch_options(exp: Experiment, out: Path, overrides: list[str], launch: LaunchOptions | None,
                   extra_runs: list[list[str]] | None = None) -> LaunchOptions:
    """The launcher options checked against the experiment's run configs (one per arm, `extra_runs` adding
    overrides such as an LR of the grid), with submitit's folder OUT/submitit."""
    launch = launch or LaunchOptions()
    # Only --gpus-per-run needs the configs (their train.device): a plain --report-only loads none.
    configs = [exp.run_config(arm, exp.seeds[0], [*overrides, *more]) for arm in exp.arms
               for more in (extra_runs or [[]])] if launch.gpus_per_run else []
    check_options(launch, configs)
    return dataclasses.replace(launch, folder=launch.folder or out / "submitit")


def publish_report(exp: Experiment, out: Path, overrides: list[str], files: list[Path]) -> None:
    """Send the report's files to the trackers the runs use (`runs/trackers.py`), as artefacts of one tracker run
    of the experiment: W&B group = the experiment, job type `report`; MLflow run `NAME/report` in the experiment.
    Its ids are kept in OUT/trackers.json, so a later report goes to the same run."""
    d = exp.run_config(exp.baseline, exp.seeds[0], overrides).diagnostics
    if d.tracker_kinds():
        publish(d.tracker_kinds(), TrackerRun(Path(out), f"{exp.name}/report", d.tracker_project, exp.name, "report",
                                              {"experiment": exp.name}), files)


def compare(experiment: str | Path, out: str | Path, overrides: list[str], argv: list[str], *,
            workers: int | None = None, report_only: bool = False, calibrate: bool = False,
            show_progress: bool = True, say: Callable[[str], Any] = print,
            launch: LaunchOptions | None = None) -> dict[str, Any] | None:
    """Run `steadydiff compare` with these arguments (`argv`: the command line after `steadydiff`, quoted in
    the report); returns the analysed report (its `claims` hold the verdicts). `say` gets progress lines.
    `launch`: where the runs train (`launch.py`); with its `dry_run`, says what would be submitted, writes and
    submits nothing, and returns None."""
    # Before training, a claim that no outcome could make hold is refused; finished runs are judged as they are.
    exp = load_experiment(experiment, overrides, strict=not report_only)
    if exp.lr_range is not None:
        raise ConfigError(f"experiment {experiment} has an lr_range: block; run it with `steadydiff lr-range` (or "
                          "drop the block to compare the arms at the base config's train.lr)")
    if calibrate:
        calibrated_metrics(exp)  # before training, not after
    out = Path(out)
    launch = launch_options(exp, out, overrides, launch)
    if launch.dry_run:
        for line in plan_lines(unfinished(experiment_jobs(exp, out)), launch, exp.name):
            say(line)
        return None
    command = "steadydiff " + " ".join(shlex.quote(a) for a in argv)
    ran_by = out / COMMAND_FILE
    report_command = ""
    if not report_only:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(ran_by, command + "\n")
        if record(exp, out):  # before anything trains: later claim changes are marked post hoc
            say(f"recorded the design and {len(exp.claims)} claims in {out}/preregistration.json")
        elif not (out / PREREG_FILE).exists():
            say(f"{out} already holds runs and no preregistration.json: the claims are 'not recorded' (register "
                "claims by running a new experiment into an empty --out)")
        run_experiment(exp, out, overrides, workers=workers, show_progress=show_progress, launch=launch)
    elif ran_by.is_file():
        command, report_command = ran_by.read_text().strip(), command
    if report_only and not (out / "runs").is_dir():
        rep = rerender(exp, out, report_command=report_command or command)
        say("re-judged the claims from the stored results.json (the runs are not here)")
    else:
        if calibrate:
            run_calibration(exp, out)
        rep = analyse(exp, out, command=command, report_command=report_command)
        plot_experiment(exp, rep, out)
    write_markdown(rep, out)
    publish_report(exp, out, overrides, [out / "report.md", out / "results.json", *sorted(out.glob("*.png"))])
    return rep
