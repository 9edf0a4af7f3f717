"""report.md and plots of an analysed experiment (the dict `analysis.analyse` returns)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..diagnostics.stats import moving_average
from ..runs.metrics_log import read_metrics, series
from ..utils.io import atomic_write, atomic_write_text
from .runner import run_dir
from .spec import Experiment


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return v
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "never" if v > 0 else "-inf"
        return f"{v:.{digits}g}"
    return str(v)


def _speed(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return "0 (never)" if v == 0 else f"{_f(v)}x"


def write_markdown(rep: dict[str, Any], out: Path) -> str:
    m = rep["machine"]
    lines = [
        f"# Experiment: {rep['experiment']}", "",
        rep["description"].strip(), "",
        f"- Command: `{rep['command']}`" if rep["command"] else "",
        f"- Report regenerated from the finished runs by: `{rep['report_command']}`" if rep.get("report_command")
        else "",
        f"- Experiment file: `{rep['source']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores{', ' + m['gpu'] if 'gpu' in m else ''}; torch {m['torch']}, "
        f"python {m['python']}",
        f"- Date: {rep['date']}; training wall time, all runs: {rep['wall_s_total'] / 60:.1f} min",
        f"- Metric: `{rep['metric']}` ({'lower' if rep['lower_is_better'] else 'higher'} is better), evaluated at "
        f"steps {rep['grid'][0]}..{rep['grid'][-1]} ({len(rep['grid'])} points); seeds {rep['seeds']}",
        f"- Targets fixed in advance from the baseline `{rep['baseline']}` (mean over seeds): final "
        f"{_f(rep['targets']['final'], 4)}, half-budget {_f(rep['targets']['half'], 4)}",
        "", "## Speed-up and final quality", "",
        "Steps to reach each target on the seed-mean curve (linear interpolation between evaluations), speed-up "
        "= baseline steps / arm steps, and a 95% CI from resampling seeds (paired: the same seeds in both arms). "
        "An arm whose mean curve never reaches a target within the budget has speed-up 0 ('never'). "
        f"With {len(rep['seeds'])} seeds a resample can take only a few distinct values, so the CIs are coarse. "
        "Final: mean +- sd over seeds.", "",
        "| arm | steps to final target | speed-up (95% CI) | steps to half target | speed-up (95% CI) | "
        "final metric | diverged |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, a in rep["arms"].items():
        sf, sh = a["speedup"]["final"], a["speedup"]["half"]
        div = ", ".join(f"seed {s} at step {a['diverged_at'][s]}" for s in a["diverged"]) or "0"
        cells = [f"{_f(s['arm_steps'], 4)} | {_speed(s['speedup'])} ({_f(s['ci_low'])}, {_f(s['ci_high'])})"
                 for s in (sf, sh)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {_f(a['final_mean'], 4)} +- {_f(a['final_sd'], 2)} | "
                     f"{div} |")
    stab_keys = sorted({k for a in rep["arms"].values() for k in a["stability"]})
    if stab_keys:
        lines += ["", "## Stability (oscillation after warm-up; mean over seeds)", "",
                  "`mald` = median |delta log| between consecutive logged values (scale-free oscillation), `cv` = "
                  "std/mean, `spikes` = points above 3x the running median.", "",
                  "| arm | " + " | ".join(f"{k} mald | {k} cv | {k} spikes" for k in stab_keys) + " |",
                  "|---|" + "---|" * (3 * len(stab_keys))]
        for name, a in rep["arms"].items():
            cells = []
            for k in stab_keys:
                s = a["stability"].get(k)
                cells += ([_f(s["median_abs_log_delta"]["mean"]), _f(s["cv"]["mean"]), _f(s["spikes"]["mean"])]
                          if s else ["-", "-", "-"])
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("sensitivity" in a for a in rep["arms"].values()):
        ts = list(next(a for a in rep["arms"].values() if "sensitivity" in a)["sensitivity"]["per_t"])
        lines += ["", "## Input sensitivity of the final EMA model", "",
                  "R(t) = ||eps(x_t + d) - eps(x_t)|| / ||d|| for small random perturbations d (mean over seeds).", "",
                  "| arm | " + " | ".join(f"t={t}" for t in ts) + " |", "|---|" + "---|" * len(ts)]
        for name, a in rep["arms"].items():
            if "sensitivity" in a:
                lines.append(f"| {name} | " + " | ".join(_f(a["sensitivity"]["per_t"].get(t)) for t in ts) + " |")
    if rep["claims"]:
        lines += ["", "## Verdicts", "",
                  "A claim holds when the whole 95% CI is on its side of the threshold, does not hold when the whole "
                  "CI is on the other side, and is inconclusive when the CI straddles it.", "",
                  "| claim | arm | quantity | value (95% CI) | claimed | verdict |", "|---|---|---|---|---|---|"]
        for c in rep["claims"]:
            vs = c.get("versus", rep["baseline"])
            what = {"speedup": f"speed-up to {c.get('target', 'final')} target",
                    "final": f"final metric ratio vs {vs}",
                    "stability": f"{c.get('stat', '')} of {c.get('series', '')}, ratio vs {vs}",
                    "sensitivity": f"mean R(t), ratio vs {vs}"}[c["kind"]]
            if c["kind"] == "speedup":
                claimed = f"> {_f(c['threshold'])}"
            elif c["kind"] == "final":
                claimed = f"{'<' if rep['lower_is_better'] else '>'} {_f(c['threshold'])}"
            else:
                claimed = f"{'<' if c.get('direction', 'less') == 'less' else '>'} {_f(c['threshold'])}"
            lines.append(f"| {c['name']} | {c['arm']} | {what} | {_f(c['value'])} ({_f(c['ci_low'])}, "
                         f"{_f(c['ci_high'])}) | {claimed} | **{c['verdict']}** |")
    lines += ["", "## Plots", "", "![metric vs steps](metric.png)", "", "![stability](stability.png)", ""]
    text = "\n".join(ln for ln in lines if ln is not None) + "\n"
    atomic_write_text(out / "report.md", text)
    return text


def plot_experiment(exp: Experiment, rep: dict[str, Any], out: Path) -> None:
    """metric.png (seed-mean curves with min-max bands and the targets) and stability.png (overlays)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = rep["grid"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
    for name, a in rep["arms"].items():
        mean = np.array([float(v) for v in a["curve_mean"]])
        lo = np.array([float(v) for v in a["curve_min"]])
        hi = np.array([float(v) for v in a["curve_max"]])
        finite = np.isfinite(mean)
        (line,) = axes[0].plot(np.array(grid)[finite], mean[finite], lw=1.5, label=name)
        ok = np.isfinite(lo) & np.isfinite(hi)
        axes[0].fill_between(np.array(grid)[ok], lo[ok], hi[ok], alpha=0.15, color=line.get_color())
    for tname, tv in rep["targets"].items():
        axes[0].axhline(float(tv), ls="--", lw=0.8, color="gray")
        axes[0].text(grid[0], float(tv), f" {tname} target", va="bottom", fontsize=7, color="gray")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel(rep["metric"])
    axes[0].set_title("metric vs steps (mean over seeds, band = min..max)")
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    names = list(rep["arms"])
    sf = [rep["arms"][n]["speedup"]["final"] for n in names]
    pts = [min(float(s["speedup"]), 10.0) for s in sf]
    lo = [min(float(s["ci_low"]), 10.0) if not math.isnan(float(s["ci_low"])) else 0 for s in sf]
    hi = [min(float(s["ci_high"]), 10.0) if not math.isnan(float(s["ci_high"])) else 0 for s in sf]
    axes[1].bar(names, pts, color="tab:blue", alpha=0.6)
    axes[1].errorbar(names, pts, yerr=[np.maximum(np.subtract(pts, lo), 0), np.maximum(np.subtract(hi, pts), 0)],
                     fmt="none", ecolor="black", capsize=3)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_title("speed-up to the baseline's final quality (95% CI, capped at 10)")
    axes[1].tick_params(axis="x", rotation=30, labelsize=7)
    fig.tight_layout()
    atomic_write(out / "metric.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)

    keys = exp.stability or ["loss"]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), dpi=100, squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name in exp.arms:
            runs = []
            for s in exp.seeds:
                st, v = series(read_metrics(run_dir(out, name, s)), key)
                runs.append((st, v))
            n = min((len(v) for _, v in runs), default=0)
            if n < 2:
                continue
            m = np.mean([v[:n] for _, v in runs], axis=0)
            w = max(1, n // 50)
            sm = moving_average(m, w) if w > 1 else m
            ax.plot(runs[0][0][:n][len(runs[0][0][:n]) - len(sm):], sm, lw=1, label=name)
        ax.set_yscale("log")
        ax.set_title(f"{key} (mean over seeds, smoothed)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(out / "stability.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)
