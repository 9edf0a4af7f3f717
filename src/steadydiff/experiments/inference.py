"""Statistics that stay honest at the seed counts experiments can afford (3-10 paired seeds).

Every comparison in `steadydiff compare` is paired: arm and baseline run the same seeds, and seed s fixes the
data order, noise levels and noise of every step in both. A claim compares one per-seed quantity (a final
metric, an oscillation statistic, a sensitivity, a time-shift speed-up) through the per-seed ratios
r_s = arm_s / base_s, analysed on the log scale, d_s = log r_s, where multiplicative effects are additive
and seed noise is closer to normal.

* Tests of H0: median/mean ratio = threshold, two-sided: the t-test (default), the exact sign test and the
  exact Wilcoxon signed-rank test (normal approximation above 20 non-zero differences). A claim names one of
  them as its pre-registered test, and the estimate and interval printed are that test's own: the geometric
  mean and the paired t-interval exp(mean d +- t_{1-a/2, n-1} sd(d) / sqrt(n)) (exact for log-normal seed
  noise; a skewed log-ratio makes it approximate at small n, the reason to pre-register a rank test there);
  the median ratio and the order-statistic interval that inverts the sign test; the Hodges-Lehmann estimate
  and the Walsh-average interval that inverts the Wilcoxon test. Rank intervals are discrete: each is
  labelled with its exact confidence (e.g. 96.9% at n = 6), and none exists below 6 seeds.
* Bounds and zeros: a per-seed ratio that is only a bound (a crossing outside the evaluation grid, a
  diverged run: ratio +inf; a statistic that is 0: ratio 0 or 0/0) never enters a value-based test or
  interval. Such claims are judged by the exact sign test on the seeds' known sides, conservatively (an open
  side counts against the verdict under test), with a one-sided order-statistic bound when every bound points
  one way; every seed is accounted for in the printed counts.
* Seed bootstrap percentile interval: only from 20 seeds up (at n = 8-12 its "95%" covers about 0.90).
* Verdict at alpha = 0.05: `holds` when the pre-registered test rejects H0 and the estimate lies on the
  claimed side; `does not hold` when it rejects H0 on the other side; `inconclusive` otherwise, with the true
  ratio the design detects with 80% power (`detectable_ratio`). With 3 seeds the sign test can never reject
  (its smallest two-sided p is 0.25), and neither can the exact Wilcoxon test below 6 seeds (0.0625 at
  n = 5): `min_seeds`.
* Many claims: `familywise_error` (the chance of a false "holds" somewhere under no effect) and Holm's
  step-down adjustment (`holm`).
* "k/n seeds agree": how many per-seed ratios lie on the claimed side of the threshold; printed always.

The t distribution is computed here (regularised incomplete beta by its continued fraction, Numerical
Recipes 6.4; quantiles by bisection) so that no statistics package is needed; tests check it against closed
forms (df = 1, 2) and table values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

ALPHA = 0.05
TESTS = ("t", "wilcoxon", "sign")
BOOTSTRAP_MIN_SEEDS = 20  # below this the percentile interval covers ~0.90 at a nominal 0.95 (n = 8-12)


# ---------------------------------------------------------------------------------------------------------
# Student's t distribution


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes Eq. 6.4.5)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b), x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast here; else use the symmetry
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom: 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2 for t >= 0."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=1024)  # a handful of (level, df) pairs recur in every judgement
def t_ppf(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on `t_cdf`, to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------------------------------------------------
# Tests and intervals on paired log-ratios


def t_interval(d: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of the paired t-interval of the mean of `d` (n >= 2)."""
    d = np.asarray(d, dtype=np.float64)
    n = len(d)
    if n < 2:
        return (float(d.mean()) if n else math.nan), -math.inf, math.inf
    m, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(n)
    q = t_ppf(0.5 + level / 2.0, n - 1)
    return m, m - q * se, m + q * se


def t_test_p(d: Sequence[float], null: float = 0.0) -> float:
    """Two-sided one-sample t-test p-value of H0: mean(d) = null."""
    d = np.asarray(d, dtype=np.float64)
    n = len(d)
    if n < 2:
        return 1.0
    sd = float(d.std(ddof=1))
    diff = float(d.mean()) - null
    if sd == 0.0:
        return 1.0 if diff == 0.0 else 0.0
    t = diff / (sd / math.sqrt(n))
    return min(1.0, 2.0 * (1.0 - t_cdf(abs(t), n - 1)))


