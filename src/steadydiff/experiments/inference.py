"""Statistics that stay honest at the seed counts experiments can afford (3-10 paired seeds).

Every comparison in `steadydiff compare` is paired: arm and baseline run the same seeds, and seed s fixes the
data order, noise levels and noise of every step in both. A claim compares one per-seed quantity (a final
metric, an oscillation statistic, a sensitivity, a time-shift speed-up) through the per-seed ratios
r_s = arm_s / base_s, analysed on the log scale, d_s = log r_s, where multiplicative effects are additive
and seed noise is closer to normal.

* Point estimate: the geometric mean ratio exp(mean d).
* Interval: the paired t-interval exp(mean d +- t_{1-a/2, n-1} sd(d) / sqrt(n)), exact when d is normal
  (log-normal seed noise). It is always reported, with its method and n.
* Tests of H0: median/mean ratio = threshold, two-sided: the t-test (default), the exact sign test and the
  exact Wilcoxon signed-rank test (normal approximation above 20 non-zero differences). A claim names one of
  them as its pre-registered test.
* Seed bootstrap percentile interval of the geometric mean: only from 8 seeds up (below that a resample can
  take so few values that the "95%" interval is [min, max] of the seeds, which covers far less than 95%).
* Verdict at alpha = 0.05: `holds` when the pre-registered test rejects H0 and the estimate lies on the
  claimed side; `does not hold` when it rejects H0 on the other side; `inconclusive` otherwise, with the
  minimum detectable effect of the design. With 3 seeds the sign test can never reject (its smallest
  two-sided p is 0.25), and neither can the exact Wilcoxon test below 6 seeds (0.0625 at n = 5).
* "k/n seeds agree": how many per-seed ratios lie on the claimed side of the threshold; printed always.

The t distribution is computed here (regularised incomplete beta by its continued fraction, Numerical
Recipes 6.4; quantiles by bisection) so that no statistics package is needed; tests check it against closed
forms (df = 1, 2) and table values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

ALPHA = 0.05
TESTS = ("t", "wilcoxon", "sign")
BOOTSTRAP_MIN_SEEDS = 8


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
    exp((t_{1-alpha/2, n-1} + t_{power, n-1}) sd_log / sqrt(n)) (the usual non-central-t approximation)."""
    if n < 2 or not math.isfinite(sd_log):
        return math.inf
    return math.exp((t_ppf(1 - alpha / 2, n - 1) + t_ppf(power, n - 1)) * sd_log / math.sqrt(n))


def judge_ratios(ratios: Sequence[float], threshold: float, claim_more: bool, test: str = "t",
                 n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Everything a claim about per-seed paired ratios needs: estimate, interval, p-values, agreement, verdict.

    `claim_more`: the claim is that the ratio exceeds `threshold` (a speed-up); else that it is below it
    (less oscillation, a lower metric). Seeds whose ratio is not a positive finite number (a diverged run)
    cannot enter a log-ratio analysis: they are counted in `excluded` and the verdict says so.
    """
    if test not in TEST_FNS:
        raise ValueError(f"unknown test {test!r}; choose one of {', '.join(TESTS)}")
    r = np.asarray(ratios, dtype=np.float64)
    ok = np.isfinite(r) & (r > 0)
    d = np.log(r[ok])
    n = len(d)
    null = math.log(threshold)
    out: dict[str, Any] = {"per_seed": [float(v) for v in r], "n": n, "excluded": int((~ok).sum()),
                           "threshold": threshold, "claim": "more" if claim_more else "less", "test": test,
                           "method": f"{TEST_LABELS[test]}, n={n}"}
    agree = int((r[ok] > threshold).sum() if claim_more else (r[ok] < threshold).sum())
    out["agree"] = f"{agree}/{n}"
    if n == 0:
        return {**out, "value": math.nan, "ci_low": math.nan, "ci_high": math.nan, "p": {}, "verdict":
                "inconclusive", "interval": "none (no usable seed)", "mdr": math.inf}
    m, lo, hi = t_interval(d)
    out.update(value=math.exp(m), ci_low=math.exp(lo), ci_high=math.exp(hi),
               interval=f"95% paired t-interval on log-ratios, n={n}")
    out["p"] = {name: fn(d, null) for name, fn in TEST_FNS.items()}
    if n >= BOOTSTRAP_MIN_SEEDS:
        blo, bhi = bootstrap_interval(d, n_boot, seed)
        out["bootstrap"] = {"ci_low": math.exp(blo), "ci_high": math.exp(bhi),
                            "method": f"95% seed-bootstrap percentile interval, n={n}, {n_boot} resamples"}
    p = out["p"][test]
    centre = float(np.median(d)) if test != "t" else m  # the side the test's estimate lies on
    if p < ALPHA and (centre > null) == claim_more and centre != null:
        verdict = "holds"
    elif p < ALPHA and centre != null:
        verdict = "does not hold"
    else:
        verdict = "inconclusive"
    out["verdict"] = verdict
    sd = float(d.std(ddof=1)) if n > 1 else math.inf
    out["sd_log"] = sd
    out["mdr"] = minimum_detectable_ratio(sd, n)
    return out


__all__ = [
    "ALPHA", "BOOTSTRAP_MIN_SEEDS", "TESTS", "betainc", "bootstrap_interval", "judge_ratios",
    "minimum_detectable_ratio", "sign_test_p", "t_cdf", "t_interval", "t_ppf", "t_test_p", "wilcoxon_p",
]
