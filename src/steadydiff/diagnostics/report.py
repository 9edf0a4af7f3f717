"""`steadydiff diagnose`: stability statistics, plots and reports for finished runs, or at initialisation."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..data import fixed_subset, model_labels
from ..runs.metrics_log import read_metrics, series
from ..utils.io import atomic_write, atomic_write_text
from .stats import oscillation_summary

SENSITIVITY_TS = [0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 0.95]


def run_series(rows: list[dict[str, Any]], warmup: int) -> dict[str, list[float]]:
    """The series whose oscillation we summarise, after dropping steps <= warmup."""
    keys = ["loss", "grad/total", "probe/loss"] + sorted(
        {k for r in rows for k in r if k.startswith("probe/feat/norm/")})
    out = {}
    for k in keys:
        steps, vals = series(rows, k)
        vals = [v for s, v in zip(steps, vals) if s > warmup]
        if len(vals) >= 3:
            out[k] = vals
    return out


def _load_run(run_dir: Path):
    from ..data import load_dataset
    from ..runs import load_model

    loaded = load_model(run_dir)
    return loaded.cfg, loaded.model, loaded.formulation, load_dataset(loaded.cfg.data)


def _fixed_batch(ds, n: int, seed: int = 0):
    return fixed_subset(ds, n, torch.Generator().manual_seed(seed))


def _sensitivity(model, sde, x0, labels, num_classes: int, method: str = "ratio") -> dict[str, float]:
    """R(t) (finite perturbation ratio, whole batch) or the Jacobian spectral norm (power iteration, first 8
    samples: it costs ~20 JVP/VJP pairs per t) at each t of SENSITIVITY_TS."""
    from .sensitivity import sensitivity_vs_t

    lab = model_labels(labels, num_classes)
    if method == "jacobian":
        x0, lab = x0[:8], None if lab is None else lab[:8]
    res = sensitivity_vs_t(model, sde, x0, SENSITIVITY_TS, labels=lab, method=method,
                           generator=torch.Generator().manual_seed(0))
    return {f"{t:g}": float(v) for t, v in res.items()}


def diagnose_runs(run_dirs: list[Path], out_dir: Path, n_probe: int = 32, n_consistency: int = 32) -> dict:
    """Stability statistics of each run, overlay plots, and (for 2+ runs) sample consistency."""
    from ..diffusion import generate
    from .landscape import consistency_score

    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"runs": {}}
    curves: dict[str, list[dict[str, Any]]] = {}
    samples = {}
    for run in run_dirs:
        name = run.name if run.name not in report["runs"] else str(run)
        cfg, model, sde, ds = _load_run(run)
        rows = read_metrics(run)
        curves[name] = rows
        x0, labels = _fixed_batch(ds, n_probe)
        with torch.no_grad():
            entry = {
                "config": {"backbone": cfg.model.backbone, "skip_scaling": cfg.model.skip_scaling,
                           "kappa": cfg.model.kappa, "steps": cfg.train.steps},
                "oscillation": oscillation_summary(run_series(rows, cfg.train.warmup_steps),
                                                   warmup=0),
                "sensitivity_vs_t": _sensitivity(model, sde, x0, labels, cfg.model.num_classes),
                "jacobian_norm_vs_t": None,
                "final": {k: v for k, v in (rows[-1] if rows else {}).items() if k != "skip_coeffs"},
            }
        # The Jacobian needs gradients (JVP/VJP), outside no_grad.
        entry["jacobian_norm_vs_t"] = _sensitivity(model, sde, x0, labels, cfg.model.num_classes, "jacobian")
        report["runs"][name] = entry
        samples[name] = generate(model, sde, ds.sample_shape, n_consistency, sde.ode_sampler, 20, seed=0,
                                 num_classes=cfg.model.num_classes)
    names = list(samples)
    if len(names) > 1:
        report["consistency"] = {
            f"{a} vs {b}": consistency_score(samples[a], samples[b])
            for i, a in enumerate(names) for b in names[i + 1:]
        }
    write_report(report, out_dir)
    plot_runs(curves, report, out_dir)
    return report


def diagnose_at_init(cfg: Config, out_dir: Path, n_samples: int = 256) -> dict:
    """Init-time checks without training: ScaleLong's theory fit and input sensitivity vs t."""
    from ..data import load_dataset
    from ..diffusion import build_formulation
    from ..nn import build_model
    from .theory import theory_fit

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    ds = load_dataset(cfg.data)
    sde = build_formulation(cfg.diffusion)
    model = sde.wrap(build_model(cfg.model, ds.sample_shape)).eval()
    x0, labels = _fixed_batch(ds, 32)
    report: dict[str, Any] = {"at_init": True, "config": cfg.to_dict()}
    with torch.no_grad():
        report["sensitivity_vs_t"] = _sensitivity(model, sde, x0, labels, cfg.model.num_classes)
    report["jacobian_norm_vs_t"] = _sensitivity(model, sde, x0, labels, cfg.model.num_classes, "jacobian")
    try:
        report["theory"] = theory_fit(model, sde, [x0], n_samples, torch.Generator().manual_seed(0))
    except NotImplementedError as e:
        report["theory"] = {"skipped": str(e)}
    write_report({"runs": {"init": report}}, out_dir)
    plot_runs({"init": []}, {"runs": {"init": report}}, out_dir)
    return report


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_report(report: dict, out_dir: Path) -> None:
    atomic_write_text(out_dir / "stability.json", json.dumps(report, indent=2, default=float) + "\n")
    lines = ["# Stability report", ""]
    for name, entry in report["runs"].items():
        lines += [f"## {name}", ""]
        if "config" in entry and not entry.get("at_init"):
            lines.append("config: " + ", ".join(f"{k}={_fmt(v)}" for k, v in entry["config"].items()))
            lines.append("")
        osc = entry.get("oscillation", {})
        if osc:
            stats = sorted({s for d in osc.values() for s in d})
            lines += ["| series | " + " | ".join(stats) + " |", "|---" * (len(stats) + 1) + "|"]
            for key, d in osc.items():
                lines.append(f"| {key} | " + " | ".join(_fmt(d.get(s, "")) for s in stats) + " |")
            lines.append("")
        sens = entry.get("sensitivity_vs_t", {})
        jac = entry.get("jacobian_norm_vs_t") or {}
        if sens:
            lines += ["Input sensitivity: R(t) = ||f(x_t + d) - f(x_t)|| / ||d|| (||d|| = 1% of ||x_t||) and the "
                      "Jacobian spectral norm ||df/dx_t||_2 (power iteration):", "",
                      "| t | " + " | ".join(sens) + " |", "|---" * (len(sens) + 1) + "|",
                      "| R | " + " | ".join(_fmt(v) for v in sens.values()) + " |"]
            if jac:
                lines.append("| Jacobian | " + " | ".join(_fmt(jac.get(t, "")) for t in sens) + " |")
            lines.append("")
        theory = entry.get("theory")
        if theory:
            lines += ["ScaleLong theory check (||h_i||^2 ~ a ||x_t||^2 S_i + b at init): "
                      + ", ".join(f"{k}={_fmt(v)}" for k, v in theory.items() if not isinstance(v, list | dict)), ""]
    if "consistency" in report:
        lines += ["## Consistency (same noise tape; 1 = identical samples, 0 = unrelated)", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in report["consistency"].items()] + [""]
    atomic_write_text(out_dir / "stability.md", "\n".join(lines))


