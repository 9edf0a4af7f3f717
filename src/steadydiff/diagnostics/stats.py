"""Oscillation statistics of 1-D training curves (loss, gradient norm, feature norms, ...).

Every function takes a 1-D sequence of values (list, numpy array or CPU tensor; converted to numpy float64)
and returns python floats (or ints). The warm-up is dropped before anything is computed:

* `steps=None`: `warmup` is a COUNT of points, and the first `warmup` values are dropped;
* `steps` given (same length as the values): `warmup` is a STEP, and the points with `step < warmup` are
  dropped. Steps are only used for this selection; every statistic treats the kept points as consecutive.

Dropped points are gone: they are neither judged nor used as history (e.g. by `count_spikes`). Non-finite
values are not filtered; they propagate into the result (typically nan). Statistics that are undefined for
a series (too few points, a zero mean, non-positive values for logarithms) raise `ValueError`;
`oscillation_summary` reports those as nan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "coefficient_of_variation",
    "count_spikes",
    "detrended_cv",
    "detrended_std",
    "growth",
    "log_residual_std",
    "max_to_median",
    "mean_abs_delta",
    "median_abs_log_delta",
    "moving_average",
    "oscillation_summary",
    "spike_fraction",
    "spike_indices",
    "spike_ratio",
    "trailing_median",
]

ArrayLike = Any  # a 1-D sequence of numbers: list, tuple, numpy array, CPU tensor


def _as_1d(x: ArrayLike, name: str = "x") -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (possibly requiring grad)
        x = x.detach().cpu().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def _kept(x: ArrayLike, warmup: float, steps: ArrayLike | None) -> tuple[np.ndarray, np.ndarray | slice]:
    """(all values, selector of the kept ones): the first `warmup` points dropped, or those with step < warmup."""
    arr = _as_1d(x)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if steps is None:
        if warmup != int(warmup):
            raise ValueError(f"warmup is a count of points when steps is None, got {warmup}")
        return arr, slice(int(warmup), None)
    st = _as_1d(steps, "steps")
    if st.shape != arr.shape:
        raise ValueError(f"steps has {st.shape[0]} entries, values have {arr.shape[0]}")
    return arr, st >= warmup


def _drop_warmup(x: ArrayLike, warmup: float, steps: ArrayLike | None) -> np.ndarray:
    """The kept values: the first `warmup` points dropped, or the points with step < warmup if `steps`."""
    arr, sel = _kept(x, warmup, steps)
    return arr[sel]


def _need(arr: np.ndarray, n: int, what: str) -> None:
    if arr.shape[0] < n:
        raise ValueError(f"{what} needs at least {n} point(s) after the warm-up, got {arr.shape[0]}")


# ---------------------------------------------------------------------------------------------------------


def moving_average(x: ArrayLike, window: int) -> np.ndarray:
    """Centred moving average m of a 1-D series, same length as x (numpy float64).

    With h = window // 2, the average at point i is taken over the symmetric window x[i - h_i .. i + h_i],
    h_i = min(h, i, n - 1 - i): in the interior every window has exactly 2h + 1 points (`window` if it is
    odd; an even window is widened by one so that it stays centred), and near either end the window shrinks
    SYMMETRICALLY, down to the point itself at the first and last point. Because every window is centred,
    m reproduces an affine trend a + b i exactly at every point, edges included. `window` <= 1 returns a
    copy of x.
    """
    arr = _as_1d(x)
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    n = arr.shape[0]
    if n == 0 or window == 1:
        return arr.copy()
    h = min(window // 2, (n - 1) // 2)
    out = np.empty(n)
    if n > 2 * h:  # interior: full windows, direct sums (no cumulative-sum cancellation)
        out[h:n - h] = np.convolve(arr, np.full(2 * h + 1, 1.0 / (2 * h + 1)), mode="valid")
    for i in range(h):  # edges: symmetric windows of 2i + 1 points
        out[i] = arr[: 2 * i + 1].mean()
        out[n - 1 - i] = arr[n - 1 - 2 * i:].mean()
    return out


def detrended_std(x: ArrayLike, window: int = 20, warmup: float = 0, *, steps: ArrayLike | None = None) -> float:
    """Population std (ddof=0) of r = x - moving_average(x, window), on the series AFTER the warm-up.

    The moving average (see `moving_average`) is computed on the kept points only, so the warm-up does not
    leak into the trend. An affine trend gives exactly 0; a trend plus an alternating +-a gives
    a (1 - 1/(2 (window // 2) + 1)) in the interior (the centred window holds one more point of one sign).
    """
    arr = _drop_warmup(x, warmup, steps)
    _need(arr, 1, "detrended_std")
    return float(np.std(arr - moving_average(arr, window)))


def coefficient_of_variation(x: ArrayLike, warmup: float = 0, *, steps: ArrayLike | None = None) -> float:
    """std(x) / mean(x) after the warm-up, population std (ddof=0). Raises ValueError if the mean is 0.

    The sign follows the mean (intended for positive series such as losses).
    """
    arr = _drop_warmup(x, warmup, steps)
    _need(arr, 1, "coefficient_of_variation")
    mean = float(np.mean(arr))
    if mean == 0.0:
        raise ValueError("coefficient_of_variation is undefined for a series with mean 0")
    return float(np.std(arr)) / mean


def median_abs_log_delta(x: ArrayLike, warmup: float = 0, *, steps: ArrayLike | None = None) -> float:
    """median_k |log x_{k+1} - log x_k| over consecutive kept points (needs x > 0 and >= 2 points).

    A geometric series x_k = c r^k gives exactly |log r|.
    """
    arr = _drop_warmup(x, warmup, steps)
    _need(arr, 2, "median_abs_log_delta")
    if not np.all(arr > 0):
        raise ValueError("median_abs_log_delta needs strictly positive values")
    return float(np.median(np.abs(np.diff(np.log(arr)))))


def spike_ratio(x: ArrayLike, warmup: float = 0, q: float = 99, *, steps: ArrayLike | None = None) -> float:
    """percentile_q(x) / median(x) after the warm-up (numpy's default linear-interpolated percentile).

    Needs a positive median (ValueError otherwise). A constant positive series gives 1.
    """
    arr = _drop_warmup(x, warmup, steps)
    _need(arr, 1, "spike_ratio")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    med = float(np.median(arr))
    if not med > 0:
        raise ValueError(f"spike_ratio needs a positive median, got {med}")
    return float(np.percentile(arr, q)) / med


def mean_abs_delta(x: ArrayLike, warmup: float = 0, *, steps: ArrayLike | None = None) -> float:
    """mean_k |x_{k+1} - x_k| over consecutive kept points (needs >= 2 points)."""
    arr = _drop_warmup(x, warmup, steps)
    _need(arr, 2, "mean_abs_delta")
    return float(np.mean(np.abs(np.diff(arr))))


def trailing_median(y: ArrayLike, window: int = 50, min_history: int = 5) -> np.ndarray:
    """Trailing running median m of a 1-D series y (no warm-up handling), same length as y (numpy float64).

        m_i = median(y_{max(0, i - window)} .. y_{i-1})      for i >= min_history,
        m_i = nan                                          for i <  min_history (point not judged),

    i.e. the median of the (up to) `window` points BEFORE i, the point itself excluded: i predecessors while
    i < window, exactly `window` of them from i = window on. Point i is "judged" iff i >= min_history (it
    has at least `min_history` predecessors); with min_history >= window every judged point has a full window.
    Needs window >= 1 and min_history >= 1 (ValueError otherwise). A nan inside a window makes that m_i nan.
    """
    window = int(window)
    min_history = int(min_history)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if min_history < 1:
        raise ValueError(f"min_history must be >= 1, got {min_history}")
    arr = _as_1d(y, "y")
    n = arr.shape[0]
    med = np.full(n, np.nan)
    first_full = max(window, min_history)
    if n > first_full:  # full windows, vectorised: row r = y[r : r + window] is the history of point r + window
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], window)
        med[first_full:] = np.median(windows[first_full - window:], axis=1)
    for i in range(min_history, min(window, n)):  # partial history: all predecessors y[0 : i]
        med[i] = np.median(arr[:i])
    return med


def spike_indices(
    x: ArrayLike,
    k: float = 3.0,
    window: int = 50,
    warmup: float = 0,
    *,
    min_history: int = 5,
    steps: ArrayLike | None = None,
) -> list[int]:
    """Indices (into the ORIGINAL series, warm-up included) of the spikes that `count_spikes` counts.

    Spike rule, on the kept points y_0, y_1, ... (after the warm-up): y_i is a spike iff

        y_i > k * median(y_{max(0, i - window)} .. y_{i-1})

    i.e. the trailing median of (up to) the `window` preceding kept points, the point itself excluded (see
    `trailing_median`). A point with fewer than `min_history` kept predecessors is not judged (never a spike).
    Spikes stay in the history of later points (the median is robust to a few of them). Intended for positive
    series.
    """
    arr, sel = _kept(x, warmup, steps)
    kept = np.arange(arr.shape[0])[sel]
    y = arr[kept]
    with np.errstate(invalid="ignore"):
        is_spike = y > k * trailing_median(y, window, min_history)  # nan (not judged) compares False
    return [int(i) for i in kept[is_spike]]


def count_spikes(
    x: ArrayLike,
    k: float = 3.0,
    window: int = 50,
    warmup: float = 0,
    *,
    min_history: int = 5,
    steps: ArrayLike | None = None,
) -> int:
    """Number of points x_i > k * (trailing median of the `window` preceding points); see `spike_indices`."""
    return len(spike_indices(x, k, window, warmup, min_history=min_history, steps=steps))


def _judged(
    x: ArrayLike, window: int, warmup: float, min_history: int, steps: ArrayLike | None, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kept values, judged values y_i, their trailing medians m_i); ValueError if no point can be judged."""
    arr = _drop_warmup(x, warmup, steps)
    med = trailing_median(arr, window, min_history)  # validates window and min_history
    _need(arr, int(min_history) + 1, f"{what} (min_history={int(min_history)})")
    judged = slice(int(min_history), None)
    return arr, arr[judged], med[judged]


def spike_fraction(
    x: ArrayLike,
    factor: float = 5.0,
    window: int = 50,
    warmup: float = 0,
    *,
    min_history: int = 5,
    steps: ArrayLike | None = None,
) -> float:
    """Fraction of the judged points that are spikes: #{i judged : y_i > factor * m_i} / #{i judged}.

    On the kept points y_0, y_1, ... (after the warm-up), m_i is the trailing median of the (up to) `window`
    preceding kept points, the point itself excluded, and point i is judged iff it has at least
    `min_history` kept predecessors (see `trailing_median`; the same rule as `spike_indices`, so
    spike_fraction * #judged == count_spikes(x, k=factor, ...)). Needs at least min_history + 1 kept points
    (ValueError otherwise). A nan y_i or m_i counts as judged but not as a spike. Unlike `spike_ratio` (a
    percentile), it sees rare spikes; on a monotone trend without spikes it is 0 for factor >= 1 whenever
    the trend changes by less than `factor` over a window. Intended for positive series.
    """
    _, y, m = _judged(x, window, warmup, min_history, steps, "spike_fraction")
    with np.errstate(invalid="ignore"):
        return float(np.count_nonzero(y > factor * m)) / y.shape[0]


def max_to_median(
    x: ArrayLike,
    window: int = 50,
    warmup: float = 0,
    *,
    min_history: int = 5,
    steps: ArrayLike | None = None,
) -> float:
    """max over the judged points of y_i / m_i: the largest value relative to its local (trailing) level.

    y, m_i and "judged" as in `spike_fraction` (trailing median of the up to `window` preceding kept points;
    points with at least `min_history` kept predecessors). Needs at least min_history + 1 kept points and
    m_i > 0 at every judged point (ValueError otherwise); a nan y_i or m_i makes the result nan. A constant
    positive series gives 1; a decreasing series without spikes gives < 1.
    """
    _, y, m = _judged(x, window, warmup, min_history, steps, "max_to_median")
    if np.any(m <= 0):
        raise ValueError("max_to_median needs positive trailing medians")
    return float(np.max(y / m))


def log_residual_std(
    x: ArrayLike,
    window: int = 50,
    warmup: float = 0,
    *,
    min_history: int = 5,
    steps: ArrayLike | None = None,
) -> float:
    """Population std (ddof=0) over the judged points of log(y_i / m_i).

    y, m_i and "judged" as in `spike_fraction` (trailing median of the up to `window` preceding kept points;
    points with at least `min_history` kept predecessors). Needs every kept value > 0 and at least
    min_history + 1 kept points (ValueError otherwise). Scale-free and insensitive to a smooth trend: a
    geometric series c r^k gives exactly 0 (up to rounding) when min_history >= window, since every judged
    point then has a full window and y_i / m_i is the same constant; with partial windows (i < window) the
    ratio drifts over the first points.
    """
    arr, y, m = _judged(x, window, warmup, min_history, steps, "log_residual_std")
    if not np.all(arr > 0):
        raise ValueError("log_residual_std needs strictly positive values")
    return float(np.std(np.log(y / m)))


def growth(x: ArrayLike, warmup: float = 0, *, frac: float = 0.1, steps: ArrayLike | None = None) -> float:
    """mean of the last `frac` of the kept points over the mean of the first `frac` (at least one point each;
    needs >= 2 points and a non-zero first mean): how far a series (e.g. a feature norm) grew over the run."""
    arr = _drop_warmup(x, warmup, steps)
    _need(arr, 2, "growth")
    k = max(1, int(round(frac * arr.shape[0])))
    first = float(np.mean(arr[:k]))
    if first == 0.0:
        raise ValueError("growth: the first points average to 0")
    return float(np.mean(arr[-k:])) / first


def detrended_cv(x: ArrayLike, window: int = 21, warmup: float = 0, *, steps: ArrayLike | None = None) -> float:
    """std(r) / mean(a), population std (ddof=0), with a the CENTRED moving average and r = y - a, both only
    at the positions where the full window fits.

    On the kept points y_0 .. y_{n-1} (after the warm-up), with h = window // 2 (windows have 2h + 1 points:
    `window` if it is odd; an even window is widened by one, as in `moving_average`):

        a_i = mean(y_{i-h} .. y_{i+h}),  r_i = y_i - a_i,   for h <= i <= n - 1 - h.

    Needs window >= 1, at least 2h + 1 kept points and mean(a) != 0 (ValueError otherwise); the sign follows
    mean(a). An affine trend gives exactly 0 (up to rounding), unlike `coefficient_of_variation`, which
    measures the trend itself.
    """
    arr = _drop_warmup(x, warmup, steps)
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    h = window // 2
    _need(arr, 2 * h + 1, f"detrended_cv (window={2 * h + 1})")
    n = arr.shape[0]
    a = moving_average(arr, 2 * h + 1)[h:n - h]  # the full centred windows only
    mean = float(np.mean(a))
    if mean == 0.0:
        raise ValueError("detrended_cv is undefined when the moving average has mean 0")
    return float(np.std(arr[h:n - h] - a)) / mean


# ---------------------------------------------------------------------------------------------------------


def _safe(fn, *args, **kwargs) -> float:
    try:
        return float(fn(*args, **kwargs))
    except ValueError:
        return math.nan


def oscillation_summary(
    series: Mapping[str, ArrayLike],
    warmup: float = 0,
    *,
    steps: ArrayLike | Mapping[str, ArrayLike] | None = None,
    window: int = 20,
    q: float = 99,
    spike_k: float = 3.0,
    spike_window: int = 50,
) -> dict[str, dict[str, float]]:
    """All statistics above for every named series, after the same warm-up.

    `steps` is either one sequence shared by all series, or a mapping name -> steps (missing names: no steps,
    so `warmup` counts points for them). Returns {name: {stat: value}} with the keys

        n (kept points), mean, detrended_std, cv, median_abs_log_delta, spike_ratio, mean_abs_delta, spikes,
        spike_frac_5x, spike_frac_3x, max_to_median, log_residual_std, detrended_cv, growth

    where detrended_std and detrended_cv use `window` (detrended_cv: 2 (window // 2) + 1 points, as
    detrended_std's moving average), spike_ratio uses `q`, spikes = count_spikes with `spike_k`, and
    spike_frac_5x / spike_frac_3x (= spike_fraction with factor 5 / 3), max_to_median and log_residual_std
    use the trailing median over `spike_window` (default min_history), and growth is last over first tenth.

    A statistic that is undefined for a series (e.g. logs of a series with non-positive values, too few
    points) is reported as nan, so every series has the same keys.
    """
    out: dict[str, dict[str, float]] = {}
    for name, values in series.items():
        st = steps.get(name) if isinstance(steps, Mapping) else steps
        kept = _drop_warmup(values, warmup, st)
        out[name] = {
            "n": float(kept.shape[0]),
            "mean": float(np.mean(kept)) if kept.shape[0] else math.nan,
            "detrended_std": _safe(detrended_std, kept, window),
            "cv": _safe(coefficient_of_variation, kept),
            "median_abs_log_delta": _safe(median_abs_log_delta, kept),
            "spike_ratio": _safe(spike_ratio, kept, 0, q),
            "mean_abs_delta": _safe(mean_abs_delta, kept),
            "spikes": float(count_spikes(kept, spike_k, spike_window)),
            "spike_frac_5x": _safe(spike_fraction, kept, 5.0, spike_window),
            "spike_frac_3x": _safe(spike_fraction, kept, 3.0, spike_window),
            "max_to_median": _safe(max_to_median, kept, spike_window),
            "log_residual_std": _safe(log_residual_std, kept, spike_window),
            "detrended_cv": _safe(detrended_cv, kept, window),
            "growth": _safe(growth, kept),
        }
    return out
