"""`steadydiff lr-range`: the flow of an LR-range experiment, from its file to lr_range.json, .png and .md.

An experiment file with an `lr_range:` block (`lr_rule.py`: the grid, the instability rule, the LR
sensitivity) trains every arm x LR x seed as an ordinary resumable run, `OUT/runs/<arm>/lr-<lr>/seed-<s>/`
(`lr_rule.lr_tag`), with the runner `compare` uses: a finished run (with result.json) is never trained again,
an unfinished one resumes. The design, grid, rule and claims are recorded before anything trains (`prereg.py`).
Each run is then judged by the rule, and per arm and seed come the max stable LR (censored at the grid's
ends), the best LR and its final validation loss, and the LR sensitivity; the claims (`max_stable_lr`,
`best_final`: `claims.py`) are judged by the engine of `compare` (`analysis.judge_claims`).

Outputs: `lr_range.json` ({"arms": {ARM: {"seeds": {SEED: {"max_stable_lr", "best_lr", "final": {LR: value},
...}}}}, "config": the resolved base config, "rule": ...}), `lr_range.png` (final validation loss against LR
per arm, and the gradient-norm spike fraction) and `lr_range.md` (the tables, the regime beside the paper's,
the verdicts). With `report_only` nothing trains: the finished runs are judged again. `mode: ramp` (Smith's
range test, one run per arm and seed with a rising LR) is the same flow with `lr_ramp.py`'s jobs and outputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ..diagnostics.stats import spike_fraction
from ..runs import saved_sample_shape
from ..runs.metrics_log import read_metrics, series
from ..utils.errors import ConfigError
from ..utils.io import atomic_write, atomic_write_text, read_json
from .analysis import ExperimentError, _json_safe, judge_claims, machine_info
from .compare import COMMAND_FILE, launch_options, publish_report
from .launch import LaunchOptions, plan_lines
from .lr_ramp import analyse_ramp, plot_ramp, provenance_lines, ramp_jobs, ramp_summary_lines, write_ramp_markdown
from .lr_rule import RunOutcome, best_lr, judge_grid, lr_sensitivity, lr_tag, max_stable_lr
from .prereg import FILE as PREREG_FILE
from .prereg import claim_status, record
from .regime import lr_sum, regime, tied_horizons
from .report import _claim_lines, _f, _regime_lines
from .runner import Job, read_run_result, run_jobs, unfinished
from .spec import Experiment, load_experiment

FILES = ("lr_range.json", "lr_range.md", "lr_range.png")


def lr_dir(out: Path, arm: str, lr: float, seed: int) -> Path:
    """The run directory of (arm, lr, seed)."""
    return Path(out) / "runs" / arm / f"lr-{lr_tag(lr)}" / f"seed-{seed}"


def lr_override(lr: float) -> str:
    return f"train.lr={lr!r}"


def grid_jobs(exp: Experiment, out: Path) -> list[Job]:
    """Every (arm, lr, seed) of the grid, as runner jobs."""
    return [Job(arm, s, lr_dir(out, arm, lr, s), (lr_override(lr),))
            for arm in exp.arms for lr in exp.lr_range.lrs for s in exp.seeds]


def untrained_model(cfg):
    """(dataset, formulation, model): the network a run of `cfg` starts from, built in the Trainer's order
    (dataset, then seed, formulation, model; `train/loop.py`), so its weights are that run's initial weights.
    The global RNG is left as it was."""
    import torch

    from ..data import load_dataset
    from ..diffusion import build_formulation
    from ..nn import build_model

    dataset = load_dataset(cfg.data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        formulation = build_formulation(cfg.diffusion)
        model = formulation.wrap(build_model(cfg.model, dataset.sample_shape))
    return dataset, formulation, model


def init_loss(exp: Experiment, out: Path, arm: str, seed: int, extra: list[str]) -> float:
    """L0: the validation loss of the untrained network of (arm, seed) (`untrained_model`: the weights every run
    of that seed starts from) on the runs' stored validation set; cached in OUT/runs/<arm>/init-seed-<s>.json.
    nan when no run of that seed stored its set."""
    from ..diagnostics.base import RunContext
    from ..diagnostics.validation import ValidationSet, validation_losses
    from ..utils.device import pick_device

    cache = Path(out) / "runs" / arm / f"init-seed-{seed}.json"
    if cache.is_file():
        return float(read_json(cache, "delete it to evaluate the untrained network again")["init_loss"])
    stored = [lr_dir(out, arm, lr, seed) / "val.safetensors" for lr in exp.lr_range.lrs]
    stored = [p for p in stored if p.is_file()]
    if not stored:
        return math.nan
    cfg = exp.run_config(arm, seed, [*extra, lr_override(exp.lr_range.lrs[0])])
    dataset, formulation, model = untrained_model(cfg)
    device = pick_device(cfg.train.device)
    model = model.to(device)
    d = cfg.diagnostics
    val = ValidationSet.load_or_create(stored[0], RunContext(cfg, dataset, formulation, model, model, device),
                                       d.val_size, d.val_bins, d.val_seed).to(device)
    loss = float(validation_losses(model, formulation, val, d.val_batch).mean())
    atomic_write_text(cache, json.dumps({"init_loss": loss, "val_set": str(stored[0])}) + "\n")
    return loss


def _run_outcome(exp: Experiment, out: Path, arm: str, lr: float, seed: int, extra: list[str],
                 result: dict[str, Any]) -> tuple[RunOutcome, float]:
    """What the rule reads of one finished run, and its gradient-norm spike fraction after the warm-up."""
    rdir = lr_dir(out, arm, lr, seed)
    cfg = exp.run_config(arm, seed, [*extra, lr_override(lr)])
    rows = read_metrics(rdir)
    diverged = result["status"] != "ok"
    steps, vals = series(rows, exp.metric)
    final = float(vals[-1]) if vals and not diverged and steps[-1] == result.get("final_step") else math.nan
    key = exp.lr_range.rule.spike_key
    loss_steps, loss = series(rows, key) if key else ([], [])
    warmup = cfg.train.warmup_steps
    g_steps, g = series(rows, "grad/total")
    try:
        spikes = spike_fraction(g, factor=exp.lr_range.rule.k, window=exp.lr_range.rule.window, warmup=warmup,
                                steps=g_steps)
    except ValueError:  # too few logged points after the warm-up
        spikes = math.nan
    return RunOutcome(lr, final, diverged, result.get("diverged_at"), loss_steps, loss, warmup), spikes


def analyse_grid(exp: Experiment, out: Path, extra: list[str] | None = None, command: str = "",
                 report_command: str = "") -> dict[str, Any]:
    """Everything lr_range.json, .md and .png show, as one JSON-able dict; the claims judged."""
    out, extra = Path(out), list(extra or [])
    lrs, rule = exp.lr_range.lrs, exp.lr_range.rule
    results = {(j.arm, j.seed, j.overrides): read_run_result(j.rdir) for j in grid_jobs(exp, out)}
    missing = [f"{arm}/{o[0].removeprefix('train.')}/seed-{s}" for (arm, s, o), r in results.items() if r is None]
    if missing:
        raise ExperimentError(f"{len(missing)} of {len(results)} runs have not finished ({', '.join(missing[:3])}"
                              f"{'...' if len(missing) > 3 else ''}); run `steadydiff lr-range` without --report-only "
                              "to train them")
    arms: dict[str, Any] = {}
    nonpositive = 0  # runs whose spike series has a point <= 0 after the warm-up
    for arm in exp.arms:
        seeds: dict[str, Any] = {}
        for s in exp.seeds:
            judged = [_run_outcome(exp, out, arm, lr, s, extra, results[arm, s, (lr_override(lr),)]) for lr in lrs]
            outcomes = [o for o, _ in judged]
            nonpositive += sum(any(v <= 0 for st, v in zip(o.loss_steps, o.loss) if st >= o.warmup) for o in outcomes)
            l0 = init_loss(exp, out, arm, s, extra)
            verdicts = judge_grid(outcomes, rule, l0)
            stable = [v.stable for v in verdicts]
            finals = [o.final for o in outcomes]
            top, bound = max_stable_lr(lrs, stable)
            blr, bfinal = best_lr(lrs, finals, stable)
            seeds[str(s)] = {
                "max_stable_lr": top, "max_stable_lr_bound": bound, "best_lr": blr, "best_final": bfinal,
                "final": {lr_tag(o.lr): o.final for o in outcomes},
                "runs": {lr_tag(o.lr): {"stable": v.stable, "reasons": v.reasons, "slow": v.slow,
                                        "diverged_at": o.diverged_at, "grad_spike_fraction": g}
                         for o, v, (_, g) in zip(outcomes, verdicts, judged)},
                "init_loss": l0, "lr_sensitivity": lr_sensitivity(finals, l0),
            }
        per = [seeds[str(s)] for s in exp.seeds]
        arms[arm] = {
            "overrides": exp.arms[arm], "seeds": seeds,
            "max_stable_lr_per_seed": [p["max_stable_lr"] for p in per],
            "max_stable_lr_bounds": [p["max_stable_lr_bound"] for p in per],
            "best_final_per_seed": [p["best_final"] for p in per],
            "lr_sensitivity_per_seed": [p["lr_sensitivity"] for p in per],
            "horizons_tied": tied_horizons(exp.run_config(arm, exp.seeds[0], [*extra, lr_override(lrs[0])])),
        }
    base_cfg = exp.run_config(exp.baseline, exp.seeds[0], [*extra, lr_override(lrs[0])])
    config = base_cfg.to_dict()
    config["train"]["lr"] = None  # set per run by the grid: see "lrs"
    rep: dict[str, Any] = {
        "experiment": exp.name, "description": exp.description, "source": str(exp.source), "command": command,
        "report_command": report_command, "metric": exp.metric, "lower_is_better": exp.lower_is_better,
        "baseline": exp.baseline, "seeds": exp.seeds, "lrs": list(lrs),
        "rule": {**rule.as_dict(), "mode": exp.lr_range.mode}, "config": config, "arms": arms,
        "regime": _grid_regime(exp, out, base_cfg), "paper": exp.paper, "registration": claim_status(exp, out),
        "machine": machine_info(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s_total": float(sum(r.get("wall_s", 0.0) for r in results.values())),
        "warnings": spike_series_warnings(rule.spike_key, nonpositive),
    }
    rep["claims"] = judge_claims(exp, rep)
    return rep


def spike_series_warnings(key: str | None, nonpositive: int) -> list[str]:
    """The report's warning when the spike condition read a series that is not positive (its 'k x the trailing
    median' then means nothing); the rule stays as registered."""
    if not key or not nonpositive:
        return []
    return [f"The spike condition read `{key}`, which has values <= 0 after the warm-up in {nonpositive} run(s) (a "
            "learned loss weighting such as EDM2's log-variance u, Eq. 21, makes the training loss go below 0); "
            "'k x its trailing median' is not meaningful there, so spike verdicts on those runs should not be "
            "trusted. Set lr_range.rule.spike_key to a positive series, or null, in the next file."]


