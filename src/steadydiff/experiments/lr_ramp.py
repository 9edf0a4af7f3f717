"""`steadydiff lr-range` with `lr_range: {mode: ramp}`: Smith's range test, to place a grid quickly.

One run per (arm, seed), `OUT/runs/<arm>/ramp/seed-<s>/`, trains with the LR rising exponentially from the
file's first LR to its last (`train/schedules.py` `exp_ramp`, no warm-up) and is scored on its validation set
every `diagnostics.val_every` steps. `lr_rule.judge_ramp` finds each ramp's edge, max stable LR and best LR;
`lr_rule.suggest_grid` proposes the half-decade grid that brackets them all. A ramp makes no claims (its LR
and its training time rise together): the claims belong to the grid it places.

Outputs, like the grid's: `lr_range.json` (per arm and seed the ramp's verdict and its validation curve
against the LR), `lr_range.png` (validation and training loss against the LR, edges marked) and `lr_range.md`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ..runs import saved_sample_shape
from ..runs.metrics_log import read_metrics, series
from ..utils.io import atomic_write, atomic_write_text
from .analysis import ExperimentError, machine_info
from .lr_rule import judge_ramp, ramp_lr, suggest_grid
from .prereg import claim_status
from .regime import regime, tied_horizons
from .report import _f, _regime_lines
from .runner import Job, read_run_result
from .spec import Experiment


def ramp_dir(out: Path, arm: str, seed: int) -> Path:
    """The run directory of (arm, seed)'s ramp."""
    return Path(out) / "runs" / arm / "ramp" / f"seed-{seed}"


def ramp_overrides(lrs: tuple[float, ...]) -> tuple[str, ...]:
    """What makes a run a ramp from lrs[0] to lrs[-1]: the start LR, the schedule and its end, no warm-up."""
    return (f"train.lr={lrs[0]!r}", "train.lr_schedule=exp_ramp", f"train.lr_ramp_end={lrs[-1]!r}",
            "train.warmup_steps=0")


def ramp_jobs(exp: Experiment, out: Path) -> list[Job]:
    """Every (arm, seed) ramp, as runner jobs."""
    over = ramp_overrides(exp.lr_range.lrs)
    return [Job(arm, s, ramp_dir(out, arm, s), over) for arm in exp.arms for s in exp.seeds]


