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
from ..runs import saved_sample_shape
from ..runs.metrics_log import read_metrics, series
from ..utils.errors import SteadydiffError
from ..utils.io import atomic_write_text, read_json
from .calibrate import read_calibration
from .claims import CLAIM_KINDS
from .inference import ALPHA, familywise_error, holm, judge_ratios
from .prereg import NOT_RECORDED, PRE_REGISTERED, claim_status
from .regime import regime, tied_horizons
from .runner import read_result, run_dir
from .spec import TARGETS, Experiment, split_nfe
from .speedup import fill_diverged, mean_curve, time_shift


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


def final_values(exp: Experiment, out: Path) -> dict[str, dict[str, list[float]]]:
    """Per arm, per key named by a claim's `keys`, each seed's last logged value (the worst value, inf or -inf,
    for a run that diverged or never logged the key)."""
    keys = sorted({k for c in exp.claims for k in (c.keys or [])})
    worst = math.inf if exp.lower_is_better else -math.inf
    res: dict[str, dict[str, list[float]]] = {}
    for arm in exp.arms:
        res[arm] = {k: [] for k in keys}
        for s in exp.seeds:
            ok = read_result(out, arm, s)["status"] == "ok"
            rows = read_metrics(run_dir(out, arm, s)) if keys else []
            for k in keys:
                _, vals = series(rows, k)
                v = float(vals[-1]) if ok and vals else worst
                res[arm][k].append(v if math.isfinite(v) else worst)
    return res


def nfe_finals(exp: Experiment, out: Path) -> dict[str, dict[str, Any]]:
    """For each `eval/<metric>` the runs logged at network-evaluation budgets (`eval/<metric>@nfe<N>`, from
    train.eval_nfe): {"eval/<metric>": {"nfe": [N, ...], "arms": {arm: {N: per-seed last values}}}}, a
    diverged run or a missing value counted as the worst value, as in `final_values`; {} when none."""
    worst = math.inf if exp.lower_is_better else -math.inf
    rows = {(arm, s): read_metrics(run_dir(out, arm, s)) for arm in exp.arms for s in exp.seeds}
    found: dict[str, set[int]] = {}
    for rs in rows.values():
        for r in rs:
            for k in r:
                base, nfe = split_nfe(k)
                if nfe is not None:
                    found.setdefault(base, set()).add(nfe)
    res: dict[str, dict[str, Any]] = {}
    for base, budgets in sorted(found.items()):
        nfes = sorted(budgets)
        arms: dict[str, dict[int, list[float]]] = {}
        for arm in exp.arms:
            arms[arm] = {}
            for n in nfes:
                vals = []
                for s in exp.seeds:
                    ok = read_result(out, arm, s)["status"] == "ok"
                    _, v = series(rows[arm, s], f"{base}@nfe{n}")
                    x = float(v[-1]) if ok and v else worst
                    vals.append(x if math.isfinite(x) else worst)
                arms[arm][n] = vals
        res[base] = {"nfe": nfes, "arms": arms}
    return res


def late_change(grid: list[int], curves: np.ndarray, fraction: float = 0.25) -> list[float]:
    """Per seed, the metric's relative change per 1,000 steps over the last `fraction` of the budget (a
    least-squares line through log values): near 0 when the run has plateaued, e.g. -0.05 = falling 5% per
    1k steps. NaN when fewer than 3 evaluations fall in that window or a value is not positive and finite."""
    steps = np.asarray(grid, dtype=np.float64)
    window = steps >= steps[-1] - fraction * steps[-1]
    out = []
    for row in curves:
        y = np.asarray(row, dtype=np.float64)[window]
        if window.sum() < 3 or not np.all(np.isfinite(y) & (y > 0)):
            out.append(math.nan)
            continue
        slope = np.polyfit(steps[window], np.log(y), 1)[0]
        out.append(float(np.expm1(slope * 1000.0)))
    return out


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
                res[arm][s] = read_json(cache, "delete it to measure the sensitivity again")
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


