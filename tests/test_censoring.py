"""The evidence engine under bounds, zeros, diverged seeds and many claims (issue 27), checked by simulation:
every printed interval covers as labelled, no test says "holds" at the threshold more than 5% of the time,
and a bound never enters an interval as a value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from steadydiff.experiments.inference import (
    detectable_ratio,
    familywise_error,
    hodges_lehmann_interval,
    holm,
    judge_ratios,
    min_seeds,
    one_sided_median_bound,
    order_statistic_interval,
    sign_test_p,
    t_test_p,
    wilcoxon_p,
)
from steadydiff.experiments.speedup import BEYOND, INTERPOLATED, time_shift


def _coverage(test: str, n: int, sims: int, rng) -> tuple[float, float]:
    """(simulated coverage of the interval `test` prints, its labelled confidence) for log-normal ratios."""
    true = 1.2
    hit, label = 0, None
    for _ in range(sims):
        res = judge_ratios(true * np.exp(rng.normal(0.0, 0.15, n)), 1.0, claim_more=True, test=test)
        if not math.isfinite(res["ci_low"]):
            return math.nan, math.nan
        hit += res["ci_low"] <= true <= res["ci_high"]
        label = float(res["interval"].split("%")[0]) / 100 if test != "t" else 0.95
    return hit / sims, label


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("test", ["t", "sign", "wilcoxon"])
def test_every_printed_interval_covers_as_labelled(test, n):
    cover, label = _coverage(test, n, 1500, np.random.default_rng(10 * n + len(test)))
    if test != "t" and n < 6:
        assert math.isnan(cover)  # no rank interval reaches 95% below 6 seeds: none is printed
        return
    # The t-interval is exact for normal log-ratios; a rank interval's level is discrete and printed with it.
    assert abs(cover - label) <= 0.025, (cover, label)
    if test == "t":
        assert 0.93 <= cover <= 0.97


def test_rank_intervals_invert_their_tests():
    rng = np.random.default_rng(3)
    d = rng.normal(0.1, 0.1, 9)
    lo, hi, conf = order_statistic_interval(d)
    # Just inside the interval the sign test cannot reject at 1 - conf; just outside it can.
    assert sign_test_p(d, lo + 1e-9) > 1 - conf - 1e-12 and sign_test_p(d, lo - 1e-9) <= 1 - conf + 1e-12
    est, lo, hi, conf = hodges_lehmann_interval(d)
    assert lo < est < hi
    assert wilcoxon_p(d, lo + 1e-9) > 1 - conf - 1e-12 and wilcoxon_p(d, lo - 1e-9) <= 1 - conf + 1e-12
    assert order_statistic_interval(d[:5]) is None and hodges_lehmann_interval(d[:5]) is None


@pytest.mark.parametrize("test", ["t", "sign", "wilcoxon"])
@pytest.mark.parametrize("n", [3, 5, 8])
def test_false_holds_at_the_threshold_at_most_5_percent(test, n):
    rng = np.random.default_rng(n + 100 * len(test))
    thr, sims = 1.3, 1500
    holds = sum(judge_ratios(thr * np.exp(rng.normal(0.0, 0.2, n)), thr, claim_more=bool(i % 2), test=test)[
        "verdict"] == "holds" for i in range(sims))
    assert holds / sims <= 0.05 + 0.011, holds / sims  # 0.05 plus ~2 binomial s.e.
    if n < min_seeds(test):
        assert holds == 0


@pytest.mark.parametrize("cap", [1.1, 1.3, 1.6])
def test_false_holds_at_the_threshold_at_most_5_percent_when_values_are_censored(cap):
    """True median ratio at the threshold; every value above `cap` is only known as '>= cap' (the grid's
    end). The conservative sign test must still not say "holds" more than alpha of the time."""
    rng = np.random.default_rng(int(cap * 10))
    thr, sims, n = 1.3, 2000, 8
    holds = 0
    for i in range(sims):
        r = thr * np.exp(rng.normal(0.0, 0.3, n))
        bounds = [">=" if v > cap else "" for v in r]
        res = judge_ratios(np.minimum(r, cap), thr, claim_more=bool(i % 2), bounds=bounds)
        holds += res["verdict"] == "holds"
        if any(bounds):
            assert math.isnan(res["value"]) and "t-interval" not in res["interval"]  # no interval from bounds
    assert holds / sims <= 0.05, holds / sims


def test_a_claim_beyond_every_bound_is_inconclusive_censored_never_does_not_hold():
    res = judge_ratios([1.07] * 5, 1.5, claim_more=True, bounds=[">="] * 5)
    assert res["verdict"] == "inconclusive" and res["verdict_note"] == "censored at >= 1.07"
    assert math.isnan(res["value"]) and res["estimate_text"].startswith(">= 1.07")
    # The one-sided order-statistic bound is all that is printed, and it says so.
    assert res["ci_low"] == 1.07 and math.isnan(res["ci_high"]) and "one-sided" in res["interval"]
    # The same bounds prove a claim they exceed: 5/5 seeds known above 1.05.
    assert judge_ratios([1.07] * 6, 1.05, claim_more=True, bounds=[">="] * 6)["verdict"] == "holds"


def test_diverged_seeds_count_against_a_claim_and_are_named():
    # "ends lower" (ratio arm / base < 1) with 2 of 5 arm seeds diverged (ratio +inf).
    res = judge_ratios([0.9, 0.92, math.inf, math.inf, 0.91], 1.0, claim_more=False)
    assert res["verdict"] != "holds" and res["n"] == 5 and res["agree"] == "3/5" and res["n_bound"] == 2
    # Every seed diverged: the arm is worse on every seed, which is a finding, not "n = 0".
    all_div = judge_ratios([math.inf] * 6, 1.0, claim_more=False)
    assert all_div["verdict"] == "does not hold" and all_div["agree"] == "0/6"


def test_zero_statistics_are_kept_by_the_sign_test():
    # "fewer spikes": arm / base spike fractions; a 0 in the arm is the strongest evidence, not a dropped seed.
    arm = np.array([0.0, 0.0, 0.0, 0.01, 0.0, 0.0])
    base = np.array([0.05, 0.04, 0.06, 0.05, 0.03, 0.07])
    with np.errstate(divide="ignore", invalid="ignore"):
        res = judge_ratios(arm / base, 1.0, claim_more=False)
    assert res["verdict"] == "holds" and res["agree"] == "6/6" and res["n"] == 6
    # Both zero is a tie: dropped from the sign test, and counted.
    with np.errstate(divide="ignore", invalid="ignore"):
        tie = judge_ratios(np.array([0.0, 0.0, 0.01]) / np.array([0.0, 0.05, 0.05]), 1.0, claim_more=False)
    assert tie["n_tie"] == 1 and tie["n"] == 3


@pytest.mark.parametrize("factor", [1.5, 0.8])
def test_a_curve_shifted_in_time_is_recovered_inside_the_grid_and_a_bound_outside(factor):
    steps = np.arange(100, 4001, 100, dtype=np.float64)

    def curve(s):
        return 0.05 + 0.5 * np.exp(-s / 900.0)

    base, arm = curve(steps), curve(factor * steps)  # the arm is the baseline run `factor` times faster
    # Inside the grid: at half the budget the baseline reaches the arm's value at factor x 2000 <= 4000.
    inside = time_shift(steps, base, arm, fraction=0.5)
    assert inside["forward_flag"] == INTERPOLATED
    assert inside["forward"] == pytest.approx(factor, rel=0.05)
    if factor > 1:  # at the end the baseline would need 6000 steps: a bound, never a value
        end = time_shift(steps, base, arm, fraction=1.0)
        assert end["forward_flag"] == BEYOND and end["forward"] < factor
        res = judge_ratios([end["forward"]] * 5, 1.3, claim_more=True, bounds=[">="] * 5)
        assert math.isnan(res["value"]) and res["verdict"] != "does not hold"


def test_detectable_ratio_is_on_the_claimed_side_and_has_80_percent_power():
    rng = np.random.default_rng(11)
    for test, fn in (("t", t_test_p), ("sign", sign_test_p), ("wilcoxon", wilcoxon_p)):
        more = detectable_ratio(test, 0.1, 8, 1.05, claim_more=True)
        less = detectable_ratio(test, 0.1, 8, 1.05, claim_more=False)
        assert more > 1.05 > less
        power = np.mean([fn(rng.normal(math.log(more / 1.05), 0.1, 8)) < 0.05 for _ in range(2000)])
        assert 0.75 <= power <= 0.85, (test, power)
    assert detectable_ratio("wilcoxon", 0.1, 5, 1.0, True) == math.inf  # cannot reject at n = 5
    assert min_seeds("sign") == min_seeds("wilcoxon") == 6 and min_seeds("t") == 2


def test_one_sided_median_bound_is_valid_with_bounds_on_its_side():
    rng = np.random.default_rng(5)
    cover = 0
    for _ in range(3000):
        x = rng.normal(0.0, 1.0, 7)
        lower_bounds = np.minimum(x, 0.2)  # each entry <= its true value (a '>=' bound)
        b, conf = one_sided_median_bound(lower_bounds, lower=True)
        cover += b <= 0.0
    assert cover / 3000 >= conf - 0.015


def test_holm_and_the_familywise_chance():
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert familywise_error(9) == pytest.approx(1 - 0.95**9) and 0.36 < familywise_error(9) < 0.37
    # Under no effect, Holm keeps the chance of any false rejection among 9 independent tests <= alpha.
    rng = np.random.default_rng(2)
    p = rng.uniform(size=(4000, 9))
    any_raw = np.mean((p < 0.05).any(axis=1))
    any_holm = np.mean([min(holm(row)) < 0.05 for row in p])
    assert any_raw == pytest.approx(familywise_error(9), abs=0.03) and any_holm <= 0.05 + 0.008


def test_registration_is_refused_once_any_run_exists(tmp_path):
    import json

    from steadydiff.experiments import load_experiment
    from steadydiff.experiments.prereg import FILE, claim_status, record
    from test_experiments import _write_experiment

    exp = load_experiment(_write_experiment(tmp_path))
    out = tmp_path / "out"
    (out / "runs" / "org" / "seed-0").mkdir(parents=True)  # a copied or cleaned OUT: runs, no record
    assert not record(exp, out) and not (out / FILE).exists()
    assert set(claim_status(exp, out).values()) == {"not recorded"}  # never "pre-registered" after the fact
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert record(exp, fresh)
    assert json.loads((fresh / FILE).read_text())["runs_at_record"] == 0


def _exp_file(tmp_path, claims, seeds=(0, 1, 2, 3, 4), **extra):
    import yaml

    from test_experiments import _write_experiment

    path = _write_experiment(tmp_path, claims=claims, seeds=list(seeds), **extra)
    spec = yaml.safe_load(path.read_text())
    return path, spec


@pytest.mark.parametrize("claim, needle", [
    ({"name": "x", "arm": "cs", "kind": "speedup", "target": "final", "threshold": 1.5},
     "grid reports at most 1.25 there"),
    ({"name": "x", "arm": "cs", "kind": "final", "test": "sign"}, "the sign test cannot reject at alpha 0.05 with 5"),
    ({"name": "x", "arm": "cs", "kind": "final", "test": "wilcoxon"}, "it needs 6"),
])
def test_claims_that_cannot_hold_are_refused_before_training(tmp_path, capsys, claim, needle):
    from steadydiff.cli import main

    path, _ = _exp_file(tmp_path, [claim])
    assert main(["compare", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and needle in err[0] and not (tmp_path / "out" / "runs").exists()


def _rep(base: np.ndarray, arm: np.ndarray, grid, registration="pre-registered"):
    return {"baseline": "base", "lower_is_better": True, "grid": list(grid), "seeds": list(range(len(base))),
            "registration": {}, "arms": {"base": {"curves_per_seed": base.tolist()},
                                         "arm": {"curves_per_seed": arm.tolist()}}}


def test_a_speedup_to_a_target_value_reads_both_crossings_inside_the_grid():
    from steadydiff.experiments.analysis import judge
    from steadydiff.experiments.spec import Claim

    grid = np.arange(100, 4001, 100, dtype=np.float64)

    def curve(rate, seed):
        return (0.05 + 0.5 * np.exp(-rate * grid)) * np.exp(0.005 * np.random.default_rng(seed).standard_normal(40))

    base = np.stack([curve(1 / 900, s) for s in range(6)])
    arm = np.stack([curve(1.5 / 900, 10 + s) for s in range(6)])
    rep = _rep(base, arm, grid)
    c = judge(Claim("to 0.1", "arm", "speedup", threshold=1.2, target_value=0.1), rep)
    assert c["n_bound"] == 0 and c["value"] == pytest.approx(1.5, rel=0.05) and c["verdict"] == "holds"
    # A level the arm reaches but the baseline never does: every seed is a lower bound, and nothing more.
    far = judge(Claim("to 0.053", "arm", "speedup", threshold=1.2, target_value=0.053), rep)
    assert far["n_bound"] == 6 and math.isnan(far["value"]) and all(b == ">=" for b in far["bounds"])


def test_holm_downgrades_a_verdict_and_every_report_states_the_familywise_chance(tmp_path):
    from steadydiff.experiments.analysis import judge_claims
    from steadydiff.experiments.report import _claim_lines
    from steadydiff.experiments.spec import Claim

    class Exp:
        bootstrap, unreachable = 200, {}
        claims = [Claim(f"c{i}", "arm", "final") for i in range(4)]

    finals = {"base": [1.0] * 5, "arm": [0.92, 0.96, 0.99, 0.93, 0.98]}  # t-test p = 0.034: holds unadjusted
    rep = {"baseline": "base", "lower_is_better": True, "seeds": list(range(5)), "grid": [],
           "registration": {f"c{i}": "pre-registered" for i in range(3)},  # c3 was not registered
           "arms": {k: {"final_per_seed": v} for k, v in finals.items()}}
    for rule, expect in (("none", "holds"), ("holm", "inconclusive")):
        Exp.multiplicity = rule
        claims = judge_claims(Exp, rep)
        assert [c["verdict"] for c in claims[:3]] == [expect] * 3 and claims[3]["verdict"] == "holds"
        assert rep["multiplicity"]["confirmatory"] == 3
        text = "\n".join(_claim_lines({**rep, "claims": claims}))
        assert "chance of at least one false 'holds' among them is about 14%" in text
        assert "holds (exploratory)" in text and "**holds (exploratory)" not in text  # never the bold word
    assert "Holm-adjusted p" in claims[0]["verdict_note"]