def _grid_regime(exp: Experiment, out: Path, cfg) -> dict[str, Any]:
    """The baseline's regime row values (`regime.regime`), its LR the grid's and the summed LR per unit LR."""
    shape = next((sh for lr in exp.lr_range.lrs if (sh := saved_sample_shape(lr_dir(out, exp.baseline, lr,
                                                                                  exp.seeds[0])))), None)
    if shape is None:
        from ..data import load_dataset

        shape = load_dataset(cfg.data).sample_shape
    reg = regime(cfg, shape)
    unit = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1.0))
    reg["lr"] = "grid " + ", ".join(f"{lr:g}" for lr in exp.lr_range.lrs)
    reg["lr_sum"] = f"{lr_sum(unit):.4g} x lr"
    return reg


def write_json(rep: dict[str, Any], out: Path) -> None:
    atomic_write_text(Path(out) / "lr_range.json", json.dumps(_json_safe(rep), indent=1) + "\n")


def _bound_text(value: Any, bound: str, lowest: float, why: bool = True) -> str:
    """A max stable LR as text: its value, or its bound, and (`why`) what censored it."""
    if value is None:
        return f"<= {lowest:g}" + (" (unstable at the smallest LR)" if why else "")
    text = f"{bound + ' ' if bound else ''}{float(value):g}"
    return text + (" (censored: the grid's top)" if why and bound == ">=" else "")


