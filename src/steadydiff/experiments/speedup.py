"""Speed-ups as time shifts between metric curves.

The question an experiment answers: how much sooner (in training steps) does an arm get where the baseline
gets? Definitions (pure functions of the logged curves, tested on curves with closed-form answers):

* A run's curve is its metric at the evaluation steps. Runs of one arm share the evaluation grid; a run that
  diverged (stopped with a non-finite loss) is *worst* from its last good evaluation on (+inf when lower is
  better), so it drags its arm down and is never dropped.
* Time-shift speed-up at a fraction f of the budget S (`time_shift`): the arm's value at step f S is reached
  by the baseline at step b, and the speed-up is b / (f S). It degrades gracefully: an arm 2% behind at the
  end scores a little below 1, where a "steps to the baseline's final value" reads "never". The reverse
  shift (the arm's step to reach the baseline's value at f S) is reported beside it.
* Crossings (`reach_step`) are the first step at which a curve is at least as good as the value, linearly
  interpolated between the two evaluations that bracket it; past the last evaluation the last segment is
  followed for at most one evaluation interval (flagged "extrapolated"); further out, or before the first
  evaluation, the speed-up is reported as a bound.
* Per-seed speed-ups come from the paired curves of one seed (seed s fixes the data order, noise levels and
  noise in every arm); `inference.judge_ratios` turns them into an estimate, an interval and a verdict. The
  seed-mean curves give the point shown in plots and tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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


# Flags of `reach_step`: how the step was found, and so which way a ratio built from it is bounded.
INTERPOLATED, EXTRAPOLATED, BEYOND, BEFORE = "", "extrapolated", "beyond", "before"


def value_at(steps: Sequence[float], values: Sequence[float], step: float) -> float:
    """The curve's value at `step`, linearly interpolated between evaluations (step within the grid)."""
    s = np.asarray(steps, dtype=np.float64)
    if not s[0] <= step <= s[-1]:
        raise ValueError(f"step {step} is outside the evaluation grid {s[0]}..{s[-1]}")
    return float(np.interp(step, s, np.asarray(values, dtype=np.float64)))


def reach_step(steps: Sequence[float], values: Sequence[float], target: float,
               lower_is_better: bool = True) -> tuple[float, str]:
    """(step, flag): when the curve first reaches `target`, with at most one evaluation interval of
    extrapolation past the last evaluation.

    flag "" : interpolated between the two evaluations that bracket the crossing (`steps_to_target`);
    "extrapolated": past the last evaluation, on the straight line through the last two, within one interval;
    "beyond": not reached even so: the step returned (last + one interval) is a LOWER bound;
    "before": already reached at the first evaluation: the step returned (the first) is an UPPER bound.
    """
    s = np.asarray(steps, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    sign = 1.0 if lower_is_better else -1.0
    hit = steps_to_target(s, v, target, lower_is_better)
    if math.isfinite(hit):
        gap0 = sign * (v[0] - target)
        return hit, BEFORE if hit == s[0] and gap0 < 0 else INTERPOLATED
    interval = float(s[-1] - s[-2]) if len(s) > 1 else float(s[-1])
    with np.errstate(invalid="ignore"):  # a diverged tail (inf - inf) has no slope
        slope = (v[-1] - v[-2]) / interval if len(s) > 1 else 0.0
    if np.isfinite(v[-1]) and sign * slope < 0:  # still improving: follow the last segment
        step = float(s[-1] + (target - v[-1]) / slope)
        if step <= s[-1] + interval:
            return step, EXTRAPOLATED
    return float(s[-1] + interval), BEYOND


def monotone_fit(steps: Sequence[float], values: Sequence[float], lower_is_better: bool = True) -> np.ndarray:
    """The curve's best monotone (never-worsening) least-squares approximation, by pool-adjacent-violators,
    read back at the evaluation steps along straight lines through the pooled blocks' centres (and along the
    end segments beyond them). Where the data improve it is strictly monotone, so every value is reached at
    exactly one step: evaluation noise cannot make a curve "reach" a value early through a lucky dip, and a
    curve compared with itself is shifted by exactly 0. A curve with a non-finite value (a diverged run) is
    returned as it is."""
    s = np.asarray(steps, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64) * (1.0 if lower_is_better else -1.0)  # to be non-increasing
    if not np.all(np.isfinite(y)) or len(y) < 2:
        return np.asarray(values, dtype=np.float64).copy()
    blocks: list[list[float]] = []  # [sum of y, count, sum of steps]
    for xi, yi in zip(s, y):
        blocks.append([yi, 1.0, xi])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            ys, n, xs = blocks.pop()
            blocks[-1][0] += ys
            blocks[-1][1] += n
            blocks[-1][2] += xs
    level = np.array([b[0] / b[1] for b in blocks])
    centre = np.array([b[2] / b[1] for b in blocks])
    if len(blocks) == 1:
        fit = np.full_like(y, level[0])
    else:
        fit = np.interp(s, centre, level)
        lo, hi = s < centre[0], s > centre[-1]
        fit[lo] = level[0] + (s[lo] - centre[0]) * (level[1] - level[0]) / (centre[1] - centre[0])
        fit[hi] = level[-1] + (s[hi] - centre[-1]) * (level[-1] - level[-2]) / (centre[-1] - centre[-2])
    return fit * (1.0 if lower_is_better else -1.0)


def time_shift(steps: Sequence[float], base: Sequence[float], arm: Sequence[float], fraction: float = 1.0,
               lower_is_better: bool = True) -> dict[str, float | str]:
    """Speed-up of the arm at `fraction` of the baseline's budget S, as a shift in time.

    forward: the arm's value at step f S is reached by the baseline at step b; speed-up = b / (f S). An arm
        2% behind at the end gets a little under 1 (the baseline got there a little earlier), not 0.
    reverse: the baseline's value at f S is reached by the arm at step a; speed-up = f S / a.
    Each comes with the `reach_step` flag of its crossing: a "beyond" or "before" crossing makes the
    speed-up a bound (forward: beyond -> at least, before -> at most; reverse: the other way round).
    Both curves are first replaced by their `monotone_fit`.
    """
    base = monotone_fit(steps, base, lower_is_better)
    arm = monotone_fit(steps, arm, lower_is_better)
    s_f = fraction * float(steps[-1])
    b, b_flag = reach_step(steps, base, value_at(steps, arm, s_f), lower_is_better)
    a, a_flag = reach_step(steps, arm, value_at(steps, base, s_f), lower_is_better)
    return {"fraction": fraction, "step": s_f, "forward": b / s_f, "forward_flag": b_flag,
            "reverse": s_f / a if a > 0 else math.inf, "reverse_flag": a_flag}


def bound_of(flag: str, forward: bool) -> str:
    """'>=' / '<=' when a time-shift speed-up with this crossing flag is a bound, '' when it is a value."""
    if flag == BEYOND:
        return ">=" if forward else "<="
    if flag == BEFORE:
        return "<=" if forward else ">="
    return ""


def mean_curve(curves: np.ndarray) -> np.ndarray:
    """Mean over seeds (rows); any infinite entry makes that step infinite (a diverged seed)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(curves, dtype=np.float64).mean(axis=0)
