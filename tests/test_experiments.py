"""Experiments: steps-to-target, speed-ups and bootstrap CIs on synthetic curves with known answers, spec
validation, and a tiny arms x seeds experiment on toy2d end to end through `steadydiff compare`."""

import json
import math

import numpy as np
import pytest
import yaml

from steadydiff.cli import main
from steadydiff.config import ConfigError
from steadydiff.experiments import load_experiment
from steadydiff.experiments.speedup import (
    baseline_targets,
    fill_diverged,
    percentile_ci,
    ratio_of_means_ci,
    speedup_ci,
    steps_to_target,
    verdict,
)

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


def test_targets_are_the_final_value_and_the_value_at_half_the_budget():
    t = baseline_targets(GRID, np.linspace(10, 1, len(GRID)))
    assert t["final"] == 1.0
    assert t["half"] == pytest.approx(np.linspace(10, 1, len(GRID))[4])  # step 500 of 1000


# ------------------------------------------------------------------------------------------------------
# speed-ups


def test_twice_as_fast_arm_gives_speedup_two():
    # Noise-free: the baseline reaches its final value exp(-1) at step 1000, the arm (rate x2) at step 500.
    base = np.stack([exp_curve(1e-3)] * 3)
    arm = np.stack([exp_curve(2e-3)] * 3)
    s = speedup_ci(GRID, base, arm, "final", n_boot=200)
    assert s.base_steps == 1000 and s.arm_steps == pytest.approx(500)
    assert s.speedup == pytest.approx(2.0)
    assert s.ci_low == pytest.approx(2.0) and s.ci_high == pytest.approx(2.0)  # identical seeds: no spread
    # Half target exp(-0.5): the arm crosses it between its evaluations at 200 and 300, where the straight
    # line through exp(-0.4) and exp(-0.6) puts the crossing slightly after the true 250.
    half = speedup_ci(GRID, base, arm, "half", n_boot=50)
    e = np.exp
    crossing = 200 + 100 * (e(-0.4) - e(-0.5)) / (e(-0.4) - e(-0.6))
    assert half.base_steps == 500 and half.arm_steps == pytest.approx(crossing)
    assert half.speedup == pytest.approx(500 / crossing) and 1.97 < half.speedup < 2.0


def test_noisy_seeds_give_a_ci_that_covers_the_truth_and_excludes_one():
    base = np.stack([exp_curve(1e-3, 0.03, seed=s) for s in range(5)])
    arm = np.stack([exp_curve(2e-3, 0.03, seed=10 + s) for s in range(5)])
    s = speedup_ci(GRID, base, arm, "final", n_boot=1000, seed=1)
    assert s.ci_low < 2.0 < s.ci_high or s.ci_low == pytest.approx(2.0, rel=0.05)
    assert s.ci_low > 1.0  # a 2x effect with 3% evaluation noise is never confused with no effect
    assert verdict(s.ci_low, s.ci_high, 1.0) == "holds"


def test_an_arm_that_never_reaches_the_target_has_speedup_zero():
    base = np.stack([exp_curve(1e-3)] * 3)
    arm = np.stack([exp_curve(1e-4)] * 3)  # ten times slower: ends far above exp(-1)
    s = speedup_ci(GRID, base, arm, "final", n_boot=100)
    assert s.arm_steps == math.inf and s.speedup == 0.0
    assert (s.ci_low, s.ci_high) == (0.0, 0.0)
    assert verdict(s.ci_low, s.ci_high, 1.0) == "does not hold"


def test_a_diverged_seed_is_counted_not_dropped():
    base = np.stack([exp_curve(1e-3)] * 3)
    good = exp_curve(2e-3)
    diverged = fill_diverged(good[:3], len(GRID))  # NaN after the 3rd evaluation
    arm = np.stack([good, good, diverged])
    s = speedup_ci(GRID, base, arm, "final", n_boot=500, seed=3)
    # The seed-mean curve is infinite from step 400 on, so the arm as a whole never gets there ...
    assert s.speedup == 0.0
    # ... but resamples without the diverged seed do, at 2x: the CI spans both outcomes.
    assert s.ci_low == 0.0 and s.ci_high == pytest.approx(2.0)
    assert verdict(s.ci_low, s.ci_high, 1.0) == "inconclusive"