def write_markdown(rep: dict[str, Any], out: Path) -> str:
    """lr_range.md: the rule, the per-arm table, every run's final loss and verdict, the regime, the verdicts."""
    lrs, rule = rep["lrs"], rep["rule"]
    tags = [lr_tag(lr) for lr in lrs]
    lines = [
        f"# LR range: {rep['experiment']}", "", rep["description"].strip(), "",
        *provenance_lines(rep),
        f"- Grid: lr {', '.join(f'{lr:g}' for lr in lrs)}; seeds {rep['seeds']} (paired); final `{rep['metric']}` on "
        "each run's fixed stratified validation set",
        f"- Instability rule (pre-registered with the grid): a run is unstable when it diverged, when its final "
        f"validation loss is above {rule['factor']:g}x the best of its arm and seed over the grid at a larger LR "
        "than the best one (a run that much worse at a smaller LR is *slow*, not unstable)"
        + (f", when its logged `{rule.get('spike_key', 'loss')}` after the warm-up has a point above {rule['k']:g}x "
           f"the trailing median of its {rule['window']} predecessors" if rule.get("spike_key", "loss") else
           " (no spike condition: rule.spike_key is null)")
        + (f", or when it did not train: its final validation loss is above {rule['trained']:g}x L0, the untrained "
           "network's" if rule.get("trained") is not None else "")
        + ". Max stable LR: the largest LR with it and every smaller LR stable (at the grid's top only a "
        "lower bound; unstable at the smallest LR, an upper bound). Best LR: the stable LR with the lowest final "
        "loss. LR sensitivity (Wortsman et al. 2023): the mean over the grid of min(L(lr), L0) - L*, with L0 the "
        "untrained network's validation loss (a diverged run counts as L0).",
    ]
    lines += [f"- **Warning:** {w}" for w in rep.get("warnings", [])]
    lines += _regime_lines(rep)
    lines += ["", "## Per arm", "", "| arm | seed | max stable LR | best LR | best final | LR sensitivity | L0 "
              "(untrained) |", "|---|---|---|---|---|---|---|"]
    for name, a in rep["arms"].items():
        for s, x in a["seeds"].items():
            lines.append(f"| {name} | {s} | {_bound_text(x['max_stable_lr'], x['max_stable_lr_bound'], lrs[0])} | "
                         f"{_f(x['best_lr'])} | {_f(x['best_final'], 4)} | {_f(x['lr_sensitivity'], 3)} | "
                         f"{_f(x['init_loss'], 4)} |")
        sens = [float(x["lr_sensitivity"]) for x in a["seeds"].values()]
        best = [float(x["best_final"]) for x in a["seeds"].values()]
        lines.append(f"| {name} | median | | | {_f(float(np.median(best)), 4)} | "
                     f"{_f(float(np.nanmedian(sens)) if any(map(math.isfinite, sens)) else math.nan, 3)} | |")
    lines += ["", "## Every run", "", f"Final `{rep['metric']}` per LR; **unstable** runs are marked and listed "
              "below with the reason, *slow* ones (far worse than the best, below the best LR) in italics.", "",
              "| arm | seed | " + " | ".join(f"lr {t}" for t in tags) + " |", "|---|---|" + "---|" * len(tags)]
    reasons = []
    for name, a in rep["arms"].items():
        for s, x in a["seeds"].items():
            cells = []
            for t in tags:
                r, v = x["runs"][t], _f(x["final"][t], 4)
                cells.append(v if r["stable"] and not r["slow"] else f"*{v}*" if r["stable"] else f"**{v} unstable**")
                if not r["stable"]:
                    reasons.append(f"- {name}, seed {s}, lr {t}: {'; '.join(r['reasons'])}.")
            lines.append(f"| {name} | {s} | " + " | ".join(cells) + " |")
    lines += ([""] + reasons if reasons else [])
    if rep["claims"]:
        lines += _claim_lines(rep)
    lines += ["", "## Plot", "", "![final validation loss and gradient spikes against the LR](lr_range.png)", ""]
    text = "\n".join(ln for ln in lines if ln is not None) + "\n"
    atomic_write_text(Path(out) / "lr_range.md", text)
    return text


