"""Small-n statistics of `steadydiff compare`: the t distribution against closed forms, the exact tests
against brute-force enumeration, and the interval's coverage and the verdicts' false-positive rate by
simulation (log-normal seed noise, >= 1000 simulated experiments per case)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from steadydiff.experiments.inference import (
    betainc,
    judge_ratios,
    minimum_detectable_ratio,
    sign_test_p,
    t_cdf,
    t_interval,
    t_ppf,
    t_test_p,
    wilcoxon_p,
)


@pytest.mark.parametrize("p", [0.6, 0.8, 0.9, 0.975, 0.995])
def test_t_quantiles_match_closed_forms(p):
    assert t_ppf(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)  # Cauchy
    assert t_ppf(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    assert t_ppf(1 - p, 7) == pytest.approx(-t_ppf(p, 7), rel=1e-12)


def test_t_quantiles_match_tables_and_the_normal_limit():
    for df, q in [(2, 4.302653), (4, 2.776445), (7, 2.364624), (30, 2.042272)]:
        assert t_ppf(0.975, df) == pytest.approx(q, abs=2e-6)
    assert t_ppf(0.975, 1e6) == pytest.approx(1.959964, abs=1e-5)
    assert t_cdf(t_ppf(0.9, 5), 5) == pytest.approx(0.9, abs=1e-12)


def test_betainc_closed_forms():
    for x in (0.1, 0.5, 0.93):
        assert betainc(1, 1, x) == pytest.approx(x)
        assert betainc(2, 1, x) == pytest.approx(x**2)
        assert betainc(0.5, 0.5, x) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)))


def _brute_wilcoxon(d):
    d = [v for v in d if v != 0]
    n = len(d)
    ranks = {}
    mags = sorted(abs(v) for v in d)
    for m in set(mags):
        idx = [i + 1 for i, v in enumerate(mags) if v == m]
        ranks[m] = sum(idx) / len(idx)
    r = [ranks[abs(v)] for v in d]
    obs = sum(rv for rv, v in zip(r, d) if v > 0)
    mean = n * (n + 1) / 4
    stats = [sum(rv for rv, s in zip(r, signs) if s) for signs in itertools.product([0, 1], repeat=n)]
    return sum(abs(w - mean) >= abs(obs - mean) - 1e-9 for w in stats) / 2**n


@pytest.mark.parametrize("d", [[0.3, -0.1, 0.5, 0.2, 0.4], [1.0, 2.0, 3.0], [0.1, 0.1, -0.2, 0.3, -0.3, 0.5, 0.6],
                               [-1, -2, -3, -4, -5, -6], [0.5, 0.0, 0.2, -0.2, 0.9]])
def test_exact_tests_match_enumeration(d):
    assert wilcoxon_p(d) == pytest.approx(_brute_wilcoxon(d), abs=1e-12)
    nz = [v for v in d if v != 0]
    k = min(sum(v > 0 for v in nz), sum(v < 0 for v in nz))
    brute_sign = min(1.0, 2 * sum(math.comb(len(nz), i) for i in range(k + 1)) / 2 ** len(nz))
    assert sign_test_p(d) == pytest.approx(brute_sign)


def test_smallest_p_values_show_what_few_seeds_can_say():
    assert sign_test_p([1, 2, 3]) == 0.25  # 3 seeds all agreeing: p = 2/8
    assert wilcoxon_p([1, 2, 3, 4, 5]) == 0.0625  # 5 seeds: still not below 0.05
    assert wilcoxon_p([1, 2, 3, 4, 5, 6]) == pytest.approx(0.03125)


def test_t_interval_and_test_agree():
    d = [0.21, 0.05, 0.33, 0.12, 0.18]
    m, lo, hi = t_interval(d)
    assert lo < m < hi
    # The 95% interval excludes 0 exactly when the two-sided test rejects at 0.05; its ends have p = 0.05.
    assert (lo > 0) == (t_test_p(d) < 0.05)
    assert t_test_p(d, null=lo) == pytest.approx(0.05, abs=1e-9)
    assert t_test_p(d, null=hi) == pytest.approx(0.05, abs=1e-9)


@pytest.mark.parametrize("n", [3, 5, 8])
def test_interval_coverage_is_nominal(n):
    rng = np.random.default_rng(n)
    true_ratio, sims = 1.2, 2000
    covered = 0
    for _ in range(sims):
        ratios = true_ratio * np.exp(rng.normal(0.0, 0.15, n))  # log-normal seed noise around the true ratio
        res = judge_ratios(ratios, 1.0, claim_more=True)
        covered += res["ci_low"] <= true_ratio <= res["ci_high"]
    assert abs(covered / sims - 0.95) <= 0.03, covered / sims


@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("test", ["t", "wilcoxon", "sign"])
def test_no_effect_rarely_holds(n, test):
    rng = np.random.default_rng(100 * n + len(test))
    sims = 1000
    holds = sum(judge_ratios(np.exp(rng.normal(0.0, 0.2, n)), 1.0, claim_more=bool(i % 2), test=test)["verdict"]
                == "holds" for i in range(sims))
    assert holds / sims <= 0.05, holds / sims
    if test == "sign" and n == 3 or test == "wilcoxon" and n <= 5:
        assert holds == 0  # these exact tests cannot reject with so few seeds


def test_judge_ratios_verdicts_and_reporting():
    res = judge_ratios([1.30, 1.25, 1.40, 1.28, 1.33], 1.0, claim_more=True)
    assert res["verdict"] == "holds" and res["agree"] == "5/5" and res["n"] == 5
    assert res["method"] == "paired t-test on log-ratios, n=5" and "n=5" in res["interval"]
    assert "bootstrap" not in res  # only from 8 seeds up
    assert judge_ratios([0.8, 0.85, 0.82, 0.79, 0.84], 1.0, claim_more=True)["verdict"] == "does not hold"
    loose = judge_ratios([1.3, 0.8, 1.1], 1.0, claim_more=True)
    assert loose["verdict"] == "inconclusive" and loose["agree"] == "2/3" and loose["mdr"] > 1.3
    assert "bootstrap" not in judge_ratios(np.linspace(1.1, 1.3, 8), 1.0, claim_more=True)  # ~0.90 at n = 8
    twenty = judge_ratios(np.linspace(1.1, 1.3, 20), 1.0, claim_more=True)
    assert twenty["bootstrap"]["ci_low"] > 1.0 and "n=20" in twenty["bootstrap"]["method"]
    # A diverged seed is a bound on the claimed side here (ratio +inf: the arm is "infinitely faster" only as a
    # bound), never a value in the interval: every seed counts, and no t-interval is printed.
    div = judge_ratios([1.2, math.inf, 1.3, 1.25], 1.0, claim_more=True)
    assert div["n"] == 4 and div["n_bound"] == 1 and div["agree"] == "4/4" and math.isnan(div["value"])


def test_minimum_detectable_ratio_shrinks_with_seeds():
    mdr = [minimum_detectable_ratio(0.1, n) for n in (3, 5, 8, 20)]
    assert mdr == sorted(mdr, reverse=True) and mdr[0] > 1.3 and mdr[-1] < 1.1
    # Simulated power at the reported MDR is about 80% (two-sided t-test, alpha 0.05).
    rng = np.random.default_rng(7)
    n, sd = 8, 0.1
    target = math.log(minimum_detectable_ratio(sd, n))
    power = np.mean([t_test_p(rng.normal(target, sd, n)) < 0.05 for _ in range(2000)])
    assert 0.74 <= power <= 0.86, power


def test_an_inconclusive_claim_whose_seeds_all_tie_says_so_instead_of_a_power_figure():
    """Max stable LRs equal on every seed (ratio 1 x 6): the spread is 0, so '80% power at ratio 1' would be
    vacuous; the verdict says the seeds tie. A spread > 0 still gives the detectable ratio."""
    from steadydiff.experiments.report import _verdict

    tied = {**judge_ratios([1.0] * 6, 1.0, claim_more=True, test="sign"), "claim": "more", "test": "sign"}
    assert tied["verdict"] == "inconclusive" and tied["sd_log"] == 0
    assert _verdict(tied) == "**inconclusive (all 6 seeds give the same ratio)**"
    spread = {**judge_ratios([1.0] * 5 + [1 / 3], 1.0, claim_more=True, test="sign"), "claim": "more",
              "test": "sign"}
    assert "detects a true ratio >=" in _verdict(spread)
