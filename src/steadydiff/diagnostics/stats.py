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
    "detrended_std",
    "mean_abs_delta",
    "median_abs_log_delta",
    "moving_average",
    "oscillation_summary",
    "spike_indices",
    "spike_ratio",
]

ArrayLike = Any  # a 1-D sequence of numbers: list, tuple, numpy array, CPU tensor


def _as_1d(x: ArrayLike, name: str = "x") -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (possibly requiring grad)
        x = x.detach().cpu().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def _drop_warmup(x: ArrayLike, warmup: float, steps: ArrayLike | None) -> np.ndarray:
    """The kept values: the first `warmup` points dropped, or the points with step < warmup if `steps`."""
    arr = _as_1d(x)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if steps is None:
        if warmup != int(warmup):
            raise ValueError(f"warmup is a count of points when steps is None, got {warmup}")
        return arr[int(warmup):]
    st = _as_1d(steps, "steps")
    if st.shape != arr.shape:
        raise ValueError(f"steps has {st.shape[0]} entries, values have {arr.shape[0]}")
    return arr[st >= warmup]


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

    i.e. the trailing median of (up to) the `window` preceding kept points, the point itself excluded. A point
    with fewer than `min_history` kept predecessors is not judged (never a spike). Spikes stay in the history
    of later points (the median is robust to a few of them). Intended for positive series.
    """
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if min_history < 1:
        raise ValueError(f"min_history must be >= 1, got {min_history}")
    arr = _as_1d(x)
    if steps is None:
        _drop_warmup(arr, warmup, None)  # validates warmup
        kept = np.arange(int(warmup), arr.shape[0])
    else:
        st = _as_1d(steps, "steps")
        if st.shape != arr.shape:
            raise ValueError(f"steps has {st.shape[0]} entries, values have {arr.shape[0]}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        kept = np.flatnonzero(st >= warmup)
    y = arr[kept]
    n = y.shape[0]
    start = max(min_history, 1)
    if n <= start:
        return []
    med = np.full(n, np.nan)
    # Points with a full window of history: vectorised over sliding windows y[i - window : i].
    if n > window:
        windows = np.lib.stride_tricks.sliding_window_view(y[:-1], window)  # row r = y[r : r + window]
        med[window:] = np.median(windows, axis=1)
    for i in range(start, min(window, n)):  # partial history: all predecessors y[0 : i]
        med[i] = np.median(y[:i])
    judged = np.arange(n) >= start
    with np.errstate(invalid="ignore"):
        is_spike = judged & (y > k * med)
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

        n (kept points), mean, detrended_std, cv, median_abs_log_delta, spike_ratio, mean_abs_delta, spikes

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
        }
    return out
