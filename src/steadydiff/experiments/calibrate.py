"""Metric calibration (`steadydiff compare EXP --out DIR --calibrate`): how noisy is the metric an experiment
judges, and so which effects can its design resolve?

At the final checkpoint of chosen runs (`calibrate: {arms, seeds}`; default: the baseline's first seed) the
metric is measured `repeats` times (default 5) independently:
- `eval/<metric>` (a sample-quality metric): with `repeats` independent sampling seeds at the size the runs
  use (`n`, default train.eval_n), and once at `reference_n` (default 4 n) as a large-n reference;
- `val/loss`, `val/ema_loss`: on `repeats` independently drawn validation sets of diagnostics.val_size
  examples (independent subsets, noise levels and noise; the reference is one set of `reference_n`).
Reported: mean, sd, coefficient of variation, the bias of the n-sample mean against the reference, and
`mdr_noise`, the smallest ratio a paired design with the experiment's seed count could resolve if metric
noise were the only seed-to-seed variation (log-ratio sd = sqrt(2) cv). The observed per-seed spread of each
claim gives its own, larger, minimum detectable ratio (`inference.judge_ratios`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.errors import ConfigError
from ..utils.io import atomic_write_text
from .inference import minimum_detectable_ratio
from .runner import run_dir
from .spec import Experiment

FILE = "calibration.json"


def read_calibration(out: Path) -> dict[str, Any]:
    path = Path(out) / FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _eval_values(loaded, name: str, n: int, reference_n: int, repeats: int) -> tuple[list[float], float]:
    from ..data import load_dataset
    from ..metrics.evaluate import evaluate

    cfg = loaded.cfg
    ds = load_dataset(cfg.data)
    t = cfg.train

    def one(size: int, seed: int) -> float:
        return float(evaluate(loaded.model, loaded.formulation, cfg, ds, [name], size, t.sample_sampler,
                              t.sample_steps, seed=seed, clip=t.sample_clip, batch=t.eval_batch)[name])

    return [one(n, 1000 + j) for j in range(repeats)], one(reference_n, 999)


def _val_values(loaded, key: str, size: int, reference_n: int, repeats: int) -> tuple[list[float], float]:
    from ..data import load_dataset
    from ..diagnostics.base import RunContext
    from ..diagnostics.validation import ValidationSet, summarize, validation_losses

    cfg = loaded.cfg
    d = cfg.diagnostics
    ctx = RunContext(cfg, load_dataset(cfg.data), loaded.formulation, loaded.model)

    def one(n: int, seed: int) -> float:
        val = ValidationSet.create(ctx, n, d.val_bins, seed)
        return summarize("v", validation_losses(loaded.model, loaded.formulation, val, d.val_batch), val.bin,
                         val.num_bins)["v"]

    return [one(size, d.val_seed + 1 + j) for j in range(repeats)], one(reference_n, d.val_seed + 1000)


def _values(loaded, metric: str, n: int, reference_n: int, repeats: int) -> tuple[list[float], float]:
    if metric.startswith("eval/"):
        return _eval_values(loaded, metric.removeprefix("eval/"), n, reference_n, repeats)
    if metric in ("val/loss", "val/ema_loss"):
        return _val_values(loaded, metric, n, reference_n, repeats)
    raise ConfigError(f"cannot calibrate {metric!r}: calibration re-measures eval/<metric>, val/loss or val/ema_loss")


def _default_size(cfg, metric: str) -> int:
    return cfg.train.eval_n if metric.startswith("eval/") else cfg.diagnostics.val_size


def run_calibration(exp: Experiment, out: Path) -> dict[str, Any]:
    """Measure the noise of each calibrated metric (`calibrate: {metrics, sizes}`; default the experiment's
    metric at the runs' own size) on the finished runs `exp.calibrate` names; writes OUT/calibration.json.
    `sizes: {metric: [n, ...]}` measures a metric at several sample sizes, to choose one."""
    from ..runs import load_model

    cal = exp.calibrate
    repeats = int(cal.get("repeats", 5))
    metrics = list(cal.get("metrics", [exp.metric]))
    rows = []
    for arm in cal.get("arms", [exp.baseline]):
        for seed in cal.get("seeds", exp.seeds[:1]):
            rdir = run_dir(out, arm, seed)
            for metric in metrics:
                loaded = load_model(rdir, use_ema=metric != "val/loss")  # val/loss is the raw model's
                sizes = cal.get("sizes", {}).get(metric) or [int(cal.get("n", _default_size(loaded.cfg, metric)))]
                for n in sizes:
                    ref_n = int(cal.get("reference_n", 4 * max(sizes)))
                    values, ref = _values(loaded, metric, int(n), ref_n, repeats)
                    v = np.asarray(values)
                    rows.append({"metric": metric, "arm": arm, "seed": seed, "step": loaded.step, "n": int(n),
                                 "values": values, "mean": float(v.mean()), "sd": float(v.std(ddof=1)),
                                 "reference": ref, "reference_n": ref_n, "bias": float(v.mean() - ref)})
    # The experiment's own metric at the runs' size sets the noise floor quoted beside the claims.
    own = [r for r in rows if r["metric"] == exp.metric] or rows
    cv = float(np.sqrt(np.mean([(r["sd"] / r["mean"]) ** 2 for r in own])))
    result = {"metric": exp.metric, "repeats": repeats, "runs": rows, "cv": cv, "seeds": len(exp.seeds),
              "mdr_noise": minimum_detectable_ratio(math.sqrt(2.0) * cv, len(exp.seeds))}
    atomic_write_text(Path(out) / FILE, json.dumps(result, indent=1) + "\n")
    return result