def sign_test_p(d: Sequence[float], null: float = 0.0) -> float:
    """Exact two-sided sign test p-value of H0: median(d) = null (differences equal to null dropped)."""
    x = np.asarray(d, dtype=np.float64) - null
    x = x[x != 0]
    n = len(x)
    if n == 0:
        return 1.0
    k = int(min((x > 0).sum(), (x < 0).sum()))
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def wilcoxon_p(d: Sequence[float], null: float = 0.0) -> float:
    """Two-sided Wilcoxon signed-rank p-value of H0: the differences are symmetric about `null`.

    Zero differences are dropped; tied magnitudes get average ranks. Exact (every sign assignment of the
    ranks enumerated by dynamic programming over rank sums) up to 20 non-zero differences, the normal
    approximation with tie correction above.
    """
    x = np.asarray(d, dtype=np.float64) - null
    x = x[x != 0]
    n = len(x)
    if n == 0:
        return 1.0
    order = np.argsort(np.abs(x), kind="stable")
    ranks = np.empty(n)
    mags = np.abs(x)[order]
    i = 0
    while i < n:  # average ranks over ties
        j = i
        while j + 1 < n and mags[j + 1] == mags[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    w_plus = float(ranks[x > 0].sum())
    mean = n * (n + 1) / 4.0
    if n <= 20:
        # Distribution of W+ under H0 over the 2^n equally likely sign patterns; ranks doubled to integers.
        r2 = [int(round(2 * r)) for r in ranks]
        counts = {0: 1}
        for r in r2:
            nxt = dict(counts)
            for s, c in counts.items():
                nxt[s + r] = nxt.get(s + r, 0) + c
            counts = nxt
        obs = int(round(2 * w_plus))
        dev = abs(obs - 2 * mean)
        extreme = sum(c for s, c in counts.items() if abs(s - 2 * mean) >= dev - 1e-9)
        return min(1.0, extreme / 2.0**n)
    _, tie_counts = np.unique(mags, return_counts=True)
    var = n * (n + 1) * (2 * n + 1) / 24.0 - float((tie_counts**3 - tie_counts).sum()) / 48.0
    z = (abs(w_plus - mean) - 0.5) / math.sqrt(var)
    return min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0)))


TEST_FNS = {"t": t_test_p, "wilcoxon": wilcoxon_p, "sign": sign_test_p}
TEST_LABELS = {"t": "paired t-test on log-ratios", "wilcoxon": "exact Wilcoxon signed-rank on log-ratios",
               "sign": "exact sign test"}