def plot_runs(curves: dict[str, list[dict[str, Any]]], report: dict, out_dir: Path) -> None:
    """feature_norms.png (one panel per decoder level, runs overlaid, as ScaleLong Fig. 1),
    grad_norm.png, sensitivity.png, magnitudes.png: whichever the runs have data for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name):
        fig.tight_layout()
        atomic_write(out_dir / name, lambda p: fig.savefig(p, format="png"))
        plt.close(fig)

    levels = sorted({k for rows in curves.values() for r in rows for k in r if k.startswith("probe/feat/norm/")})
    if levels:
        cols = min(4, len(levels))
        rows_n = math.ceil(len(levels) / cols)
        fig, axes = plt.subplots(rows_n, cols, figsize=(3.5 * cols, 2.8 * rows_n), squeeze=False)
        for ax, key in zip(axes.flat, levels):
            for name, rows in curves.items():
                ax.plot(*series(rows, key), lw=1, label=name)
            ax.set_title(key.rsplit("/", 1)[-1] + " (0 = outermost)", fontsize=9)
            ax.set_xlabel("step")
        axes.flat[0].set_ylabel("feature norm")
        axes.flat[0].legend(fontsize=7)
        save(fig, "feature_norms.png")
    if any(series(rows, "grad/total")[0] for rows in curves.values()):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for name, rows in curves.items():
            ax.plot(*series(rows, "grad/total"), lw=0.8, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title("gradient norm")
        ax.legend(fontsize=7)
        save(fig, "grad_norm.png")
    if any(e.get("sensitivity_vs_t") for e in report["runs"].values()):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
        for ax, key, title in zip(axes, ("sensitivity_vs_t", "jacobian_norm_vs_t"),
                                  ("perturbation ratio R(t)", "Jacobian spectral norm")):
            for name, e in report["runs"].items():
                d = e.get(key) or {}
                ax.plot([float(t) for t in d], list(d.values()), marker="o", label=name)
            ax.set_xlabel("t")
            ax.set_title(title)
        axes[0].legend(fontsize=7)
        save(fig, "sensitivity.png")
    mags = {}
    for name, rows in curves.items():  # the last logged magnitudes of each run
        last = next((r for r in reversed(rows) if any(k.startswith("mag/") for k in r)), {})
        mags[name] = {k: v for k, v in last.items() if k.startswith("mag/")}
    if any(mags.values()):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
        for ax, kind in zip(axes, ("act", "weight")):
            for name, d in mags.items():
                keys = [k for k in d if k.startswith(f"mag/{kind}/")]
                ax.plot(range(len(keys)), [d[k] for k in keys], marker=".", label=name)
                ax.set_xticks(range(len(keys)), [k.split("/", 2)[-1] for k in keys], rotation=90, fontsize=6)
            ax.set_title(f"{kind} RMS per block (last logged step)")
        axes[0].legend(fontsize=7)
        save(fig, "magnitudes.png")
