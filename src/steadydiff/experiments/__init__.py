"""Experiments: arms x seeds, paired statistics honest at small n, verdicts, pre-registration, calibration
and reports (`steadydiff compare`), and LR ranges over a grid of learning rates (`steadydiff lr-range`)."""

from .analysis import ExperimentError, analyse, judge_claims, rerender
from .calibrate import run_calibration
from .prereg import claim_status, record
from .report import plot_experiment, write_markdown
from .runner import run_dir, run_experiment
from .spec import Claim, Experiment, load_experiment
from .speedup import fill_diverged, steps_to_target, time_shift

__all__ = [
    "Claim", "Experiment", "ExperimentError", "analyse", "claim_status", "fill_diverged", "judge_claims",
    "load_experiment", "plot_experiment", "record", "rerender", "run_calibration", "run_dir", "run_experiment",
    "steps_to_target", "time_shift", "write_markdown",
]