def bootstrap_interval(d: Sequence[float], n_boot: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Seed-bootstrap percentile interval of mean(d) (resampling seeds with replacement)."""
    d = np.asarray(d, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), (n_boot, len(d)))].mean(axis=1)
    a = (1.0 - level) / 2.0
    return float(np.quantile(means, a)), float(np.quantile(means, 1.0 - a))


def minimum_detectable_ratio(sd_log: float, n: int, alpha: float = ALPHA, power: float = 0.8) -> float:
    """The smallest ratio (> 1; its inverse on the other side) that a paired t-test on `n` seeds with per-seed
    log-ratio spread `sd_log` detects at two-sided `alpha` with probability `power`:
    exp((t_{1-alpha/2, n-1} + t_{power, n-1}) sd_log / sqrt(n)) (the usual non-central-t approximation).
    It is a distance from the null: a claim "> 1.05" detects a true ratio of 1.05 x this."""
    if n < 2 or not math.isfinite(sd_log):
        return math.inf
    return math.exp((t_ppf(1 - alpha / 2, n - 1) + t_ppf(power, n - 1)) * sd_log / math.sqrt(n))


# ---------------------------------------------------------------------------------------------------------
# Rank-based tests: their own intervals, the seed counts they need, their power


def min_seeds(test: str, alpha: float = ALPHA) -> int:
    """The fewest seeds at which `test` can reject at two-sided `alpha`: the exact sign and Wilcoxon tests'
    smallest p on n seeds is 2 / 2^n (every seed on one side), so they need 2 / 2^n < alpha (6 seeds at 0.05);
    the t-test needs 2 (one degree of freedom)."""
    if test == "t":
        return 2
    n = 1
    while 2.0 / 2.0**n >= alpha:
        n += 1
    return n


def smallest_p(test: str, n: int) -> float:
    """The smallest two-sided p `test` can give on n seeds: 2 / 2^n for the exact sign and Wilcoxon tests (every
    seed on one side), 0 for the t-test (its p falls without bound as the seeds agree more closely)."""
    return 0.0 if test == "t" else min(1.0, 2.0 / 2.0**n)


def seeds_for_p(p: float, test: str) -> int:
    """The fewest seeds at which `test`'s smallest p is below p."""
    n = 1
    while smallest_p(test, n) >= p:
        n += 1
    return n


def _binom_sf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) >= k)."""
    return sum(math.comb(n, i) for i in range(max(k, 0), n + 1)) / 2.0**n


def order_statistic_interval(x: Sequence[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """(low, high, achieved confidence) of the distribution-free interval for the median, [x_(k), x_(n+1-k)]
    with the largest k whose coverage 1 - 2 P(Bin(n, 1/2) < k) is >= `level` (the interval that inverts the
    exact sign test); None when even [min, max] covers less than `level` (n <= 5 at 95%)."""
    v = np.sort(np.asarray(x, dtype=np.float64))
    n, best = len(v), None
    for k in range(1, n // 2 + 1):
        conf = 1.0 - 2.0 * (1.0 - _binom_sf(k, n))
        if conf >= level:
            best = (float(v[k - 1]), float(v[n - k]), conf)
    return best


def one_sided_median_bound(x: Sequence[float], lower: bool, level: float = 0.95) -> tuple[float, float] | None:
    """(bound, achieved confidence) of a one-sided distribution-free bound for the median: the k-th smallest value
    (lower) or k-th largest (upper) with the largest k such that P(Bin(n, 1/2) >= k) >= `level`; None when the
    seeds are too few (n < 5 at 95%). It stays valid when some values are themselves bounds on the same side
    (a value known to be >= its entry only moves the true order statistic up)."""
    v = np.sort(np.asarray(x, dtype=np.float64))
    n, best = len(v), None
    for k in range(1, n + 1):
        conf = _binom_sf(k, n)
        if conf >= level:
            best = (float(v[k - 1] if lower else v[n - k]), conf)
    return best


def _wilcoxon_null_counts(n: int) -> np.ndarray:
    """counts[w] = number of the 2^n sign patterns of ranks 1..n whose positive-rank sum is w."""
    counts = np.zeros(n * (n + 1) // 2 + 1, dtype=np.float64)
    counts[0] = 1.0
    for r in range(1, n + 1):
        counts[r:] = counts[r:] + counts[:-r].copy()
    return counts


def hodges_lehmann_interval(d: Sequence[float], level: float = 0.95) -> tuple[float, float, float, float] | None:
    """(estimate, low, high, achieved confidence) of the Hodges-Lehmann estimate of the centre of `d` (the median
    of the Walsh averages (d_i + d_j) / 2, i <= j) and the interval that inverts the exact Wilcoxon signed-rank
    test: the k-th smallest and largest Walsh averages, k - 1 the largest lower critical value of W+ with
    coverage >= `level`; None when no interval reaches `level` (n <= 5 at 95%)."""
    v = np.asarray(d, dtype=np.float64)
    n = len(v)
    if n == 0:
        return None
    i, j = np.triu_indices(n)
    walsh = np.sort((v[i] + v[j]) / 2.0)
    est = float(np.median(walsh))
    cdf = np.cumsum(_wilcoxon_null_counts(n)) / 2.0**n  # P(W+ <= w)
    best = None
    for k in range(1, len(walsh) // 2 + 1):
        conf = 1.0 - 2.0 * float(cdf[k - 1])  # P(W+ <= k - 1) in each tail
        if conf >= level:
            best = (est, float(walsh[k - 1]), float(walsh[len(walsh) - k]), conf)
    return best


def _rejection_rate(test: str, n: int, shift_over_sd: float, alpha: float, z: np.ndarray) -> float:
    """P(the exact two-sided `test` rejects at `alpha`) for n normal log-ratios with mean / sd = `shift_over_sd`:
    closed form for the sign test (the count above 0 is Binomial(n, Phi(shift / sd))), a fixed-seed simulation
    over the rows of `z` for Wilcoxon (W+ against its exact null critical values; no ties in continuous data)."""
    if test == "sign":
        k = next(k for k in range(n + 1) if 2.0 * _binom_sf(k, n) < alpha)
        q = 0.5 * math.erfc(-shift_over_sd / math.sqrt(2.0))
        pmf = [math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(n + 1)]
        return float(sum(pmf[k:]) + sum(pmf[: n - k + 1]))
    cdf = np.cumsum(_wilcoxon_null_counts(n)) / 2.0**n
    c = int(np.flatnonzero(2.0 * cdf < alpha)[-1])  # reject when W+ <= c or W+ >= N - c
    x = z + shift_over_sd
    ranks = np.argsort(np.argsort(np.abs(x), axis=1), axis=1) + 1
    w = (ranks * (x > 0)).sum(axis=1)
    total = n * (n + 1) // 2
    return float(np.mean((w <= c) | (w >= total - c)))


def detectable_ratio(test: str, sd_log: float, n: int, threshold: float, claim_more: bool, alpha: float = ALPHA,
                     power: float = 0.8) -> float:
    """The true ratio, on the claimed side of `threshold`, that the pre-registered `test` detects with
    probability `power` at two-sided `alpha` on `n` seeds whose log-ratios are normal with spread `sd_log`:
    threshold x (or /) the t-test's `minimum_detectable_ratio`; for the sign and Wilcoxon tests the shift at
    which their rejection rate (`_rejection_rate`) reaches `power`, by bisection. inf (or 0) when the test
    cannot reject at this n or the spread is unknown."""
    unreachable = math.inf if claim_more else 0.0
    if n < min_seeds(test, alpha) or not math.isfinite(sd_log):
        return unreachable
    if test == "t":
        mdr = minimum_detectable_ratio(sd_log, n, alpha, power)
        return threshold * mdr if claim_more else threshold / mdr
    if sd_log == 0:
        return threshold
    shift = _detectable_shift(test, n, alpha, power)
    if not math.isfinite(shift):
        return unreachable
    factor = math.exp(shift * sd_log)
    return threshold * factor if claim_more else threshold / factor


@functools.lru_cache(maxsize=256)
def _detectable_shift(test: str, n: int, alpha: float, power: float) -> float:
    """The log-ratio shift, in units of its sd, at which a rank test reaches `power` (scale-free, so cached)."""
    z = np.random.default_rng(12345).standard_normal((4000, n))
    lo, hi = 0.0, 1.0
    while _rejection_rate(test, n, hi, alpha, z) < power:
        hi *= 2.0
        if hi > 64:
            return math.inf
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _rejection_rate(test, n, mid, alpha, z) < power else (lo, mid)
    return hi


# ---------------------------------------------------------------------------------------------------------
# Many claims at once


def familywise_error(k: int, alpha: float = ALPHA) -> float:
    """The chance of at least one false "holds" among `k` independent claims judged at `alpha` each when no
    effect exists: 1 - (1 - alpha)^k (an upper bound's worth of intuition for dependent claims too)."""
    return 1.0 - (1.0 - alpha) ** k


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979): the i-th smallest p times (k - i + 1), made monotone and
    capped at 1. Rejecting where the adjusted p < alpha keeps the family-wise error <= alpha under any
    dependence."""
    p = np.asarray(pvalues, dtype=np.float64)
    k = len(p)
    order = np.argsort(p, kind="stable")
    adj = np.empty(k)
    running = 0.0
    for rank, idx in enumerate(order):
        running = max(running, min(1.0, (k - rank) * p[idx]))
        adj[idx] = running
    return adj.tolist()


# ---------------------------------------------------------------------------------------------------------
# One claim


BOUND_SIGNS = ("", ">=", "<=", "?")  # a value; a lower bound; an upper bound; bounds both ways (side open)


def _side(r: float, bound: str, threshold: float) -> int:
    """+1 if seed ratio `r` is known to lie above `threshold`, -1 below, 0 when a bound or a tie leaves it open."""
    if bound == ">=":
        return 1 if r > threshold else 0
    if bound == "<=":
        return -1 if r < threshold else 0
    if bound == "?":
        return 0
    return int(np.sign(r - threshold))


def judge_ratios(ratios: Sequence[float], threshold: float, claim_more: bool, test: str = "t",
                 n_boot: int = 2000, seed: int = 0, bounds: Sequence[str] | None = None,
                 alpha: float = ALPHA) -> dict[str, Any]:
    """Everything a claim about per-seed paired ratios needs: estimate, interval, p-values, agreement, verdict.

    `claim_more`: the claim is that the ratio exceeds `threshold` (a speed-up); else that it is below it
    (less oscillation, a lower metric). `bounds[i]` is "" when seed i's ratio is a value, ">=" / "<=" when it is
    only a bound (a crossing outside the evaluation grid). Every seed is accounted for:

    * A ratio of +inf or 0 (the arm or the baseline diverged, or a statistic is 0 on one side) is a bound with a
      known side; 0/0 (nan: both statistics 0) is a tie.
    * With no bound and no tie, the pre-registered test runs on the log-ratios and the interval is that test's
      own: the t-interval (t), the order-statistic interval (sign), the Hodges-Lehmann interval (Wilcoxon).
    * With any bound or tie, no value-based interval exists: the verdict is the exact sign test on the seeds'
      known sides, made conservative (a seed whose side is open counts against the verdict being tested: for
      "holds" it counts as on the other side, for "does not hold" as on the claimed side; ties are dropped, as
      in the sign test). The estimate is the median with its bound sign, and an interval is printed only as a
      one-sided order-statistic bound when every bound points the same way.
    """
    if test not in TEST_FNS:
        raise ValueError(f"unknown test {test!r}; choose one of {', '.join(TESTS)}")
    r = np.asarray(ratios, dtype=np.float64)
    bounds = list(bounds) if bounds is not None else [""] * len(r)
    if len(bounds) != len(r) or any(b not in BOUND_SIGNS for b in bounds):
        raise ValueError(f"bounds must list one of {BOUND_SIGNS} per seed, got {bounds}")
    # A non-finite or zero ratio is a bound in the direction it points (inf: >= anything, 0: <= anything).
    bounds = [">=" if (v == math.inf) else "<=" if v == 0 else b for v, b in zip(r.tolist(), bounds)]
    tie = np.isnan(r)
    n_all = len(r)
    null = math.log(threshold)
    sides = [0 if t else _side(v, b, threshold) for v, b, t in zip(r.tolist(), bounds, tie)]
    agree = sum(s == (1 if claim_more else -1) for s in sides)
    n_bound = sum(b != "" for b in bounds)
    out: dict[str, Any] = {"per_seed": [float(v) for v in r], "bounds": bounds, "n": n_all, "n_bound": n_bound,
                           "n_tie": int(tie.sum()), "threshold": threshold, "claim": "more" if claim_more else "less",
                           "test": test, "agree": f"{agree}/{n_all}", "p": {}, "value": math.nan,
                           "ci_low": math.nan, "ci_high": math.nan, "alpha": alpha}
    if n_all == 0:
        return {**out, "verdict": "inconclusive", "interval": "none (no seed)", "method": "none",
                "detectable": math.inf if claim_more else 0.0, "sd_log": math.nan}
    if n_bound or tie.any():
        return {**out, **_judge_censored(r, bounds, sides, claim_more, threshold, alpha)}
    d = np.log(r)
    n = n_all
    out["method"] = f"{TEST_LABELS[test]}, n={n}"
    out["p"] = {name: fn(d, null) for name, fn in TEST_FNS.items()}
    out.update(_test_estimate(test, d, n))
    if n >= BOOTSTRAP_MIN_SEEDS:
        blo, bhi = bootstrap_interval(d, n_boot, seed)
        out["bootstrap"] = {"ci_low": math.exp(blo), "ci_high": math.exp(bhi),
                            "method": f"95% seed-bootstrap percentile interval, n={n}, {n_boot} resamples"}
    p = out["p_verdict"] = out["p"][test]
    centre = float(np.median(d)) if test != "t" else float(d.mean())  # the side the test's estimate lies on
    if p < alpha and (centre > null) == claim_more and centre != null:
        verdict = "holds"
    elif p < alpha and centre != null:
        verdict = "does not hold"
    else:
        verdict = "inconclusive"
    out["verdict"] = verdict
    sd = float(d.std(ddof=1)) if n > 1 else math.inf
    out["sd_log"] = sd
    out["mdr"] = minimum_detectable_ratio(sd, n)
    out["detectable"] = detectable_ratio(test, sd, n, threshold, claim_more, alpha)
    return out


def _test_estimate(test: str, d: np.ndarray, n: int) -> dict[str, Any]:
    """The estimate and interval that belong to `test`, on the ratio scale."""
    if test == "t":
        m, lo, hi = t_interval(d)
        return {"value": math.exp(m), "ci_low": math.exp(lo), "ci_high": math.exp(hi),
                "interval": f"95% paired t-interval on log-ratios, n={n}"}
    if test == "sign":
        est, ci = float(np.median(d)), order_statistic_interval(d)
        what = "order-statistic interval for the median ratio (inverts the sign test)"
    else:
        hl = hodges_lehmann_interval(d)
        est, ci = (hl[0], hl[1:]) if hl else (float(np.median(d)), None)
        what = "Hodges-Lehmann interval (inverts the Wilcoxon test)"
    if ci is None:
        return {"value": math.exp(est), "interval": f"none: n={n} is too few for a 95% {what}"}
    return {"value": math.exp(est), "ci_low": math.exp(ci[0]), "ci_high": math.exp(ci[1]),
            "interval": f"{100 * ci[2]:.1f}% {what}, n={n}"}


def _judge_censored(r: np.ndarray, bounds: list[str], sides: list[int], claim_more: bool, threshold: float,
                    alpha: float) -> dict[str, Any]:
    """The conservative sign test on known sides (see `judge_ratios`), and a bound-aware estimate."""
    claimed = 1 if claim_more else -1
    n_for = sum(s == claimed for s in sides)
    n_against = sum(s == -claimed for s in sides)
    n_open = sum(s == 0 for s, b, v in zip(sides, bounds, r.tolist()) if not math.isnan(v))
    m = n_for + n_against + n_open  # the seeds that are not ties
    # Two-sided exact sign-test p-values in the worst case for each verdict.
    p_holds = min(1.0, 2.0 * _binom_sf(n_for, m)) if m else 1.0
    p_not = min(1.0, 2.0 * _binom_sf(n_against, m)) if m else 1.0
    if p_holds < alpha and n_for > m / 2:
        verdict = "holds"
    elif p_not < alpha and n_against > m / 2:
        verdict = "does not hold"
    else:
        verdict = "inconclusive"
    finite = [(v, b) for v, b in zip(r.tolist(), bounds) if not math.isnan(v)]
    signs = {b for _, b in finite if b}
    order = sorted(finite, key=lambda vb: vb[0])
    med_v, med_b = order[(len(order) - 1) // 2] if order else (math.nan, "")
    p_verdict = p_holds if verdict == "holds" else p_not if verdict == "does not hold" else min(p_holds, p_not)
    out: dict[str, Any] = {"verdict": verdict, "p": {"sign (conservative)": p_verdict}, "p_verdict": p_verdict,
                           "method": f"exact sign test on known sides, conservative for bounds, n={m}",
                           "estimate_text": (med_b + " " if med_b else "") + f"{med_v:.4g} (median seed)",
                           "sd_log": math.nan, "detectable": math.inf if claim_more else 0.0}
    if verdict == "inconclusive" and signs == {">="} and claim_more and all(
            s != -1 for s in sides) and max(v for v, b in finite if b == ">=") <= threshold:
        out["verdict_note"] = f"censored at >= {max(v for v, b in finite if b == '>='):.4g}"
    if verdict == "inconclusive" and signs == {"<="} and not claim_more and all(
            s != 1 for s in sides) and min(v for v, b in finite if b == "<=") >= threshold:
        out["verdict_note"] = f"censored at <= {min(v for v, b in finite if b == '<='):.4g}"
    if signs in ({">="}, {"<="}) and finite:
        lower = signs == {">="}
        bound = one_sided_median_bound([v for v, _ in finite], lower=lower)
        if bound is not None and math.isfinite(bound[0]) and bound[0] > 0:
            key = "ci_low" if lower else "ci_high"
            out[key] = bound[0]
            out["interval"] = (f"{100 * bound[1]:.1f}% one-sided order-statistic bound on the median ratio: "
                               f"{'>=' if lower else '<='} {bound[0]:.4g}, n={len(finite)}")
    out.setdefault("interval", f"none: {sum(bool(b) for b in bounds)} of {len(bounds)} seeds are bounds, not values")
    return out


__all__ = [
    "ALPHA", "BOOTSTRAP_MIN_SEEDS", "TESTS", "betainc", "bootstrap_interval", "detectable_ratio", "familywise_error",
    "hodges_lehmann_interval", "holm", "judge_ratios", "min_seeds", "minimum_detectable_ratio",
    "one_sided_median_bound", "order_statistic_interval", "sign_test_p", "t_cdf", "t_interval", "t_ppf", "t_test_p",
    "wilcoxon_p",
]