def test_the_baseline_against_itself_is_exactly_one():
    base = np.stack([exp_curve(1e-3, 0.05, seed=s) for s in range(4)])
    s = speedup_ci(GRID, base, base, "final", n_boot=200, paired=True)
    assert s.speedup == 1.0 and s.ci_low == 1.0 and s.ci_high == 1.0


def test_percentile_ci_and_ratio_of_means():
    lo, hi = percentile_ci([0.0, 1.0, 2.0, math.inf] * 25)
    assert lo == 0.0 and hi == math.inf  # no interpolation, so infinities do not turn into nan
    p, lo, hi = ratio_of_means_ci([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], n_boot=100)
    assert (p, lo, hi) == (0.5, 0.5, 0.5)
    p, lo, hi = ratio_of_means_ci([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], n_boot=500)
    assert p == pytest.approx(2.0) and lo < 2.0 < hi


@pytest.mark.parametrize("low,high,higher,expected", [
    (1.2, 1.8, True, "holds"), (0.5, 0.9, True, "does not hold"), (0.8, 1.3, True, "inconclusive"),
    (0.5, 0.9, False, "holds"), (1.1, 1.4, False, "does not hold"), (math.nan, 2.0, True, "inconclusive"),
])
def test_verdict(low, high, higher, expected):
    assert verdict(low, high, 1.0, higher_is_better=higher) == expected


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
    ({"base": "missing.yaml"}, "base config"),
])
def test_bad_experiment_files_fail_before_training(tmp_path, change, needle):
    with pytest.raises(ConfigError, match=needle):
        load_experiment(_write_experiment(tmp_path, **change))


def test_overrides_layer_experiment_arm_seed_and_command_line(tmp_path):
    exp = load_experiment(_write_experiment(tmp_path))
    cfg = exp.run_config("cs", 1, ["train.lr=3e-4"])
    assert (cfg.model.skip_scaling, cfg.model.kappa, cfg.train.seed) == ("cs", 0.5, 1)
    assert cfg.train.steps == 80 and cfg.train.lr == pytest.approx(3e-4)