def analyse_ramp(exp: Experiment, out: Path, extra: list[str] | None = None, command: str = "",
                 report_command: str = "") -> dict[str, Any]:
    """Everything the ramp's lr_range.json, .md and .png show, as one JSON-able dict."""
    out, extra = Path(out), list(extra or [])
    lrs, rule = exp.lr_range.lrs, exp.lr_range.rule
    jobs = ramp_jobs(exp, out)
    results = {(j.arm, j.seed): read_run_result(j.rdir) for j in jobs}
    missing = [f"{a}/ramp/seed-{s}" for (a, s), r in results.items() if r is None]
    if missing:
        raise ExperimentError(f"{len(missing)} of {len(results)} ramps have not finished ({', '.join(missing[:3])}"
                              f"{'...' if len(missing) > 3 else ''}); run `steadydiff lr-range` without --report-only "
                              "to train them")
    over = list(ramp_overrides(lrs))
    arms: dict[str, Any] = {}
    for arm in exp.arms:
        seeds: dict[str, Any] = {}
        for s in exp.seeds:
            steps = exp.run_config(arm, s, [*extra, *over]).train.steps
            rows, result = read_metrics(ramp_dir(out, arm, s)), results[arm, s]
            vs, val = series(rows, exp.metric)
            ls, loss = series(rows, rule.spike_key) if rule.spike_key else ([], [])
            # A validation point at step s has seen the updates of steps 0..s-1: it is read at the LR of step s-1.
            at = [ramp_lr(lrs[0], lrs[-1], steps, max(0, st - 1)) for st in vs]
            diverged_at = result.get("diverged_at") if result["status"] != "ok" else None
            if result["status"] != "ok" and diverged_at is None:
                diverged_at = int(vs[-1]) + 1 if vs else 0
            v = judge_ramp(vs, val, at, rule, diverged_at=diverged_at, loss_steps=ls, loss=loss, top_lr=lrs[-1])
            seeds[str(s)] = {
                "max_stable_lr": v.max_stable_lr, "max_stable_lr_bound": v.bound, "best_lr": v.best_lr,
                "best_final": v.best_val, "edge_step": v.edge_step, "reason": v.reason,
                "edge_lr": None if v.edge_step is None else ramp_lr(lrs[0], lrs[-1], steps, max(0, v.edge_step - 1)),
                "curve": {"step": [int(x) for x in vs], "lr": at, "val": [float(x) for x in val]},
                "loss_curve": {"lr": [ramp_lr(lrs[0], lrs[-1], steps, max(0, st - 1)) for st in ls],
                               "loss": [float(x) for x in loss]},
            }
        per = [seeds[str(s)] for s in exp.seeds]
        arms[arm] = {
            "overrides": exp.arms[arm], "seeds": seeds,
            "max_stable_lr_per_seed": [p["max_stable_lr"] for p in per],
            "max_stable_lr_bounds": [p["max_stable_lr_bound"] for p in per],
            "best_lr_per_seed": [p["best_lr"] for p in per],
            "horizons_tied": tied_horizons(exp.run_config(arm, exp.seeds[0], [*extra, *over])),
        }
    cfg = exp.run_config(exp.baseline, exp.seeds[0], [*extra, *over])
    every = [x for a in arms.values() for x in a["seeds"].values()]
    rep: dict[str, Any] = {
        "experiment": exp.name, "description": exp.description, "source": str(exp.source), "command": command,
        "report_command": report_command, "metric": exp.metric, "lower_is_better": exp.lower_is_better,
        "baseline": exp.baseline, "seeds": exp.seeds, "lrs": list(lrs),
        "rule": {**rule.as_dict(), "mode": "ramp"}, "config": cfg.to_dict(), "arms": arms,
        "suggested_grid": suggest_grid([x["best_lr"] for x in every], [x["max_stable_lr"] for x in every]),
        "regime": _ramp_regime(exp, out, cfg), "paper": exp.paper, "registration": claim_status(exp, out),
        "machine": machine_info(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s_total": float(sum(r.get("wall_s", 0.0) for r in results.values())), "claims": [],
    }
    return rep


def _ramp_regime(exp: Experiment, out: Path, cfg) -> dict[str, Any]:
    shape = saved_sample_shape(ramp_dir(out, exp.baseline, exp.seeds[0]))
    if shape is None:
        from ..data import load_dataset

        shape = load_dataset(cfg.data).sample_shape
    reg = regime(cfg, shape)
    reg["lr"] = f"ramp {exp.lr_range.lrs[0]:g} -> {exp.lr_range.lrs[-1]:g} (exponential)"
    return reg


def _lr_text(value: Any, bound: str, first: float | None) -> str:
    if value is None:
        return "<= " + (f"{first:.3g}" if first is not None else "the first point") + " (edge before any point)"
    return f"{bound + ' ' if bound else ''}{float(value):.3g}" + (" (censored: the ramp's top)" if bound == ">="
                                                                   else "")


def provenance_lines(rep: dict[str, Any]) -> list[str]:
    """The lines every lr_range.md opens with: command, report command, file, machine, date and wall time."""
    m = rep["machine"]
    return [
        f"- Command: `{rep['command']}`" if rep["command"] else "",
        f"- Report regenerated from the finished runs by: `{rep['report_command']}`" if rep.get("report_command")
        else "",
        f"- Experiment file: `{rep['source']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores{', ' + m['gpu'] if 'gpu' in m else ''}; torch {m['torch']}",
        f"- Date: {rep['date']}; training wall time, all runs: {rep['wall_s_total'] / 60:.1f} min",
    ]


def write_ramp_markdown(rep: dict[str, Any], out: Path) -> str:
    """lr_range.md of a ramp: the rule, per arm and seed the edge, max stable and best LR, the suggested grid."""
    lrs, rule = rep["lrs"], rep["rule"]
    lines = [
        f"# LR range test (ramp): {rep['experiment']}", "", rep["description"].strip(), "",
        *provenance_lines(rep),
        f"- Ramp (Smith 2017): one run per arm and seed, the LR rising exponentially from {lrs[0]:g} to {lrs[-1]:g} "
        f"over the run, no warm-up; `{rep['metric']}` on the run's fixed validation set at each scored step, read "
        "at the LR of the step before it.",
        f"- Edge (pre-registered with the file): the first of a divergence, a validation point above "
        f"{rule['factor']:g}x the lowest before it, or a training-loss point above {rule['k']:g}x the trailing "
        f"median of its {rule['window']} predecessors. Max stable LR: the last validation point before the edge; "
        "best LR: the lowest validation point before it.",
        "- A ramp places a grid; it tests nothing: a later point has both a larger LR and more training behind it, "
        "so its numbers are not the grid's max stable LR and carry no claims.",
    ]
    lines += _regime_lines(rep)
    lines += ["", "## Per arm and seed", "", "| arm | seed | max stable LR | best LR | lowest validation loss | "
              "edge |", "|---|---|---|---|---|---|"]
    for name, a in rep["arms"].items():
        for s, x in a["seeds"].items():
            first = x["curve"]["lr"][0] if x["curve"]["lr"] else None
            lines.append(f"| {name} | {s} | {_lr_text(x['max_stable_lr'], x['max_stable_lr_bound'], first)} | "
                         f"{_f(x['best_lr'], 3)} | {_f(x['best_final'], 4)} | {x['reason']} |")
    grid = rep["suggested_grid"]
    lines += ["", "## Next", "",
              ("Suggested grid (half-decade points from the smallest best LR to the first above the largest max "
               f"stable LR): `lrs: [{', '.join(f'{x:g}' for x in grid)}]`. Put it in the grid experiment's file, with "
               "its claims, and commit that before its runs.") if grid else
              "No suggested grid: no ramp had a stable point. Start the ramp lower.",
              "", "## Plot", "", "![validation and training loss against the ramp's LR](lr_range.png)", ""]
    text = "\n".join(ln for ln in lines if ln is not None) + "\n"
    atomic_write_text(Path(out) / "lr_range.md", text)
    return text


def plot_ramp(rep: dict[str, Any], out: Path) -> None:
    """lr_range.png of a ramp: validation loss and training loss against the LR, one line per seed, each
    ramp's edge marked with a cross."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), dpi=100)
    for i, (name, a) in enumerate(rep["arms"].items()):
        color = f"C{i % 10}"
        for j, x in enumerate(a["seeds"].values()):
            c = x["curve"]
            val = np.asarray(c["val"], dtype=np.float64)
            ok = np.isfinite(val)
            axes[0].plot(np.asarray(c["lr"])[ok], val[ok], color=color, lw=1, alpha=0.8,
                         label=name if j == 0 else None)
            if x["max_stable_lr"] is not None and x["edge_step"] is not None:
                k = c["lr"].index(x["max_stable_lr"])
                axes[0].scatter([c["lr"][k]], [c["val"][k]], color=color, marker="x", s=50)
            lc = x["loss_curve"]
            loss = np.asarray(lc["loss"], dtype=np.float64)
            ok = np.isfinite(loss)
            axes[1].plot(np.asarray(lc["lr"])[ok], loss[ok], color=color, lw=0.8, alpha=0.7,
                         label=name if j == 0 else None)
    lrs = rep["lrs"]
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lrs[0] / 1.2, lrs[-1] * 1.2)
        ax.set_xlabel("learning rate (ramp)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel(rep["metric"])
    axes[0].set_title("validation loss along the ramp\n(x: max stable LR, the last point before the edge)",
                      fontsize=10)
    axes[1].set_ylabel("training loss")
    axes[1].set_title("training loss along the ramp", fontsize=10)
    fig.tight_layout()
    atomic_write(Path(out) / "lr_range.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)


def ramp_summary_lines(rep: dict[str, Any]) -> list[str]:
    """One line per arm for the terminal, and the suggested grid."""
    lines = [f"{name}: max stable LR " + ", ".join(_lr_text(x["max_stable_lr"], x["max_stable_lr_bound"], None)
                                                   .split(" (")[0] for x in a["seeds"].values())
             + "; best LR " + ", ".join(_f(x["best_lr"], 3) for x in a["seeds"].values())
             for name, a in rep["arms"].items()]
    grid = rep["suggested_grid"]
    return lines + ([f"suggested grid: [{', '.join(f'{x:g}' for x in grid)}]"] if grid else [])

