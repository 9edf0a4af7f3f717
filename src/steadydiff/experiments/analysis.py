"""From finished runs to numbers: curves per arm, targets, speed-ups with CIs, stability, sensitivity, verdicts."""

from __future__ import annotations

import json
import math
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ..diagnostics.stats import oscillation_summary
from ..runs.metrics_log import read_metrics, series
from ..utils.errors import SteadydiffError
from ..utils.io import atomic_write_text
from .runner import read_result, run_dir
from .spec import Experiment
from .speedup import baseline_targets, fill_diverged, mean_curve, ratio_of_means_ci, speedup_ci, verdict


class ExperimentError(SteadydiffError):
    """Runs are missing or inconsistent; the message names the fix."""


def _json_safe(x: Any) -> Any:
    """JSON has no inf/nan: write them as strings a reader can still parse with float()."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def metric_curves(exp: Experiment, out: Path) -> tuple[list[int], dict[str, np.ndarray], dict[str, list[dict]]]:
    """The evaluation grid and a (seeds, grid) array per arm, diverged runs filled with the worst value."""
    results = {arm: [read_result(out, arm, s) for s in exp.seeds] for arm in exp.arms}
    missing = [f"{arm}/seed-{s}" for arm, rs in results.items() for s, r in zip(exp.seeds, rs) if r is None]
    if missing:
        raise ExperimentError(f"{len(missing)} runs have not finished ({', '.join(missing[:3])}...); "
                              "run `steadydiff compare` without --report-only to train them")
    raw: dict[tuple[str, int], dict[int, float]] = {}
    for arm in exp.arms:
        for s in exp.seeds:
            steps, vals = series(read_metrics(run_dir(out, arm, s)), exp.metric)
            raw[arm, s] = dict(zip(steps, vals))
    ok_runs = [(arm, s) for arm in exp.arms for s, r in zip(exp.seeds, results[arm]) if r["status"] == "ok"]
    if not ok_runs:
        raise ExperimentError("every run diverged; there is no curve to compare (lower train.lr?)")
    grid = sorted(max((raw[k] for k in ok_runs), key=len))
    if not grid:
        raise ExperimentError(f"no run logged {exp.metric!r}; enable it (e.g. train.eval_every for eval/..., "
                              "diagnostics.probe_every for probe/loss) in the experiment's set:")
    curves = {}
    for arm in exp.arms:
        rows = []
        for s, r in zip(exp.seeds, results[arm]):
            vals = [raw[arm, s].get(st, math.nan) for st in grid]
            if r["status"] == "ok" and any(math.isnan(v) for v in vals):
                raise ExperimentError(f"{arm}/seed-{s} did not log {exp.metric} at every step of {grid[:4]}...; "
                                      "all arms must share the evaluation schedule")
            rows.append(fill_diverged(vals, len(grid), exp.lower_is_better))
        curves[arm] = np.stack(rows)
    return grid, curves, results


def stability_stats(exp: Experiment, out: Path) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """oscillation_summary of each stability series, per arm and seed, after the warm-up."""
    stats: dict[str, dict[int, dict]] = {}
    for arm in exp.arms:
        stats[arm] = {}
        for s in exp.seeds:
            rdir = run_dir(out, arm, s)
            rows = read_metrics(rdir)
            warmup = exp.stability_warmup
            if warmup is None:
                warmup = exp.run_config(arm, s).train.warmup_steps
            picked = {}
            for key in exp.stability:
                st, vals = series(rows, key)
                kept = [v for t, v in zip(st, vals) if t > warmup]
                if len(kept) >= 3:
                    picked[key] = kept
            stats[arm][s] = oscillation_summary(picked)
    return stats


def sensitivity_stats(exp: Experiment, out: Path) -> dict[str, dict[int, dict[str, float]]]:
    """Input sensitivity R(t) of each run's final EMA model (cached in the run's sensitivity.json)."""
    import torch

    from ..diagnostics.report import _fixed_batch, _load_run, _sensitivity

    res: dict[str, dict[int, dict[str, float]]] = {}
    for arm in exp.arms:
        res[arm] = {}
        for s in exp.seeds:
            rdir = run_dir(out, arm, s)
            cache = rdir / "sensitivity.json"
            if cache.exists():
                res[arm][s] = json.loads(cache.read_text())
                continue
            if read_result(out, arm, s)["status"] != "ok":
                res[arm][s] = {}
                continue
            cfg, model, sde, ds = _load_run(rdir)
            x0, labels = _fixed_batch(ds, 32)
            with torch.no_grad():
                r = _sensitivity(model, sde, x0, labels, cfg.model.num_classes)
            atomic_write_text(cache, json.dumps(r) + "\n")
            res[arm][s] = r
    return res


def _mean_sd(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    if len(a) == 0:
        return math.nan, math.nan
    with np.errstate(invalid="ignore"):  # a diverged seed (inf) makes the sd undefined: nan, shown as n/a
        return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def analyse(exp: Experiment, out: Path, command: str = "", report_command: str = "") -> dict[str, Any]:
    """Everything report.md and the plots show, as one JSON-able dict (also written to results.json)."""
    out = Path(out)
    grid, curves, results = metric_curves(exp, out)
    base = exp.baseline
    base_mean = mean_curve(curves[base])
    targets = baseline_targets(grid, base_mean)
    better = 1.0 if exp.lower_is_better else -1.0
    arms: dict[str, Any] = {}
    stab = stability_stats(exp, out)
    sens = sensitivity_stats(exp, out) if exp.sensitivity else None
    for i, arm in enumerate(exp.arms):
        c = curves[arm]
        finals = [float(v) for v in c[:, -1]]
        entry: dict[str, Any] = {
            "overrides": exp.arms[arm],
            "diverged": [r["seed"] for r in results[arm] if r["status"] != "ok"],
            "diverged_at": {r["seed"]: r.get("diverged_at") for r in results[arm] if r["status"] != "ok"},
            "final_per_seed": finals,
            "final_mean": float(np.mean(finals)), "final_sd": _mean_sd(finals)[1],
            "curve_mean": [float(v) for v in mean_curve(c)],
            "curve_min": [float(v) for v in c.min(axis=0)],
            "curve_max": [float(v) for v in c.max(axis=0)],
            "wall_s": float(sum(r.get("wall_s", 0.0) for r in results[arm])),
            "speedup": {},
        }
        for name in targets:
            entry["speedup"][name] = speedup_ci(grid, curves[base], c, name, exp.lower_is_better,
                                                n_boot=exp.bootstrap, seed=i, paired=True).to_dict()
        fp, flo, fhi = ratio_of_means_ci(curves[base][:, -1], c[:, -1], exp.bootstrap, seed=i, paired=True)
        entry["final_ratio"] = {"ratio": fp, "ci_low": flo, "ci_high": fhi}
        entry["stability"] = {}
        for key in exp.stability:
            per_seed = [stab[arm][s].get(key) for s in exp.seeds]
            if any(p is None for p in per_seed):
                continue
            entry["stability"][key] = {
                stat: {"mean": _mean_sd([p[stat] for p in per_seed])[0],
                       "sd": _mean_sd([p[stat] for p in per_seed])[1],
                       "per_seed": [p[stat] for p in per_seed]}
                for stat in per_seed[0]
            }
        if sens is not None:
            ts = sorted({t for s in exp.seeds for t in sens[arm][s]}, key=float)
            entry["sensitivity"] = {
                "per_t": {t: _mean_sd([sens[arm][s][t] for s in exp.seeds if t in sens[arm][s]])[0] for t in ts},
                "mean_per_seed": [float(np.mean(list(sens[arm][s].values()))) if sens[arm][s] else math.nan
                                  for s in exp.seeds],
            }
        arms[arm] = entry
    verdicts = [judge(claim, arms, base, better, exp.bootstrap) for claim in exp.claims]
    report = {
        "experiment": exp.name, "description": exp.description, "source": str(exp.source),
        "command": command, "report_command": report_command, "metric": exp.metric,
        "lower_is_better": exp.lower_is_better,
        "baseline": base, "seeds": exp.seeds, "grid": grid, "targets": targets, "arms": arms,
        "claims": verdicts, "machine": machine_info(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s_total": float(sum(a["wall_s"] for a in arms.values())),
    }
    atomic_write_text(out / "results.json", json.dumps(_json_safe(report), indent=1) + "\n")
    return report


def judge(claim, arms: dict[str, Any], base: str, better: float, n_boot: int) -> dict[str, Any]:
    """One claim's number, CI and verdict (see `spec` for what each kind compares)."""
    versus = claim.versus or base
    a, b = arms[claim.arm], arms[versus]
    lower = claim.direction == "less"
    out: dict[str, Any] = {"name": claim.name, "arm": claim.arm, "versus": versus, "kind": claim.kind,
                           "threshold": claim.threshold, "direction": claim.direction}
    if claim.kind == "speedup":
        s = a["speedup"][claim.target]
        out.update(value=s["speedup"], ci_low=s["ci_low"], ci_high=s["ci_high"], target=claim.target,
                   verdict=verdict(s["ci_low"], s["ci_high"], claim.threshold, higher_is_better=True))
    elif claim.kind == "final":
        if versus == base:  # the ratio the arm table shows
            r = a["final_ratio"]
            p, lo, hi = r["ratio"], r["ci_low"], r["ci_high"]
        else:
            p, lo, hi = ratio_of_means_ci(b["final_per_seed"], a["final_per_seed"], n_boot, paired=True)
        out.update(value=p, ci_low=lo, ci_high=hi,
                   verdict=verdict(lo, hi, claim.threshold, higher_is_better=better < 0))
    elif claim.kind == "stability":
        if claim.series not in a["stability"] or claim.series not in b["stability"]:
            out.update(value=math.nan, ci_low=math.nan, ci_high=math.nan, verdict="inconclusive",
                       note=f"{claim.series} was not logged")
        else:
            p, lo, hi = ratio_of_means_ci(b["stability"][claim.series][claim.stat]["per_seed"],
                                          a["stability"][claim.series][claim.stat]["per_seed"], n_boot, paired=True)
            out.update(value=p, ci_low=lo, ci_high=hi, series=claim.series, stat=claim.stat,
                       verdict=verdict(lo, hi, claim.threshold, higher_is_better=not lower))
    elif claim.kind == "sensitivity":
        if "sensitivity" not in a:
            out.update(value=math.nan, ci_low=math.nan, ci_high=math.nan, verdict="inconclusive",
                       note="set sensitivity: true in the experiment")
        else:
            p, lo, hi = ratio_of_means_ci(b["sensitivity"]["mean_per_seed"], a["sensitivity"]["mean_per_seed"],
                                          n_boot, paired=True)
            out.update(value=p, ci_low=lo, ci_high=hi,
                       verdict=verdict(lo, hi, claim.threshold, higher_is_better=not lower))
    return out


def machine_info() -> dict[str, Any]:
    import os

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch": torch.__version__, "python": sys.version.split()[0], "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