def test_compare_end_to_end_on_toy2d(tmp_path, capsys):
    """Two arms x two seeds plus a third arm that diverges: trained, analysed, reported; re-running trains nothing."""
    path = _write_experiment(tmp_path, arms={
        "org": {"model.skip_scaling": "org"},
        "cs": {"model.skip_scaling": "cs", "model.kappa": 0.5},
        "broken": {"model.skip_scaling": "org", "train.fault_nan_at_step": 50},
    })
    out = tmp_path / "out"
    assert main(["compare", str(path), "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    for name in ("report.md", "metric.png", "stability.png"):
        assert (out / name).stat().st_size > 0
    assert res["grid"] == [20, 40, 60, 80]
    # The baseline is the reference; its final target is its own seed-mean final value.
    org = res["arms"]["org"]
    assert org["speedup"]["final"]["speedup"] == 1.0
    assert res["targets"]["final"] == pytest.approx(np.mean(org["final_per_seed"]))
    # The diverged arm is reported, not dropped: both seeds diverged at step 50, its curve is worst after.
    broken = res["arms"]["broken"]
    assert broken["diverged"] == [0, 1] and set(broken["diverged_at"].values()) == {50}
    assert broken["speedup"]["final"]["speedup"] == 0.0
    assert "seed 0 at step 50" in (out / "report.md").read_text()
    # Every claim gets a verdict with its numbers; stability and sensitivity were measured per seed.
    assert [c["verdict"] in ("holds", "does not hold", "inconclusive") for c in res["claims"]] == [True] * 3
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
    assert main(["compare", str(path), "--out", str(out), "--report-only"]) == 0
    md = (out / "report.md").read_text()
    assert f"- Command: `{ran}`" in md
    regen = f"steadydiff compare {path} --out {out} --report-only"
    assert f"- Report regenerated from the finished runs by: `{regen}`" in md
    assert json.loads((out / "results.json").read_text())["command"] == ran


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


def test_claims_against_another_arm_and_in_either_direction():
    from steadydiff.experiments.analysis import judge
    from steadydiff.experiments.spec import Claim

    arms = {name: {"sensitivity": {"mean_per_seed": vals}} for name, vals in
            {"base": [1.0, 1.1, 0.9], "deep": [2.0, 2.2, 1.8], "deep_cs": [1.0, 1.05, 0.95]}.items()}
    grows = judge(Claim("grows", "deep", "sensitivity", direction="more"), arms, "base", 1.0, 500)
    assert grows["value"] == pytest.approx(2.0) and grows["verdict"] == "holds"
    assert judge(Claim("shrinks", "deep", "sensitivity"), arms, "base", 1.0, 500)["verdict"] == "does not hold"
    vs = judge(Claim("cs helps", "deep_cs", "sensitivity", versus="deep"), arms, "base", 1.0, 500)
    assert vs["versus"] == "deep" and vs["value"] == pytest.approx(0.5) and vs["verdict"] == "holds"


def test_paired_seeds_cancel_the_spread_both_arms_share():
    # Seeds differ a lot (x0.7 .. x1.4 on the whole curve), but in every seed the arm is 2x faster.
    scale = np.array([0.7, 1.0, 1.4, 0.85, 1.2])[:, None]
    base = scale * exp_curve(1e-3)
    arm = scale * exp_curve(2e-3)
    paired = speedup_ci(GRID, base, arm, "final", n_boot=500, paired=True)
    unpaired = speedup_ci(GRID, base, arm, "final", n_boot=500)
    assert paired.speedup == pytest.approx(2.0)
    assert paired.ci_low == pytest.approx(2.0) and paired.ci_high == pytest.approx(2.0)
    assert unpaired.ci_high - unpaired.ci_low > 0.5  # the shared spread shows up when arms are resampled apart
    p, lo, hi = ratio_of_means_ci([1.0, 2.0, 3.0], [0.9, 1.8, 2.7], n_boot=300, paired=True)
    assert (p, lo, hi) == pytest.approx((0.9, 0.9, 0.9))


def test_final_claim_versus_another_arm_compares_with_that_arm():
    """`versus` on a final claim uses the named arm's finals, not the baseline's (paired, lower is better)."""
    from steadydiff.experiments.analysis import judge
    from steadydiff.experiments.spec import Claim

    arms = {"base": {"final_per_seed": [10.0, 12.0, 14.0], "final_ratio": {"ratio": 1.0, "ci_low": 1.0,
                                                                          "ci_high": 1.0}},
            "a": {"final_per_seed": [5.0, 6.0, 7.0], "final_ratio": {"ratio": 0.5, "ci_low": 0.5, "ci_high": 0.5}},
            "b": {"final_per_seed": [4.0, 4.8, 5.6]}}
    vs_base = judge(Claim(name="a better", arm="a", kind="final"), arms, "base", 1.0, 500)
    assert vs_base["versus"] == "base" and vs_base["value"] == 0.5 and vs_base["verdict"] == "holds"
    vs_b = judge(Claim(name="a better than b", arm="a", kind="final", versus="b"), arms, "base", 1.0, 500)
    # a / b = 1.25 on every seed, so every paired resample gives 1.25 too: a is worse than b.
    assert vs_b["versus"] == "b"
    assert vs_b["value"] == pytest.approx(1.25) and vs_b["ci_low"] == pytest.approx(1.25)
    assert vs_b["ci_high"] == pytest.approx(1.25) and vs_b["verdict"] == "does not hold"
