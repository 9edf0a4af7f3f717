"""Steps-to-target, speed-ups and bootstrap confidence intervals across seeds.

The question an experiment answers: how many training steps does an arm need to reach a quality target,
relative to the baseline? Definitions (all pure functions of the logged curves, tested on synthetic ones):

* A run's curve is its metric at the evaluation steps. Runs of one arm share the evaluation grid; a run that
  diverged (stopped with a non-finite loss) is *worst* from its last good evaluation on (+inf when lower is
  better), so it drags its arm's curve down and is never dropped.
* An arm's curve is the mean over its seeds at each grid step (the mean of the metric, not of steps-to-target:
  a per-seed target crossing is dominated by evaluation noise at the small seed counts we can afford).
* Targets are fixed in advance from the baseline's mean curve: its value at the final step and at the grid
  step nearest half the budget. (The baseline reaches its final target at the last step at the latest.)
* Steps to target: the first step at which the curve is at least as good as the target, linearly
  interpolated between the two evaluations that bracket the crossing; `inf` if it never gets there.
* Speed-up = baseline steps / arm steps. Its 95% CI: resample seeds with replacement, independently per arm,
  recompute both mean curves, the target *by the same rule* from the resampled baseline, and both crossings;
  percentile interval. Re-deriving the target matters: a target frozen at the observed baseline's final
  value would be missed by half of all baseline resamples (they end just above it), which says nothing
  about the arm. A resample in which the arm never reaches the target contributes a speed-up of 0;
  percentiles are taken without interpolation so such values stay meaningful.
* Paired seeds: in an experiment every arm runs the same seeds, and seed s fixes the data order, the noise
  levels and the noise of every step (and most of the initial weights) in every arm. Arms are then compared
  seed by seed: the bootstrap draws one set of seed indices and uses it for both arms (`paired=True`), so
  the seed-to-seed spread that both arms share cancels, as in a paired t-test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def fill_diverged(values: Sequence[float], n: int, lower_is_better: bool = True) -> np.ndarray:
    """A run's values on a grid of `n` evaluations; missing tail and non-finite values become the worst."""
    worst = math.inf if lower_is_better else -math.inf
    out = np.full(n, worst, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)[:n]
    out[: len(v)] = v
    out[~np.isfinite(out)] = worst
    # Once a run has gone bad it stays bad: a diverged run does not recover at a later evaluation.
    bad = np.flatnonzero(np.isinf(out))
    if len(bad):
        out[bad[0]:] = worst
    return out


