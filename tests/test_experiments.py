"""Experiments: steps-to-target and time-shift speed-ups on synthetic curves with known answers, claims judged on
paired seeds, spec validation, pre-registration, and a tiny arms x seeds experiment on toy2d end to end through
`steadydiff compare`."""

import json
import math

import numpy as np
import pytest
import yaml

from steadydiff.cli import main
from steadydiff.config import ConfigError
from steadydiff.experiments import load_experiment
from steadydiff.experiments.analysis import judge, late_change
from steadydiff.experiments.spec import Claim
from steadydiff.experiments.speedup import BEFORE, BEYOND, fill_diverged, steps_to_target, time_shift

GRID = np.arange(100, 1001, 100)  # evaluations every 100 steps up to a budget of 1000


def exp_curve(rate: float, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """A metric that decays like exp(-rate * step) (lower is better), times lognormal evaluation noise."""
    rng = np.random.default_rng(seed)
    return np.exp(-rate * GRID) * np.exp(noise * rng.standard_normal(len(GRID)))


# ------------------------------------------------------------------------------------------------------
# steps to target


def test_steps_to_target_interpolates_linearly_between_evaluations():
    steps, values = [0, 10, 20], [10.0, 6.0, 2.0]
    assert steps_to_target(steps, values, 6.0) == 10.0  # hit exactly at an evaluation
    assert steps_to_target(steps, values, 4.0) == pytest.approx(15.0)  # halfway between 6 and 2
    assert steps_to_target(steps, values, 12.0) == 0.0  # already there at the first evaluation
    assert steps_to_target(steps, values, 1.0) == math.inf  # never
    # higher is better (e.g. precision): mirror image
    assert steps_to_target(steps, [0.1, 0.5, 0.9], 0.7, lower_is_better=False) == pytest.approx(15.0)


def test_fill_diverged_makes_the_tail_worst_and_keeps_it_worst():
    out = fill_diverged([5.0, 4.0, float("nan"), 3.0], 6)
    assert out[:2].tolist() == [5.0, 4.0]
    assert np.isinf(out[2:]).all() and (out[2:] > 0).all()  # a recovered value after a NaN still counts as bad
    assert (fill_diverged([0.2], 3, lower_is_better=False)[1:] == -np.inf).all()


# ------------------------------------------------------------------------------------------------------
# speed-ups


def _shift_claim(base: np.ndarray, arm: np.ndarray, target: str = "half", threshold: float = 1.0) -> dict:
    """Judge a speed-up claim on per-seed curves the way `analyse` does."""
    fracs = {"half": 0.5, "three_quarters": 0.75, "final": 1.0}
    shifts = [time_shift(GRID, b, a, fracs[target]) for b, a in zip(base, arm)]
    rep = {"baseline": "base", "lower_is_better": True, "grid": list(GRID), "arms": {
        "base": {}, "arm": {"time_shift": {target: {**time_shift(GRID, base.mean(0), arm.mean(0), fracs[target]),
                                                     "per_seed": [x["forward"] for x in shifts],
                                                     "per_seed_flags": [x["forward_flag"] for x in shifts]}}}}}
    return judge(Claim("faster", "arm", "speedup", target=target, threshold=threshold), rep)


def test_twice_as_fast_arm_gives_speedup_two():
    # Noise-free: at half the budget (500) the arm (rate x2) is at exp(-1), which the baseline reaches at 1000.
    base = np.stack([exp_curve(1e-3)] * 3)
    arm = np.stack([exp_curve(2e-3)] * 3)
    c = _shift_claim(base, arm, "half")
    assert c["value"] == pytest.approx(2.0) and c["per_seed"] == pytest.approx([2.0] * 3)
    assert c["verdict"] == "holds" and c["agree"] == "3/3"
    # At the full budget the arm is at exp(-2): the baseline does not get there within one more interval,
    # so the speed-up is a lower bound, flagged.
    res = time_shift(GRID, base[0], arm[0], 1.0)
    assert res["forward_flag"] == BEYOND and res["forward"] == pytest.approx(1.1)
    # Reverse: the arm reaches the baseline's exp(-0.5) (its value at 500) between its evaluations at 200 and
    # 300, where the straight line through exp(-0.4) and exp(-0.6) puts the crossing slightly after 250.
    e = np.exp
    crossing = 200 + 100 * (e(-0.4) - e(-0.5)) / (e(-0.4) - e(-0.6))
    assert time_shift(GRID, base[0], arm[0], 0.5)["reverse"] == pytest.approx(500 / crossing)


def test_noisy_seeds_give_an_interval_that_covers_the_truth_and_excludes_one():
    # 1.5x faster: at half the budget the baseline's crossing (at 0.75 of it) lies inside the grid, so every
    # per-seed speed-up is a value (2x would put it at the grid's end, where noise makes some crossings bounds).
    base = np.stack([exp_curve(1e-3, 0.03, seed=s) for s in range(5)])
    arm = np.stack([exp_curve(1.5e-3, 0.03, seed=10 + s) for s in range(5)])
    c = _shift_claim(base, arm, "half")
    assert c["n_bound"] == 0 and c["ci_low"] < 1.5 < c["ci_high"] and c["ci_low"] > 1.0
    assert c["verdict"] == "holds" and "paired t" in c["interval"] and "n=5" in c["interval"]


def test_a_much_slower_arm_gets_a_small_speedup_not_zero():
    base = np.stack([exp_curve(1e-3)] * 3)
    arm = np.stack([exp_curve(1e-4)] * 3)  # ten times slower: at 1000 it is where the baseline was at 100
    c = _shift_claim(base, arm, "final")
    assert c["value"] == pytest.approx(0.1) and c["verdict"] == "does not hold"


def test_a_diverged_seed_is_counted_not_dropped():
    base = np.stack([exp_curve(1e-3)] * 3)
    good = exp_curve(2e-3)
    diverged = fill_diverged(good[:3], len(GRID))  # worst after the 3rd evaluation
    arm = np.stack([good, good, diverged])
    c = _shift_claim(base, arm, "half")
    # The diverged seed is as bad as the baseline's first evaluation or worse: a speed-up bounded above by
    # 100 / 500, counted in the analysis (it makes the seeds disagree).
    assert c["n"] == 3 and c["per_seed"][2] == pytest.approx(0.2)
    assert time_shift(GRID, base[2], diverged, 0.5)["forward_flag"] == BEFORE
    assert c["agree"] == "2/3" and c["verdict"] == "inconclusive"


def test_the_baseline_against_itself_is_exactly_one():
    base = np.stack([exp_curve(1e-3, 0.05, seed=s) for s in range(4)])  # noisy, non-monotone curves
    for target in ("half", "three_quarters", "final"):
        c = _shift_claim(base, base, target)
        assert c["per_seed"] == pytest.approx([1.0] * 4, abs=1e-12) and c["verdict"] == "inconclusive"


def test_monotone_fit_pools_violators_and_keeps_improving_curves():
    from steadydiff.experiments.speedup import monotone_fit

    steps = np.array([100.0, 200, 300, 400, 500])
    clean = np.array([5.0, 4, 3, 2, 1])
    assert monotone_fit(steps, clean) == pytest.approx(clean)  # already monotone: unchanged
    noisy = np.array([5.0, 3, 4, 2, 1])  # 3, 4 violate: pooled to 3.5 centred at 250
    fit = monotone_fit(steps, noisy)
    assert fit[0] == 5 and fit[3:] == pytest.approx([2, 1]) and fit[1] > fit[2]  # strictly decreasing again
    assert np.interp(250, steps, fit) == pytest.approx(3.5)
    assert monotone_fit(steps, -noisy, lower_is_better=False) == pytest.approx(-fit)
    assert monotone_fit(steps, [1.0, 2.0, np.inf, np.inf, np.inf])[2] == np.inf  # diverged: left as it is


# ------------------------------------------------------------------------------------------------------
# experiment files


def _write_experiment(tmp_path, **changes):
    spec = {
        "name": "tiny", "description": "two arms on toy2d",
        "base": str(__import__("pathlib").Path(__file__).parents[1] / "configs" / "toy2d.yaml"),
        "set": {"train.steps": 80, "train.eval_every": 20, "train.eval_metrics": ["sw"], "train.eval_n": 200,
                "train.log_every": 10, "train.ckpt_every": 40, "train.sample_n": 64, "train.sample_steps": 10,
                "train.threads": 1, "train.warmup_steps": 10, "model.depth": 4, "model.hidden": 64},
        "baseline": "org",
        "arms": {"org": {"model.skip_scaling": "org"}, "cs": {"model.skip_scaling": "cs", "model.kappa": 0.5}},
        "seeds": [0, 1], "metric": {"key": "eval/sw", "lower_is_better": True},
        "stability": ["loss", "grad/total"], "sensitivity": True, "bootstrap": 200,
        "claims": [{"name": "cs is faster", "arm": "cs", "kind": "speedup", "target": "final"},
                   {"name": "cs oscillates less", "arm": "cs", "kind": "stability", "series": "grad/total"},
                   {"name": "cs is less sensitive", "arm": "cs", "kind": "sensitivity"}],
    }
    spec.update(changes)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("change,needle", [
    ({"colour": 1}, "unknown experiment key colour"),
    ({"baseline": "nope"}, "baseline 'nope' is not an arm"),
    ({"arms": {"org": {}, "cs": {"model.skip_scaling": "sideways"}}}, "arm 'cs'.*sideways"),
    ({"arms": {"org": {"model.no_such_key": 1}, "cs": {}}}, "unknown config key model.no_such_key"),
    ({"claims": [{"name": "x", "arm": "ghost", "kind": "speedup"}]}, "arm 'ghost' is not an arm"),
    ({"claims": [{"name": "x", "arm": "cs", "kind": "magic"}]}, "kind 'magic'"),
    ({"seeds": "three"}, "seeds"),
    ({"claims": [{"name": "x", "arm": "cs", "kind": "speedup", "keys": ["loss"]}]}, "only on kind: final"),
    ({"base": "missing.yaml"}, "base config"),
    ({"metric": {"key": "eval/fd_fmnst@nfe10"}}, "experiment metric: 'eval/fd_fmnst@nfe10' is not eval/<metric>"),
    ({"metric": {"key": "eval/sw@nfe10"}}, r"eval/sw@nfe10 needs 10 in train.eval_nfe \(arm '\w+' has \[\]\)"),
    ({"claims": [{"name": "x", "arm": "cs", "kind": "final", "keys": ["eval/sw@10"]}]},
     r"claims\[0\] keys: 'eval/sw@10'"),
])
def test_bad_experiment_files_fail_before_training(tmp_path, change, needle):
    with pytest.raises(ConfigError, match=needle):
        load_experiment(_write_experiment(tmp_path, **change))


def test_overrides_layer_experiment_arm_seed_and_command_line(tmp_path):
    exp = load_experiment(_write_experiment(tmp_path))
    cfg = exp.run_config("cs", 1, ["train.lr=3e-4"])
    assert (cfg.model.skip_scaling, cfg.model.kappa, cfg.train.seed) == ("cs", 0.5, 1)
    assert cfg.train.steps == 80 and cfg.train.lr == pytest.approx(3e-4)


@pytest.mark.plots("plot_experiment")  # metric.png, stability.png
def test_compare_end_to_end_on_toy2d(tmp_path, capsys):
    """Two arms x two seeds plus a third arm that diverges: trained, analysed, reported; re-running trains nothing."""
    path = _write_experiment(tmp_path, arms={
        "org": {"model.skip_scaling": "org"},
        "cs": {"model.skip_scaling": "cs", "model.kappa": 0.5},
        "broken": {"model.skip_scaling": "org", "debug.fault_nan_at_step": 50},
    })
    out = tmp_path / "out"
    assert main(["compare", str(path), "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    for name in ("report.md", "metric.png", "stability.png"):
        assert (out / name).stat().st_size > 0
    assert res["grid"] == [20, 40, 60, 80]
    # The baseline against itself: a time shift of exactly 1 on every seed.
    org = res["arms"]["org"]
    assert org["time_shift"]["final"]["forward"] == 1.0 and org["time_shift"]["final"]["per_seed"] == [1.0, 1.0]
    # The diverged arm is reported, not dropped: both seeds diverged at step 50, its curve is worst after.
    broken = res["arms"]["broken"]
    assert broken["diverged"] == [0, 1] and set(broken["diverged_at"].values()) == {50}
    assert broken["time_shift"]["final"]["per_seed_flags"] == [BEFORE, BEFORE]  # worse than anything org logged
    assert "seed 0 at step 50" in (out / "report.md").read_text()
    # Every claim gets a verdict with its numbers; stability and sensitivity were measured per seed.
    assert [c["verdict"] in ("holds", "does not hold", "inconclusive") for c in res["claims"]] == [True] * 3
    assert all(c["registration"] == "pre-registered" and len(c["per_seed"]) == 2 for c in res["claims"])
    assert "95% paired t-interval on log-ratios, n=2" in (out / "report.md").read_text()
    assert len(res["arms"]["cs"]["stability"]["grad/total"]["cv"]["per_seed"]) == 2
    assert all(float(v) > 0 for v in res["arms"]["cs"]["sensitivity"]["mean_per_seed"])
    # Resumable: finished runs are kept as they are.
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/result.json")}
    assert len(stamps) == 6
    assert main(["compare", str(path), "--out", str(out), "--quiet"]) == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/result.json")}
    # A report regenerated later quotes the command that trained the runs, and says how it was regenerated.
    ran = f"steadydiff compare {path} --out {out} --quiet"
    assert (out / "command.txt").read_text().strip() == ran
    (out / "lead.md").write_text("## Current answer\n\nSuperseded by a held-out run.\n")
    assert main(["compare", str(path), "--out", str(out), "--report-only"]) == 0
    md = (out / "report.md").read_text()
    assert f"- Command: `{ran}`" in md
    # The authors' lead comes first, before the description and the verdicts.
    assert md.index("Superseded by a held-out run.") < md.index("## Regime") < md.index("## Verdicts")
    assert md.splitlines()[2] == "## Current answer"
    regen = f"steadydiff compare {path} --out {out} --report-only"
    assert f"- Report regenerated from the finished runs by: `{regen}`" in md
    assert json.loads((out / "results.json").read_text())["command"] == ran
    # Pre-registration is the tool's: change one claim and add another after the runs exist.
    spec = yaml.safe_load(path.read_text())
    spec["claims"][0]["threshold"] = 0.9
    spec["claims"].append({"name": "cs is better at the end", "arm": "cs", "kind": "final"})
    spec["claims"].append({"name": "cs ends lower on loss", "arm": "cs", "kind": "final", "keys": ["loss"]})
    spec["calibrate"] = {"repeats": 3, "n": 100, "reference_n": 300}
    path.write_text(yaml.safe_dump(spec))
    assert main(["compare", str(path), "--out", str(out), "--report-only", "--calibrate"]) == 0
    status = {c["name"]: c["registration"] for c in json.loads((out / "results.json").read_text())["claims"]}
    assert status["cs is faster"].startswith("post hoc (changed after the first run")
    assert status["cs is better at the end"].startswith("post hoc (added after the first run")
    assert status["cs oscillates less"] == status["cs is less sensitive"] == "pre-registered"
    # A `keys` claim reads each run's last logged value of that series; a diverged run counts as the worst.
    rows = [json.loads(x) for x in (out / "runs/cs/seed-1/metrics.jsonl").read_text().splitlines()]
    last_loss = [r["loss"] for r in rows if "loss" in r][-1]
    res = json.loads((out / "results.json").read_text())
    assert res["arms"]["cs"]["final_of"]["loss"][1] == pytest.approx(last_loss)
    assert res["arms"]["broken"]["final_of"]["loss"] == ["inf", "inf"]
    assert len(res["arms"]["org"]["late_change_per_seed"]) == 2
    md = (out / "report.md").read_text()
    assert "post hoc (changed" in md and "post hoc (added" in md
    # Calibration: the metric re-measured with 3 sampling seeds at the final checkpoint, and a reference.
    cal = json.loads((out / "calibration.json").read_text())
    assert len(cal["runs"][0]["values"]) == 3 and cal["runs"][0]["sd"] > 0 and cal["mdr_noise"] > 1
    assert "## Metric noise (calibration)" in md
    # Without the runs (another machine), --report-only re-judges the stored results.json.
    (out / "runs").rename(tmp_path / "runs-elsewhere")
    before = json.loads((out / "results.json").read_text())["claims"]
    assert main(["compare", str(path), "--out", str(out), "--report-only"]) == 0
    assert "re-judged the claims from the stored results.json" in capsys.readouterr().out
    after = json.loads((out / "results.json").read_text())["claims"]
    assert [c["per_seed"] for c in after] == [c["per_seed"] for c in before]


@pytest.mark.plots("plot_experiment")  # sw_vs_nfe.png
def test_compare_with_nfe_budgets_claims_them_and_plots_metric_vs_nfe(tmp_path):
    """train.eval_nfe: eval/<metric>@nfe<N> keys are an experiment's metric and a final claim's keys; the
    report tabulates and plots the final value against NFE."""
    from steadydiff.experiments.spec import metric_interval, split_nfe

    base = yaml.safe_load(_write_experiment(tmp_path).read_text())["set"]
    path = _write_experiment(
        tmp_path, set={**base, "train.steps": 20, "train.eval_every": 20, "train.eval_n": 100,
                       "train.eval_nfe": [3, 6], "train.ckpt_every": 20, "model.depth": 4, "model.hidden": 32},
        sensitivity=False, metric={"key": "eval/sw@nfe6"},
        claims=[{"name": "cs ends lower at NFE 3", "arm": "cs", "kind": "final", "keys": ["eval/sw@nfe3"]}])
    exp = load_experiment(path)
    assert split_nfe(exp.metric) == ("eval/sw", 6) and split_nfe("eval/sw") == ("eval/sw", None)
    assert metric_interval(exp.run_config("org", 0), exp.metric) == 20
    out = tmp_path / "out"
    assert main(["compare", str(path), "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["grid"] == [20] and res["nfe"]["eval/sw"]["nfe"] == [3, 6]
    org = res["arms"]["org"]
    assert org["final_per_seed"] == res["nfe"]["eval/sw"]["arms"]["org"]["6"]
    assert org["final_of"]["eval/sw@nfe3"] == res["nfe"]["eval/sw"]["arms"]["org"]["3"]
    (claim,) = res["claims"]
    assert claim["verdict"] in ("holds", "does not hold", "inconclusive") and len(claim["per_seed"]) == 2
    md = (out / "report.md").read_text()
    assert "## Final eval/sw against network evaluations (NFE)" in md and "| arm | NFE 3 | NFE 6 |" in md
    assert "![sw vs NFE](sw_vs_nfe.png)" in md and (out / "sw_vs_nfe.png").stat().st_size > 0


def test_report_only_without_runs_is_a_clear_error(tmp_path, capsys):
    path = _write_experiment(tmp_path)
    assert main(["compare", str(path), "--out", str(tmp_path / "none"), "--report-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "have not finished" in err[0] and "without --report-only" in err[0]


def test_parallel_workers_train_the_same_runs(tmp_path):
    """workers=2 (spawned processes) gives the very trajectories the in-process runner gives."""
    from steadydiff.experiments import run_experiment

    path = _write_experiment(tmp_path, arms={"org": {}}, claims=[], sensitivity=False,
                             set={"train.steps": 20, "train.log_every": 5, "train.threads": 1,
                                  "model.depth": 4, "model.hidden": 32, "train.sample_n": 16,
                                  "train.sample_steps": 5})
    exp = load_experiment(path)
    run_experiment(exp, tmp_path / "serial", workers=1, show_progress=False)
    run_experiment(exp, tmp_path / "parallel", workers=2, show_progress=False)

    def losses(root, seed):
        rows = [json.loads(ln) for ln in (root / "runs" / "org" / f"seed-{seed}" / "metrics.jsonl").open()]
        return [r["loss"] for r in rows if "loss" in r]

    for seed in (0, 1):
        assert len(losses(tmp_path / "serial", seed)) == 4
        assert losses(tmp_path / "serial", seed) == losses(tmp_path / "parallel", seed)
    assert losses(tmp_path / "serial", 0) != losses(tmp_path / "serial", 1)  # seeds do differ


def _rep(arms: dict) -> dict:
    return {"arms": arms, "baseline": "base", "lower_is_better": True, "grid": []}


def test_claims_against_another_arm_and_in_either_direction():
    arms = {name: {"sensitivity": {"mean_per_seed": vals}} for name, vals in
            {"base": [1.0, 1.1, 0.9], "deep": [2.0, 2.2, 1.8], "deep_cs": [1.0, 1.05, 0.95]}.items()}
    grows = judge(Claim("grows", "deep", "sensitivity", direction="more"), _rep(arms))
    assert grows["value"] == pytest.approx(2.0) and grows["verdict"] == "holds"
    assert judge(Claim("shrinks", "deep", "sensitivity"), _rep(arms))["verdict"] == "does not hold"
    vs = judge(Claim("cs helps", "deep_cs", "sensitivity", versus="deep"), _rep(arms))
    geo = np.exp(np.mean(np.log([1.0 / 2.0, 1.05 / 2.2, 0.95 / 1.8])))  # the geometric mean of per-seed ratios
    assert vs["versus"] == "deep" and vs["value"] == pytest.approx(geo) and vs["verdict"] == "holds"


def test_paired_seeds_cancel_the_spread_both_arms_share():
    # Seeds differ a lot (x0.7 .. x1.4 on the whole curve), but in every seed the arm is 2x faster.
    scale = np.array([0.7, 1.0, 1.4, 0.85, 1.2])[:, None]
    c = _shift_claim(scale * exp_curve(1e-3), scale * exp_curve(2e-3), "half")
    assert c["per_seed"] == pytest.approx([2.0] * 5) and c["ci_low"] == pytest.approx(2.0)
    assert c["ci_high"] == pytest.approx(2.0) and c["verdict"] == "holds"


def test_final_claim_versus_another_arm_compares_with_that_arm():
    """`versus` on a final claim uses the named arm's finals, not the baseline's (paired, lower is better)."""
    arms = {"base": {"final_per_seed": [10.0, 12.0, 14.0]}, "a": {"final_per_seed": [5.0, 6.0, 7.0]},
            "b": {"final_per_seed": [4.0, 4.8, 5.6]}}
    vs_base = judge(Claim(name="a better", arm="a", kind="final"), _rep(arms))
    assert vs_base["versus"] == "base" and vs_base["value"] == pytest.approx(0.5) and vs_base["verdict"] == "holds"
    vs_b = judge(Claim(name="a better than b", arm="a", kind="final", versus="b"), _rep(arms))
    # a / b = 1.25 on every seed: a is worse than b, with no spread at all.
    assert vs_b["versus"] == "b" and vs_b["per_seed"] == pytest.approx([1.25] * 3)
    assert vs_b["value"] == pytest.approx(1.25) and vs_b["verdict"] == "does not hold"


def test_final_claim_on_keys_judges_the_mean_of_those_series():
    """`keys`: the per-seed mean of the named series' last values, paired against the baseline's; a non-
    inferiority claim (at most 5% worse) holds only when the whole interval lies below 1.05."""
    arms = {"base": {"final_per_seed": [1.0] * 3, "final_of": {"hi1": [1.0, 2.0, 3.0], "hi2": [3.0, 2.0, 1.0]}},
            "a": {"final_per_seed": [9.0] * 3, "final_of": {"hi1": [2.04, 2.0, 2.06], "hi2": [2.0, 2.04, 2.0]}}}
    c = judge(Claim(name="high noise not 5% worse", arm="a", kind="final", keys=["hi1", "hi2"], threshold=1.05),
              _rep(arms))
    # Means per seed: base 2, 2, 2; arm 2.02, 2.02, 2.03.
    assert c["per_seed"] == pytest.approx([1.01, 1.01, 1.015]) and c["verdict"] == "holds"
    worse = {"base": arms["base"], "a": {"final_of": {"hi1": [2.4, 2.3, 2.5], "hi2": [2.4, 2.5, 2.3]}}}
    assert judge(Claim(name="x", arm="a", kind="final", keys=["hi1", "hi2"], threshold=1.05),
                 _rep(worse))["verdict"] == "does not hold"
    # Results stored before `final_of` existed: said, not guessed.
    old = judge(Claim(name="x", arm="a", kind="final", keys=["hi1"]), _rep({"base": {}, "a": {}}))
    assert old["verdict"] == "inconclusive" and "not stored" in old["note"]


def test_late_change_is_the_log_slope_over_the_last_quarter():
    grid = list(range(100, 1601, 100))
    steps = np.asarray(grid, dtype=float)
    falling = np.exp(-2e-4 * steps)  # exactly exp(-0.2) per 1k steps everywhere
    flat = np.where(steps < 1000, 5.0 - steps / 1000, 4.0)  # plateaued well before the last quarter
    out = late_change(grid, np.stack([falling, flat]))
    assert out[0] == pytest.approx(np.expm1(-0.2)) and out[1] == pytest.approx(0.0, abs=1e-12)
    assert np.isnan(late_change([100, 200], np.array([[1.0, 0.9]]))[0])  # too few evaluations to fit


# ---------------------------------------------------------------------------------------------------------
# Time-shift speed-ups on curves with closed-form answers


def test_time_shift_on_linear_curves_is_exact():
    from steadydiff.experiments.speedup import BEYOND, EXTRAPOLATED, bound_of, time_shift

    steps = np.arange(50, 1001, 50, dtype=float)
    base = 10 - steps / 100  # loss falls 1 per 100 steps
    arm = 10 - 1.5 * steps / 100  # the same curve, 1.5x faster in time
    for f in (0.5, 0.6):
        res = time_shift(steps, base, arm, f)
        assert res["forward"] == pytest.approx(1.5) and res["forward_flag"] == ""
        assert res["reverse"] == pytest.approx(1.5) and res["reverse_flag"] == ""
    # At 75% the baseline needs 1125 steps: 125 past its budget, more than one interval (50): a lower bound.
    res = time_shift(steps, base, arm, 0.75)
    assert res["forward_flag"] == BEYOND and res["forward"] == pytest.approx(1050 / 750)
    assert bound_of(res["forward_flag"], forward=True) == ">="
    assert res["reverse"] == pytest.approx(1.5)
    # Within one interval the extrapolation is used and flagged.
    res = time_shift(steps, base, 10 - 1.04 * steps / 100, 1.0)
    assert res["forward_flag"] == EXTRAPOLATED and res["forward"] == pytest.approx(1.04)


def test_time_shift_of_an_arm_slightly_behind_is_slightly_below_one():
    from steadydiff.experiments.speedup import time_shift

    steps = np.arange(50, 401, 50, dtype=float)
    base = 100 * np.exp(-steps / 200) + 50  # still improving at the end
    lag = 12.0
    arm = 100 * np.exp(-(steps - lag) / 200) + 50  # the same curve, 12 steps late
    res = time_shift(steps, base, arm, 1.0)
    assert 0.95 < res["forward"] < 1.0  # ~ (400 - 12) / 400 = 0.97, up to linear interpolation
    assert res["forward"] == pytest.approx((400 - lag) / 400, abs=0.005)
    assert 0.95 < res["reverse"] < 1.0


def test_regime_table_and_horizons_tied_to_the_budget():
    from steadydiff.config import load_config
    from steadydiff.experiments.regime import lr_sum, regime, tied_horizons

    cfg = load_config(None, ["data.name=toy2d", "model.backbone=mlp_unet", "model.depth=6", "train.lr=1e-3",
                             "train.warmup_steps=10", "train.steps=100"])
    # Linear warm-up over 10 steps, then constant: 1e-3 x (sum_{k<10} (k + 1) / 10 + 90) = 0.0955.
    assert lr_sum(cfg) == pytest.approx(1e-3 * (5.5 + 90))
    r = regime(cfg, (2,))
    assert r["long_skips"] == 3 and r["batch"] == cfg.train.batch_size and r["clipping"] == "max norm 1.0"
    assert tied_horizons(cfg) == []
    clts = load_config(None, ["data.name=toy2d", "model.backbone=mlp_unet", "train.timesteps=clts",
                              "train.momentum=mdlrc", "train.lr_schedule=cosine"])
    assert len(tied_horizons(clts)) == 3
    fixed = load_config(None, ["data.name=toy2d", "model.backbone=mlp_unet", "train.timesteps=clts",
                               "train.clts_steps=800", "train.momentum=mdlrc", "train.momentum_steps=800"])
    assert tied_horizons(fixed) == []


def test_preregistration_record_and_status(tmp_path):
    from steadydiff.experiments.prereg import claim_status, record

    exp = load_experiment(_write_experiment(tmp_path))
    assert set(claim_status(exp, tmp_path).values()) == {"not recorded"}  # runs that predate the record
    assert record(exp, tmp_path) and not record(exp, tmp_path)  # written once, never overwritten
    assert set(claim_status(exp, tmp_path).values()) == {"pre-registered"}
    changed = load_experiment(_write_experiment(tmp_path, seeds=[0, 1, 2]))
    assert all(v.startswith("post hoc (arms, seeds") for v in claim_status(changed, tmp_path).values())
    declared = load_experiment(_write_experiment(tmp_path, claims=[
        {"name": "cs is faster", "arm": "cs", "kind": "speedup", "post_hoc": True}]))
    assert claim_status(declared, tmp_path) == {"cs is faster": "post hoc (declared in the experiment file)"}


@pytest.mark.parametrize("path", sorted(__import__("pathlib").Path(__file__).parents[1].glob("experiments/*.yaml")),
                         ids=lambda p: p.stem)
def test_every_committed_experiment_file_loads_and_configures_every_run(path):
    """An experiment file with a typo would fail only when someone runs it, after its pre-registration.
    Five claims of finished experiments, committed before the load-time check existed, ask for speed-ups above
    what their evaluation grid can report (1.06-1.125), and the four sign-tested claims of scalelong-edge-d12
    could never pass Holm's correction over its six claims on six seeds: they load only for re-judging
    (strict=False), and a new run of them is refused. (scalelong-main, never run, moved its 1.5x claim to half
    the budget.)"""
    unreachable = {"clts-mdlrc": 1, "combined": 2, "scalelong-unet": 1, "scalelong-uvit": 1, "scalelong-edge-d12": 4}
    exp = load_experiment(path, strict=False)
    assert len(exp.unreachable) == unreachable.get(path.stem, 0)
    if exp.unreachable:
        with pytest.raises(ConfigError, match="can never be shown|cannot hold even if every claim"):
            load_experiment(path)
    assert exp.baseline in exp.arms and len(exp.seeds) >= 1
    for arm in exp.arms:
        cfg = exp.run_config(arm, exp.seeds[0])
        assert cfg.train.seed == exp.seeds[0]


@pytest.mark.parametrize("name,depth", [("scalelong-edge-uvit-s2", 12), ("scalelong-edge-uvit-s2-d16", 16),
                                        ("edm2-edge-cifar10", None)])
def test_the_gpu_edge_files_are_at_the_papers_scale(name, depth):
    """The GPU edge files (issue 28 item 4, run by benchmarks/gpu_evidence.py --stage edge) load strictly and ask
    for what their descriptions pre-register: the CIFAR-10 store, batch 128, bf16, no clipping, a constant LR,
    5,000 steps, eight seeds for the sign tests under Holm; U-ViT-S/2 at its depth, or EDM2's MP UNet vs no MP at width
    128."""
    from pathlib import Path

    exp = load_experiment(Path(__file__).parents[1] / "experiments" / f"{name}.yaml")
    assert exp.lr_range is not None and len(exp.seeds) >= 8 and exp.multiplicity == "holm" and exp.paper
    assert "NOT RUN YET" in exp.description
    for arm in exp.arms:
        cfg = exp.run_config(arm, exp.seeds[0], ["train.lr=1e-3"])
        d, m, t = cfg.data, cfg.model, cfg.train
        assert (d.name, d.root, d.resolution) == ("store", "stores/cifar10", 32)
        assert (t.batch_size, t.bf16, t.grad_clip, t.lr_schedule, t.steps) == (128, True, None, "constant", 5000)
        if depth:
            assert (m.backbone, m.embed_dim, m.patch_size, m.num_heads, m.depth) == ("uvit", 512, 2, 8, depth)
            assert (tuple(t.betas), t.weight_decay) == ((0.99, 0.999), 0.03)
        else:
            assert m.backbone == ("unet" if arm == "no-mp" else "edm2") and m.channels == 128
            assert (tuple(t.betas), t.weight_decay, m.num_classes) == ((0.9, 0.99), 0.0, 0)


@pytest.mark.plots
def test_plot_series_draws_each_arms_seeds_from_their_metrics(tmp_path):
    """experiments/plot_series.py: the series read back from metrics.jsonl are the logged ones (rows without the
    key skipped), one panel per arm, a PNG written; a directory without runs is one line and exit 2."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[1] / "experiments" / "plot_series.py"
    spec = importlib.util.spec_from_file_location("plot_series", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for arm, scale in (("a", 1.0), ("b", 2.0)):
        for seed in (1, 2):
            run = tmp_path / "exp" / "runs" / arm / f"seed-{seed}"
            run.mkdir(parents=True)
            rows = [{"step": s, "loss": 9.0} if s % 2 else {"step": s, "val/loss": scale * seed / s}
                    for s in range(1, 9)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps, values = mod.read_series(tmp_path / "exp" / "runs" / "b" / "seed-2" / "metrics.jsonl", "val/loss")
    assert steps == [2, 4, 6, 8] and values == [2.0, 1.0, 4 / 6, 0.5]
    png = tmp_path / "val.png"
    assert mod.main([str(tmp_path / "exp"), "--png", str(png)]) == 0 and png.stat().st_size > 1000
    (tmp_path / "empty" / "runs").mkdir(parents=True)
    assert mod.main([str(tmp_path / "empty"), "--png", str(png)]) == 2


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    out = set()
    for stat in __import__("pathlib").Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/stat").exists(), reason="needs /proc")
def test_pool_workers_checkpoint_and_stop_when_the_command_is_killed(tmp_path):
    """`kill -9` of a `compare --workers 2` process alone: its two workers notice within seconds, checkpoint the
    step they are at and exit, instead of training on as orphans into run directories that a re-run trains too
    (it happened: a worker of a stopped lr-range checkpointed into a directory the next run then 'resumed'). Four
    runs on two workers: the executor has already queued a third run to a worker when the command dies, and a
    stopped worker must not start it (it happened too: the queued run trained to its end as an orphan)."""
    import signal
    import subprocess
    import sys
    import time

    path = _write_experiment(tmp_path, claims=[], sensitivity=False, seeds=[0, 1], set={
        **yaml.safe_load(_write_experiment(tmp_path).read_text())["set"], "train.steps": 100000,
        "train.eval_every": 0, "train.eval_metrics": [], "train.ckpt_every": 100000, "train.log_every": 5})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "steadydiff.cli", "compare", str(path), "--out", str(out),
                             "--workers", "2", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len([p for p in (out / "runs").glob("*/seed-*/metrics.jsonl")
                                              if p.stat().st_size > 500]) < 2:
            time.sleep(0.2)
        first = sorted(p.parent for p in (out / "runs").glob("*/seed-*/metrics.jsonl"))
        assert len(first) == 2, "the workers did not start training"
        workers = {w for w in _children(proc.pid) if "spawn_main" in open(f"/proc/{w}/cmdline").read()}
        assert len(workers) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 60
        while time.time() < deadline and any(__import__("os").path.exists(f"/proc/{w}") and
                                             open(f"/proc/{w}/stat").read().split()[2] != "Z" for w in workers):
            time.sleep(0.2)
        alive = [w for w in workers if __import__("os").path.exists(f"/proc/{w}")
                 and open(f"/proc/{w}/stat").read().split()[2] != "Z"]
        assert not alive, "pool workers kept training after their command was killed"
    finally:
        proc.kill()
    assert sorted(out.glob("runs/*/seed-*")) == first, "a stopped worker started a queued run"
    for rdir in first:
        assert not (rdir / "result.json").exists()  # unfinished: a re-run resumes it
        # The only checkpoint is the stop's (ckpt_every is 100,000), at a step it had logged.
        steps = [int(p.name.removeprefix("step-")) for p in (rdir / "checkpoints").glob("step-*")]
        logged = [json.loads(ln)["step"] for ln in (rdir / "metrics.jsonl").read_text().splitlines()]
        assert len(steps) == 1 and 0 < steps[0] < 100000 and steps[0] >= max(logged) - 5