def plot_lr_range(rep: dict[str, Any], out: Path) -> None:
    """lr_range.png: final validation loss against LR per arm (seeds as points, the median line, unstable runs
    as crosses, diverged ones at L0), and the gradient-norm spike fraction against LR."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = np.asarray(rep["lrs"], dtype=np.float64)
    tags = [lr_tag(lr) for lr in rep["lrs"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), dpi=100)
    for i, (name, a) in enumerate(rep["arms"].items()):
        color = f"C{i % 10}"
        finals, spikes = [], []
        for x in a["seeds"].values():
            l0 = float(x["init_loss"])
            f = np.array([float(x["final"][t]) for t in tags])
            f = np.where(np.isfinite(f), f, l0)  # a diverged run counts as L0 (nan when L0 is unknown)
            stable = np.array([x["runs"][t]["stable"] for t in tags])
            axes[0].scatter(lrs[stable], f[stable], color=color, s=14, alpha=0.7)
            axes[0].scatter(lrs[~stable], f[~stable], color=color, marker="x", s=40)
            finals.append(f)
            spikes.append([float(x["runs"][t]["grad_spike_fraction"]) for t in tags])
            axes[1].scatter(lrs, spikes[-1], color=color, s=14, alpha=0.7)
        with warnings.catch_warnings():  # an LR where every seed is nan (L0 unknown) has no median
            warnings.simplefilter("ignore", RuntimeWarning)
            med, smed = np.nanmedian(finals, axis=0), np.nanmedian(spikes, axis=0)
        axes[0].plot(lrs, med, color=color, lw=1.5, label=name)
        axes[1].plot(lrs, smed, color=color, lw=1.5, label=name)
    for ax in axes:
        ax.set_xscale("log")
        # The grid's range, set: a panel whose points are all nan (no spike fraction: too few logged points after
        # the warm-up) has no data limits, and a log axis cannot take the default (0, 1).
        ax.set_xlim(lrs[0] / 1.5, lrs[-1] * 1.5)
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[0].set_ylabel(f"final {rep['metric']}")
    axes[0].set_title("final validation loss vs LR\n(dots: stable seeds, x: unstable, line: median; diverged at L0)",
                      fontsize=10)
    axes[1].set_ylabel("fraction of points")
    axes[1].set_title(f"gradient-norm spikes after warm-up\n(grad/total above {rep['rule']['k']:g}x its trailing "
                      "median)", fontsize=10)
    fig.tight_layout()
    atomic_write(Path(out) / "lr_range.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)


def summary_lines(rep: dict[str, Any]) -> list[str]:
    """One line per arm for the terminal: max stable LR and best LR per seed."""
    if rep["rule"].get("mode") == "ramp":
        return ramp_summary_lines(rep)
    lowest = rep["lrs"][0]
    return [f"{name}: max stable LR " + ", ".join(_bound_text(x["max_stable_lr"], x["max_stable_lr_bound"], lowest,
                                                               why=False) for x in a["seeds"].values())
            + "; best LR " + ", ".join(_f(x["best_lr"]) for x in a["seeds"].values())
            for name, a in rep["arms"].items()]


@dataclasses.dataclass(frozen=True)
class Mode:
    """What one `lr_range.mode` trains and writes: its jobs, its analysis, its markdown and its plot."""

    jobs: Callable[[Experiment, Path], list[Job]]
    analyse: Callable[..., dict[str, Any]]
    markdown: Callable[[dict[str, Any], Path], str]
    plot: Callable[[dict[str, Any], Path], None]


MODES = {"grid": Mode(grid_jobs, analyse_grid, write_markdown, plot_lr_range),
         "ramp": Mode(ramp_jobs, analyse_ramp, write_ramp_markdown, plot_ramp)}


def lr_range(experiment: str | Path, out: str | Path, overrides: list[str], argv: list[str], *,
             workers: int | None = None, report_only: bool = False, show_progress: bool = True,
             say: Callable[[str], Any] = print, launch: LaunchOptions | None = None) -> dict[str, Any] | None:
    """Run `steadydiff lr-range` with these arguments (`argv`: the command line after `steadydiff`, quoted in
    lr_range.md); returns the analysed report (its `claims` hold the verdicts). `say` gets progress lines.
    `launch`: where the runs train (`launch.py`); with its `dry_run`, says what would be submitted, writes and
    submits nothing, and returns None."""
    exp = load_experiment(experiment, overrides, strict=not report_only)
    if exp.lr_range is None:
        raise ConfigError(f"experiment {experiment} has no lr_range: block; add lr_range: {{lrs: [1.0e-4, 3.0e-4, "
                          "1.0e-3]}, or run it with `steadydiff compare`")
    out, mode = Path(out), MODES[exp.lr_range.mode]
    jobs = mode.jobs(exp, out)
    launch = launch_options(exp, out, overrides, launch, [list(jobs[0].overrides)])
    if launch.dry_run:
        for line in plan_lines(unfinished(jobs), launch, exp.name):
            say(line)
        return None
    command = "steadydiff " + " ".join(shlex.quote(a) for a in argv)
    ran_by = out / COMMAND_FILE
    report_command = ""
    if not report_only:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(ran_by, command + "\n")
        if record(exp, out):  # before anything trains: later changes of the grid, rule or claims are post hoc
            say(f"recorded the design, LR grid, rule and {len(exp.claims)} claims in {out}/{PREREG_FILE}")
        elif not (out / PREREG_FILE).exists():
            say(f"{out} already holds runs and no {PREREG_FILE}: the claims are 'not recorded' (register claims by "
                "running a new experiment into an empty --out)")
        run_jobs(exp, jobs, overrides, workers=workers, show_progress=show_progress,
                 desc=f"lr-range {exp.lr_range.mode} runs", launch=launch)
    elif ran_by.is_file():
        command, report_command = ran_by.read_text().strip(), command
    rep = mode.analyse(exp, out, overrides, command, report_command)
    write_json(rep, out)
    mode.plot(rep, out)
    mode.markdown(rep, out)
    publish_report(exp, out, [*overrides, *jobs[0].overrides], [out / f for f in FILES])
    return rep
