"""Experiments: arms x seeds, speed-ups with confidence intervals, stability, verdicts (`steadydiff compare`)."""

from .analysis import ExperimentError, analyse
from .report import plot_experiment, write_markdown
from .runner import run_dir, run_experiment
from .spec import Claim, Experiment, load_experiment
from .speedup import fill_diverged, speedup_ci, steps_to_target, verdict

__all__ = [
    "Claim", "Experiment", "ExperimentError", "analyse", "fill_diverged", "load_experiment", "plot_experiment",
    "run_dir", "run_experiment", "speedup_ci", "steps_to_target", "verdict", "write_markdown",
]