def steps_to_target(steps: Sequence[float], values: Sequence[float], target: float,
                    lower_is_better: bool = True) -> float:
    """First step at which `values` reaches `target` (linear interpolation between evaluations); inf if never."""
    s = np.asarray(steps, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if s.shape != v.shape or s.ndim != 1:
        raise ValueError(f"steps and values must be 1-D of equal length, got {s.shape} and {v.shape}")
    sign = 1.0 if lower_is_better else -1.0
    gap = sign * (v - target)  # <= 0 once the target is reached
    hit = np.flatnonzero(np.nan_to_num(gap, nan=math.inf) <= 0)
    if len(hit) == 0:
        return math.inf
    i = int(hit[0])
    if i == 0 or not np.isfinite(gap[i - 1]):
        return float(s[i])
    # gap[i-1] > 0 >= gap[i]: the straight line between the two evaluations crosses zero in between.
    frac = gap[i - 1] / (gap[i - 1] - gap[i])
    return float(s[i - 1] + frac * (s[i] - s[i - 1]))


def mean_curve(curves: np.ndarray) -> np.ndarray:
    """Mean over seeds (rows); any infinite entry makes that step infinite (a diverged seed)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(curves, dtype=np.float64).mean(axis=0)


def baseline_targets(steps: Sequence[float], base_mean: Sequence[float]) -> dict[str, float]:
    """The two targets fixed in advance: the baseline's final value and its value at half the budget."""
    s = np.asarray(steps, dtype=np.float64)
    half = int(np.argmin(np.abs(s - s[-1] / 2)))
    return {"final": float(base_mean[-1]), "half": float(base_mean[half])}


def _ratio(base: float, arm: float) -> float:
    if math.isinf(arm):
        return math.nan if math.isinf(base) else 0.0
    if arm <= 0:
        return math.inf
    return base / arm


@dataclass
class SpeedUp:
    target: float
    base_steps: float
    arm_steps: float
    speedup: float
    ci_low: float
    ci_high: float
    undefined_frac: float  # resamples where neither arm reached the target (left out of the CI)

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def percentile_ci(samples: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile interval without interpolation (so +-inf samples give +-inf bounds, never nan)."""
    a = np.asarray(samples, dtype=np.float64)
    a = a[~np.isnan(a)]
    if len(a) == 0:
        return math.nan, math.nan
    alpha = (1 - level) / 2
    return (float(np.percentile(a, 100 * alpha, method="lower")),
            float(np.percentile(a, 100 * (1 - alpha), method="higher")))


def speedup_ci(steps: Sequence[float], base_curves: np.ndarray, arm_curves: np.ndarray, target: str = "final",
               lower_is_better: bool = True, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
               paired: bool = False) -> SpeedUp:
    """Speed-up of the arm over the baseline at the baseline's `target` ("final" | "half"), with a seed-
    bootstrap CI (see the module docstring).

    `base_curves`, `arm_curves`: (seeds, len(steps)) arrays on the shared grid, already `fill_diverged`.
    `paired`: row i of both arrays comes from the same seed; resample rows jointly (the baseline against
    itself then gives exactly 1).
    """
    base_curves = np.asarray(base_curves, dtype=np.float64)
    arm_curves = np.asarray(arm_curves, dtype=np.float64)

    def one(bc: np.ndarray, ac: np.ndarray) -> tuple[float, float, float]:
        bm = mean_curve(bc)
        tv = baseline_targets(steps, bm)[target]
        return (tv, steps_to_target(steps, bm, tv, lower_is_better),
                steps_to_target(steps, mean_curve(ac), tv, lower_is_better))

    tv, b, a = one(base_curves, arm_curves)
    rng = np.random.default_rng(seed)
    ratios = np.empty(n_boot)
    for i in range(n_boot):
        bi = rng.integers(0, len(base_curves), len(base_curves))
        ai = bi if paired else rng.integers(0, len(arm_curves), len(arm_curves))
        _, bb, ab = one(base_curves[bi], arm_curves[ai])
        ratios[i] = _ratio(bb, ab)
    lo, hi = percentile_ci(ratios, level)
    return SpeedUp(tv, b, a, _ratio(b, a), lo, hi, float(np.isnan(ratios).mean()))


def ratio_of_means_ci(base: Sequence[float], arm: Sequence[float], n_boot: int = 2000, seed: int = 0,
                      level: float = 0.95, paired: bool = False) -> tuple[float, float, float]:
    """mean(arm) / mean(base) with a seed-bootstrap percentile CI: for stability statistics and final metrics.
    `paired`: entry i of both comes from the same seed; resample them jointly."""
    base = np.asarray(base, dtype=np.float64)
    arm = np.asarray(arm, dtype=np.float64)
    if len(base) == 0 or len(arm) == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(arm.mean() / base.mean())
        boots = []
        for _ in range(n_boot):
            bi = rng.integers(0, len(base), len(base))
            ai = bi if paired else rng.integers(0, len(arm), len(arm))
            boots.append(arm[ai].mean() / base[bi].mean())
    lo, hi = percentile_ci(boots, level)
    return point, lo, hi


def verdict(low: float, high: float, threshold: float, higher_is_better: bool = True) -> str:
    """`holds` if the whole CI is on the claimed side of `threshold`, `does not hold` if it is wholly on the
    other side (or touches it from there), `inconclusive` if it straddles it (or is undefined)."""
    if math.isnan(low) or math.isnan(high):
        return "inconclusive"
    if higher_is_better:
        if low > threshold:
            return "holds"
        if high <= threshold:
            return "does not hold"
    else:
        if high < threshold:
            return "holds"
        if low >= threshold:
            return "does not hold"
    return "inconclusive"