def _time_shifts(grid: list[int], base: np.ndarray, arm: np.ndarray, lower: bool) -> dict[str, Any]:
    """Time-shift speed-ups at each target fraction: on the seed-mean curves, and per paired seed. A target
    before the first evaluation (e.g. a grid of the final step only) has none."""
    out = {}
    for name, frac in TARGETS.items():
        if frac * grid[-1] < grid[0]:
            continue
        mean = time_shift(grid, mean_curve(base), mean_curve(arm), frac, lower)
        seeds = [time_shift(grid, b, a, frac, lower) for b, a in zip(base, arm)]
        out[name] = {**mean, "per_seed": [s["forward"] for s in seeds],
                     "per_seed_flags": [s["forward_flag"] for s in seeds]}
    return out


def analyse(exp: Experiment, out: Path, command: str = "", report_command: str = "") -> dict[str, Any]:
    """Everything report.md and the plots show, as one JSON-able dict (also written to results.json): per
    arm the per-seed curves, time-shift speed-ups, finals, stability and sensitivity; the regime, the tied
    horizons, the claims' registration status, any calibration, and every claim's judgement."""
    out = Path(out)
    grid, curves, results = metric_curves(exp, out)
    base = exp.baseline
    arms: dict[str, Any] = {}
    stab = stability_stats(exp, out)
    sens = sensitivity_stats(exp, out) if exp.sensitivity else None
    finals_of = final_values(exp, out)
    for arm in exp.arms:
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
            "curves_per_seed": [[float(v) for v in row] for row in c],
            "late_change_per_seed": late_change(grid, c),
            "final_of": finals_of[arm],
            "wall_s": float(sum(r.get("wall_s", 0.0) for r in results[arm])),
            "time_shift": _time_shifts(grid, curves[base], c, exp.lower_is_better),
            "horizons_tied": tied_horizons(exp.run_config(arm, exp.seeds[0])),
        }
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
    shape = saved_sample_shape(run_dir(out, base, exp.seeds[0]))
    report = {
        "experiment": exp.name, "description": exp.description, "source": str(exp.source),
        "command": command, "report_command": report_command, "metric": exp.metric,
        "lower_is_better": exp.lower_is_better,
        "baseline": base, "seeds": exp.seeds, "grid": grid, "arms": arms,
        "regime": regime(exp.run_config(base, exp.seeds[0]), shape) if shape else {}, "paper": exp.paper,
        "registration": claim_status(exp, out), "calibration": read_calibration(out),
        "machine": machine_info(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s_total": float(sum(a["wall_s"] for a in arms.values())),
        "nfe": nfe_finals(exp, out),
    }
    report["claims"] = judge_claims(exp, report)
    atomic_write_text(out / "results.json", json.dumps(_json_safe(report), indent=1) + "\n")
    return report


def rerender(exp: Experiment, out: Path, report_command: str = "") -> dict[str, Any]:
    """Judge `exp`'s claims again from OUT/results.json when the runs themselves are gone (they do not survive
    a change of machine): the stored per-seed values are re-analysed with the current statistics; what an
    older results.json did not store (per-seed curves) is said in the claims' notes."""
    from ..data import load_dataset

    path = Path(out) / "results.json"
    if not path.is_file():
        raise ExperimentError(f"the runs have not finished (there is no {Path(out) / 'runs'}) and there is no {path} "
                              "to re-judge; run `steadydiff compare` without --report-only to train them")
    rep = read_json(path, "restore it, or run `steadydiff compare` without --report-only")
    cfg = exp.run_config(exp.baseline, exp.seeds[0])
    rep.update(description=exp.description, paper=exp.paper, registration=claim_status(exp, out),
               calibration=read_calibration(out), report_command=report_command,
               regime=regime(cfg, load_dataset(cfg.data).sample_shape),
               rerendered=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    base_mean = [_float(v) for v in rep["arms"][exp.baseline]["curve_mean"]]
    for arm, entry in rep["arms"].items():
        entry.setdefault("horizons_tied", tied_horizons(exp.run_config(arm, exp.seeds[0])))
        if "time_shift" not in entry:  # older results: the seed-mean curves are all there is
            mean = [_float(v) for v in entry["curve_mean"]]
            entry["time_shift"] = {name: {**time_shift(rep["grid"], base_mean, mean, frac, rep["lower_is_better"]),
                                          "per_seed": None} for name, frac in TARGETS.items()}
    rep["claims"] = judge_claims(exp, rep)
    atomic_write_text(path, json.dumps(_json_safe(rep), indent=1) + "\n")
    return rep


def _diverged_note(rep: dict[str, Any], *arms: str) -> str:
    """'org: 2 of 5 seeds diverged (at steps 150, 150)' for each named arm with a diverged seed."""
    parts = []
    for arm in dict.fromkeys(arms):
        entry = rep["arms"][arm]
        div = entry.get("diverged") or []
        if div:
            at = entry.get("diverged_at") or {}
            steps = ", ".join(str(at.get(s, at.get(str(s), "?"))) for s in div)
            parts.append(f"{arm}: {len(div)} of {len(rep['seeds'])} seeds diverged (at steps {steps}) and count as "
                         "its worst outcome, never as missing")
    return "; ".join(parts)


def judge_claims(exp: Experiment, rep: dict[str, Any]) -> list[dict[str, Any]]:
    """Every claim judged from `rep` alone (an `analyse` result, or an older results.json), so that reports
    can be re-rendered from stored results; then the family of confirmatory claims: how many, the chance of
    a false "holds" among them under no effect, and, with `multiplicity: holm`, Holm's correction (a verdict
    stands only where its adjusted p < alpha)."""
    claims = [judge(c, rep, exp.bootstrap) for c in exp.claims]
    for c in claims:
        why = exp.unreachable.get(c["name"])
        if why:
            c["note"] = "; ".join(n for n in (c["note"], "no outcome could make this claim hold as written: "
                                              + why.split(": ", 1)[-1]) if n)
    family = [c for c in claims if c["confirmatory"]]
    rep["multiplicity"] = {"rule": exp.multiplicity, "confirmatory": len(family),
                           "familywise_error": familywise_error(len(family)) if family else 0.0}
    if exp.multiplicity == "holm" and family:
        ps = [_float(c.get("p_verdict")) for c in family]
        for c, adj in zip(family, holm([p if math.isfinite(p) else 1.0 for p in ps])):
            c["p_adjusted"] = adj
            if c["verdict"] != "inconclusive" and not adj < ALPHA:
                c["verdict_note"] = f"unadjusted: {c['verdict']}; Holm-adjusted p = {adj:.3g}"
                c["verdict"] = "inconclusive"
    return claims


def _float(v: Any) -> float:
    return float(v) if v is not None else math.nan


def judge(claim, rep: dict[str, Any], n_boot: int = 2000) -> dict[str, Any]:
    """One claim's per-seed paired ratios, estimate, interval, tests and verdict (`inference.judge_ratios`),
    plus its registration status and, when the runs are outside the paper's regime, that verdict for the
    paper's claim: "not tested in regime"."""
    arms, base = rep["arms"], rep["baseline"]
    versus = claim.versus or base
    a, b = arms[claim.arm], arms[versus]
    out: dict[str, Any] = {"name": claim.name, "arm": claim.arm, "versus": versus, "kind": claim.kind,
                           "threshold": claim.threshold, "direction": claim.direction, "target": claim.target,
                           "series": claim.series, "stat": claim.stat, "keys": claim.keys,
                           "registration": rep.get("registration", {}).get(claim.name, NOT_RECORDED)}
    ev = CLAIM_KINDS.choose(claim.kind).judge(claim, a, b, rep)
    out.update(ev.extra)
    if ev.ratios is None:
        res = {"value": ev.value, "ci_low": math.nan, "ci_high": math.nan, "verdict": "inconclusive",
               "interval": "none", "per_seed": [], "agree": "n/a", "n": 0, "p": {}, "method": "none",
               "mdr": math.inf}
    else:
        res = judge_ratios(ev.ratios, claim.threshold, ev.more, claim.test, n_boot=n_boot, bounds=ev.bounds)
    out.update(res)
    out["claim"] = "more" if ev.more else "less"
    out["note"] = "; ".join(n for n in (ev.note, _diverged_note(rep, claim.arm, versus)) if n)
    # Only a claim registered before its runs is confirmatory; the others are exploratory, and say so.
    out["confirmatory"] = out["registration"] == PRE_REGISTERED
    paper = rep.get("paper") or {}
    out["paper_verdict"] = ("not tested in regime" if paper.get("in_regime") is False else
                            out["verdict"] if paper else "no paper regime stated")
    cal = (rep.get("calibration") or {}).get("mdr_noise")
    if cal is not None and math.isfinite(cal):
        out["mdr_noise"] = cal
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
