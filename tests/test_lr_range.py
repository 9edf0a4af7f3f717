"""`steadydiff lr-range` (issue 28 items 1 and 5): the instability rule on synthetic curves, censoring of the
max stable LR, the LR sensitivity, the claim kinds on bounds, the lr_range: block's bad inputs (one line, exit 2,
nothing written), and a tiny grid on toy2d end to end: layout, JSON schema, L0, reuse, resume, report-only and
pre-registration of the grid and rule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from steadydiff.cli import main
from steadydiff.experiments import analysis, prereg
from steadydiff.experiments.lr_range import untrained_model
from steadydiff.experiments.lr_rule import (
    LOWER,
    UPPER,
    Rule,
    RunOutcome,
    best_lr,
    judge_grid,
    judge_ramp,
    lr_sensitivity,
    max_stable_lr,
    parse_lr_range,
    ramp_lr,
    suggest_grid,
)
from steadydiff.experiments.spec import Claim, load_experiment

BASE = Path(__file__).resolve().parents[1] / "configs" / "toy2d.yaml"


# ---------------------------------------------------------------------------------------------------------
# The rule on synthetic curves


def _loss(n: int = 40, spike_at: int | None = None, height: float = 4.0) -> tuple[list[int], list[float]]:
    """A smoothly falling training loss logged every 2 steps, with one point `height` x the curve at `spike_at`."""
    steps = [2 * (i + 1) for i in range(n)]
    loss = [1.0 / (1.0 + 0.05 * i) for i in range(n)]
    if spike_at is not None:
        loss[spike_at] *= height
    return steps, loss


def _run(lr, final, **kw):
    steps, loss = kw.pop("curve", _loss())
    return RunOutcome(lr, final, loss_steps=steps, loss=loss, warmup=kw.pop("warmup", 10), **kw)


def test_rule_on_a_diverged_a_stalled_a_spiky_and_a_clean_run():
    runs = [_run(1e-4, 0.30),  # clean, a little worse than the best: stable
            _run(3e-4, 0.20),  # clean, the best
            _run(1e-3, 0.25, curve=_loss(spike_at=20)),  # spiky after the warm-up
            _run(3e-3, 0.50),  # stalled: 2.5x the best, above the best LR
            _run(1e-2, math.nan, diverged=True, diverged_at=37)]  # diverged
    v = judge_grid(runs, Rule())
    assert [x.stable for x in v] == [True, True, False, False, False]
    assert "trailing median at step 42" in v[2].reasons[0]
    assert v[3].reasons == ["final 0.5 > 1.5 x best 0.2"]
    assert v[4].reasons == ["diverged at step 37"]
    # The factor is the rule's: at 3x the stalled run passes.
    assert [x.stable for x in judge_grid(runs, Rule(factor=3.0))][3]
    # A spike during the warm-up is not judged; one just under k x its trailing median is not a spike.
    early = judge_grid([_run(1e-4, 0.2, curve=_loss(spike_at=6), warmup=30)], Rule())
    low = judge_grid([_run(1e-4, 0.2, curve=_loss(spike_at=20, height=2.9))], Rule())
    assert early[0].stable and low[0].stable
    assert not judge_grid([_run(1e-4, 0.2, curve=_loss(spike_at=20, height=2.9))], Rule(k=2.0))[0].stable


def test_the_trained_condition_catches_a_seed_that_collapses_everywhere():
    """The d12 report's weak spot: a seed whose best run reached only 0.69 of L0 = 1.1 and whose larger LRs all
    sat at the collapse level 1.0 (< 1.5 x 0.69) was stable to the grid's top. With trained: 0.5 the runs at and
    above the best LR that stayed above 0.5 x L0 did not train; one below the best LR is slow."""
    runs = [_run(3e-3, 0.90), _run(1e-2, 0.692), _run(3e-2, 1.008), _run(1e-1, 0.962), _run(3e-1, 1.0)]
    assert [v.stable for v in judge_grid(runs, Rule(), 1.101)] == [True] * 5
    v = judge_grid(runs, Rule(trained=0.5), 1.101)
    assert [x.stable for x in v] == [True, False, False, False, False] and v[0].slow
    assert v[1].reasons == ["did not train: final 0.692 > 0.5 x L0 1.101"]
    assert max_stable_lr([r.lr for r in runs], [x.stable for x in v]) == (3e-3, "")
    # L0 unknown: the condition is skipped, the rest of the rule unchanged.
    assert [x.stable for x in judge_grid(runs, Rule(trained=0.5))] == [True] * 5
    # A seed that trained is untouched by it.
    good = [_run(1e-2, 0.20), _run(3e-2, 0.15), _run(1e-1, 0.21)]
    assert [x.stable for x in judge_grid(good, Rule(trained=0.5), 1.0)] == [True] * 3
    assert "trained" not in parse_lr_range({"lrs": [1.0e-3]}).design()["rule"]
    assert parse_lr_range({"lrs": [1.0e-3], "rule": {"trained": 0.5}}).design()["rule"]["trained"] == 0.5


def test_a_slow_run_below_the_best_lr_is_marked_not_unstable():
    v = judge_grid([_run(1e-5, 0.9), _run(1e-4, 0.2), _run(1e-3, 0.9)], Rule())
    assert [(x.stable, x.slow) for x in v] == [(True, True), (True, False), (False, False)]
    assert max_stable_lr([1e-5, 1e-4, 1e-3], [x.stable for x in v]) == (1e-4, "")


def test_max_stable_lr_is_censored_at_both_ends_of_the_grid():
    lrs = [1e-4, 1e-3, 1e-2]
    assert max_stable_lr(lrs, [True, True, True]) == (1e-2, LOWER)  # stable at the top: only a lower bound
    assert max_stable_lr(lrs, [False, True, True]) == (None, UPPER)  # unstable at the bottom
    assert max_stable_lr(lrs, [True, False, True]) == (1e-4, "")  # every smaller LR must be stable too
    assert max_stable_lr(lrs, [True, True, False]) == (1e-3, "")


def test_best_lr_and_lr_sensitivity():
    lrs, l0 = [1e-4, 1e-3, 1e-2, 1e-1], 1.0
    finals, stable = [0.5, 0.3, 0.2, math.inf], [True, True, False, False]
    assert best_lr(lrs, finals, stable) == (1e-3, 0.3)  # the best among stable runs only
    assert best_lr(lrs, finals, [False] * 4) == (None, math.inf)
    # Wortsman et al.: mean over the grid of min(L, L0) - L*, L* = 0.2 over every run, a diverged run as L0.
    assert lr_sensitivity(finals, l0) == pytest.approx(np.mean([0.3, 0.1, 0.0, 0.8]))
    assert lr_sensitivity([0.2, 3.0], l0) == pytest.approx(np.mean([0.0, 0.8]))  # worse than L0 counts as L0
    assert lr_sensitivity([0.2, 0.2], l0) == 0.0
    assert math.isnan(lr_sensitivity([math.inf], l0)) and math.isnan(lr_sensitivity([0.2], math.nan))


# ---------------------------------------------------------------------------------------------------------
# Claims on the max stable LR and the best final loss


def _arm(tops, bounds, best=None):
    return {"max_stable_lr_per_seed": tops, "max_stable_lr_bounds": bounds,
            "best_final_per_seed": best or [0.2] * len(tops)}


def _judge(kind, arm, base, **claim):
    rep = {"arms": {"arm": arm, "base": base}, "baseline": "base", "lower_is_better": True,
           "lrs": [1e-4, 1e-3, 1e-2], "seeds": list(range(len(arm["max_stable_lr_per_seed"])))}
    return analysis.judge(Claim(name="c", arm="arm", kind=kind, **claim), rep)


def test_max_stable_lr_claim_passes_censoring_as_bounds():
    # The arm is stable over the whole grid on every seed (censored at the top), the baseline up to 1e-3.
    c = _judge("max_stable_lr", _arm([1e-2] * 6, [">="] * 6), _arm([1e-3] * 6, [""] * 6))
    assert c["per_seed"] == pytest.approx([10.0] * 6) and c["bounds"] == [">="] * 6
    assert c["verdict"] == "holds" and c["method"].startswith("exact sign test on known sides")
    assert "censored, lower bounds" in c["note"] and math.isnan(c["ci_high"])  # never a two-sided interval
    # Both censored at the top: the ratio's side is open; one below the bottom is an upper bound (lowest LR).
    c = _judge("max_stable_lr", _arm([1e-2, None], [">=", "<="]), _arm([1e-2, 1e-3], [">=", ""]))
    assert c["bounds"] == ["?", "<="] and c["per_seed"] == pytest.approx([1.0, 0.1])
    assert c["verdict"] == "inconclusive" and "upper bounds" in c["note"]
    # Exact values everywhere: the pre-registered t-test on the log-ratios.
    c = _judge("max_stable_lr", _arm([1e-3, 1e-3, 1e-2], [""] * 3), _arm([1e-4, 1e-3, 1e-3], [""] * 3))
    assert c["bounds"] == [""] * 3 and c["value"] == pytest.approx(10 ** (2 / 3))


def test_best_final_claim_compares_each_arm_at_its_own_best():
    c = _judge("best_final", _arm([1e-3] * 3, [""] * 3, best=[0.18, 0.19, 0.17]),
               _arm([1e-3] * 3, [""] * 3, best=[0.2, 0.2, 0.2]), threshold=1.0)
    assert c["per_seed"] == pytest.approx([0.9, 0.95, 0.85]) and c["claim"] == "less"
    c = _judge("best_final", _arm([None], ["<="], best=[math.inf]), _arm([1e-3], [""], best=[0.2]))
    assert c["bounds"] == [">="]  # no stable run: its worst outcome, a bound


def test_lr_sensitivity_claim_is_the_per_seed_ratio_and_flatter_is_less():
    arm, base = _arm([1e-3] * 6, [""] * 6), _arm([1e-3] * 6, [""] * 6)
    arm["lr_sensitivity_per_seed"] = [0.10, 0.12, 0.08, 0.11, 0.09, 0.10]
    base["lr_sensitivity_per_seed"] = [0.20, 0.20, 0.20, 0.22, 0.18, 0.25]
    c = _judge("lr_sensitivity", arm, base)
    assert c["per_seed"] == pytest.approx([a / b for a, b in zip(arm["lr_sensitivity_per_seed"],
                                                                   base["lr_sensitivity_per_seed"])])
    assert c["claim"] == "less" and c["verdict"] == "holds"
    assert _judge("lr_sensitivity", base, arm)["verdict"] == "does not hold"


# ---------------------------------------------------------------------------------------------------------
# Experiment files


def _spec(**changes):
    spec = {
        "name": "tiny-lr", "description": "an LR range on toy2d", "base": str(BASE),
        "set": {"train.steps": 20, "train.log_every": 2, "train.ckpt_every": 10, "train.sample_n": 8,
                "train.sample_steps": 2, "train.threads": 1, "train.warmup_steps": 4, "train.batch_size": 32,
                "model.depth": 2, "model.hidden": 16, "diagnostics.val_every": 10, "diagnostics.val_size": 32,
                "diagnostics.val_bins": 4},
        "baseline": "ok", "arms": {"ok": {}, "broken": {"debug.fault_nan_at_step": 5}}, "seeds": [0, 1],
        "metric": {"key": "val/loss"}, "lr_range": {"lrs": [1.0e-4, 2.0e-4]},
        "claims": [{"name": "broken tolerates less", "arm": "broken", "kind": "max_stable_lr"},
                   {"name": "broken ends worse", "arm": "broken", "kind": "best_final"}],
    }
    spec.update(changes)
    return spec


def _write(tmp_path, **changes):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(_spec(**changes)))
    return path


def _lr(**block):
    return {"lr_range": {"lrs": [1.0e-4, 2.0e-4], **block}}


def _ramp_set():
    """The tiny spec's `set` without its warm-up (a ramp has none of its own)."""
    return {k: v for k, v in _spec()["set"].items() if k != "train.warmup_steps"}


@pytest.mark.parametrize("change,args,needle", [
    (_lr(lrs=[]), [], "lr_range.lrs: give a non-empty list"),
    (_lr(lrs=[3.0e-4, 1.0e-4]), [], "must be strictly increasing"),
    (_lr(lrs=[1.0e-4, 1.0e-4]), [], "must be strictly increasing"),
    (_lr(lrs=[0.0, 1.0e-4]), [], "must be > 0"),
    (_lr(lrs=[-1.0e-3]), [], "must be > 0"),
    (_lr(lrs=[1.0e-4, "fast"]), [], "'fast' is not a learning rate"),
    (_lr(rule={"factr": 2}), [], "lr_range.rule: unknown key factr; valid: factor, k, window, trained"),
    (_lr(rule={"factor": 0.5}), [], "rule.factor: must be a number > 1"),
    (_lr(rule={"trained": 1.5}), [], "rule.trained: must be a number in (0, 1)"),
    (_lr(rule={"spike_key": 3}), [], "rule.spike_key: a logged series like loss or grad/total, or null"),
    (_lr(mode="ramps"), [], "lr_range.mode: 'ramps'; choose one of grid, ramp"),
    (_lr(mode="ramp", lrs=[1.0e-4, 1.0e-3, 1.0e-2]), [], "mode ramp sweeps from the first LR to the last; give "
                                                         "exactly two"),
    ({**_lr(mode="ramp"), "set": _ramp_set(), "arms": {"ok": {}, "broken": {"train.lr_schedule": "cosine"}}}, [],
     "arms.broken: sets train.lr_schedule, which mode ramp sets"),
    ({**_lr(mode="ramp"), "claims": []}, [], "experiment set: sets train.warmup_steps, which mode ramp sets"),
    ({**_lr(mode="ramp"), "set": _ramp_set()}, [], "a ramp (lr_range.mode: ramp) places a grid and makes no claims"),
    ({"lr_range": {"lrs": [1.0e-4], "grid": 1}}, [], "lr_range: unknown key grid"),
    ({"arms": {"ok": {}, "broken": {"train.lr": 1.0e-3}}}, [], "arms.broken: sets train.lr"),
    ({"set": {**_spec()["set"], "train.lr": 1.0e-3}}, [], "experiment set: sets train.lr"),
    ({}, ["--set", "train.lr=0.001"], "--set: sets train.lr"),
    ({"metric": {"key": "loss"}}, [], "set metric: {key: val/loss}"),
    ({"set": {**_spec()["set"], "diagnostics.val_every": 0}}, [], "diagnostics.val_every to a divisor"),
    ({"set": {**_spec()["set"], "diagnostics.val_every": 7}}, [], "diagnostics.val_every to a divisor"),
    ({"claims": [{"name": "x", "arm": "broken", "kind": "stability"}]}, [], "judged by `steadydiff compare`"),
    ({"sensitivity": True}, [], "experiment sensitivity: `steadydiff lr-range` does not measure it"),
])
def test_bad_lr_range_files_are_one_line_errors_and_write_nothing(tmp_path, capsys, change, args, needle):
    out = tmp_path / "out"
    assert main(["lr-range", str(_write(tmp_path, **change)), "--out", str(out), "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("steadydiff: error:") and needle in err[0]
    assert not out.exists()


def test_lr_range_claims_and_files_stay_apart_from_compare(tmp_path, capsys):
    out = tmp_path / "out"
    plain = _spec(claims=[{"name": "x", "arm": "broken", "kind": "max_stable_lr"}])
    del plain["lr_range"]
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(plain))
    assert main(["compare", str(path), "--out", str(out)]) == 2
    assert "reads an lr-range grid; add an lr_range: block" in capsys.readouterr().err
    assert main(["compare", str(_write(tmp_path)), "--out", str(out)]) == 2
    assert "run it with `steadydiff lr-range`" in capsys.readouterr().err
    del plain["claims"]
    path.write_text(yaml.safe_dump(plain))
    assert main(["lr-range", str(path), "--out", str(out)]) == 2
    assert "has no lr_range: block" in capsys.readouterr().err
    assert not out.exists()


def test_the_grid_and_rule_join_the_design_only_when_present(tmp_path):
    plain = _spec(claims=[])
    del plain["lr_range"]
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(plain))
    exp = load_experiment(path)
    # Unchanged for files without the block: records written before it existed still match.
    old = {"arms": exp.arms, "baseline": exp.baseline, "seeds": exp.seeds, "metric": exp.metric,
           "lower_is_better": exp.lower_is_better, "set": exp.set, "base": BASE.read_text()}
    assert prereg.design_hash(exp) == prereg._digest(old)
    hashes = {prereg.design_hash(load_experiment(_write(tmp_path, **change)))
              for change in ({}, _lr(rule={"factor": 2.0}), {"lr_range": {"lrs": [1.0e-4, 3.0e-4]}})}
    assert len(hashes) == 3
    assert parse_lr_range({"lrs": ["1e-4", 3.0e-4]}).lrs == (1e-4, 3e-4)  # YAML reads 1e-4 as a string


# ---------------------------------------------------------------------------------------------------------
# A tiny grid end to end


def test_lr_range_end_to_end_on_toy2d(tmp_path, capsys, monkeypatch):
    """2 arms x 2 LRs x 2 seeds: the healthy arm is stable over the grid (censored at its top), the broken one
    diverges at every LR; reuse, resume, report-only and the pre-registered rule."""
    import torch

    from steadydiff.diagnostics.validation import ValidationSet, validation_losses
    from steadydiff.experiments import runner
    from steadydiff.train import Trainer

    path, out = _write(tmp_path), tmp_path / "out"
    assert main(["lr-range", str(path), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "ok: max stable LR >= 0.0002, >= 0.0002; best LR" in printed
    assert "broken: max stable LR <= 0.0001, <= 0.0001; best LR -, -" in printed
    for name in ("lr_range.json", "lr_range.md", "lr_range.png", "preregistration.json"):
        assert (out / name).stat().st_size > 0
    # One ordinary run per (arm, lr, seed), trained at the grid's LR.
    dirs = sorted(str(p.parent.relative_to(out)) for p in out.glob("runs/*/*/*/result.json"))
    assert dirs == [f"runs/{arm}/lr-{lr}/seed-{s}" for arm in ("broken", "ok") for lr in ("0.0001", "0.0002")
                    for s in (0, 1)]
    cfg = yaml.safe_load((out / "runs/ok/lr-0.0002/seed-0/config.yaml").read_text())
    assert cfg["train"]["lr"] == pytest.approx(2e-4)
    # The JSON schema.
    res = json.loads((out / "lr_range.json").read_text())
    assert res["rule"] == {"factor": 1.5, "k": 3.0, "window": 50, "mode": "grid"}
    assert res["config"]["model"]["hidden"] == 16 and res["config"]["train"]["lr"] is None
    ok, broken = res["arms"]["ok"]["seeds"]["0"], res["arms"]["broken"]["seeds"]["0"]
    rows = [json.loads(ln) for ln in (out / "runs/ok/lr-0.0001/seed-0/metrics.jsonl").read_text().splitlines()]
    assert ok["final"]["0.0001"] == [r["val/loss"] for r in rows if "val/loss" in r][-1]
    assert ok["max_stable_lr"] == 2e-4 and ok["max_stable_lr_bound"] == ">="
    assert ok["best_lr"] in (1e-4, 2e-4) and ok["best_final"] == min(ok["final"].values())
    assert broken["max_stable_lr"] is None and broken["max_stable_lr_bound"] == "<=" and broken["best_lr"] is None
    assert broken["final"] == {"0.0001": "nan", "0.0002": "nan"}
    assert broken["runs"]["0.0002"]["reasons"] == ["diverged at step 5"]
    # L0 is the untrained network's validation loss: the trainer's own initial weights on the stored set.
    exp = load_experiment(path)
    cfg = exp.run_config("ok", 0, ["train.lr=1e-4"])
    trainer = Trainer(cfg, tmp_path / "fresh", show_progress=False)
    d = cfg.diagnostics
    val = ValidationSet.load_or_create(out / "runs/ok/lr-0.0001/seed-0/val.safetensors", trainer.context,
                                       d.val_size, d.val_bins, d.val_seed)
    with torch.no_grad():
        l0 = float(validation_losses(trainer.model, trainer.diffusion, val, 64).mean())
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.close()
    assert ok["init_loss"] == pytest.approx(l0, rel=1e-6) and ok["init_loss"] > max(ok["final"].values())
    mine = untrained_model(cfg)[2].state_dict()
    other = untrained_model(exp.run_config("ok", 1, ["train.lr=1e-4"]))[2].state_dict()
    assert mine.keys() == start.keys() and all(torch.equal(mine[k], start[k]) for k in start)
    assert not all(torch.equal(other[k], start[k]) for k in start)  # each seed its own initial weights
    assert ok["lr_sensitivity"] == pytest.approx(np.mean([v - ok["best_final"] for v in ok["final"].values()]))
    # Claims judged by the engine, censoring passed as bounds.
    claims = {c["name"]: c for c in res["claims"]}
    c = claims["broken tolerates less"]
    assert c["bounds"] == ["<=", "<="] and c["per_seed"] == [0.5, 0.5] and c["registration"] == "pre-registered"
    assert c["verdict"] == "inconclusive" and "upper bounds" in c["note"]
    assert claims["broken ends worse"]["per_seed"] == ["inf", "inf"]
    md = (out / "lr_range.md").read_text()
    assert ">= 0.0002 (censored: the grid's top)" in md and "diverged at step 5" in md and "## Regime" in md
    assert "| lr | grid 0.0001, 0.0002 |" in md and "## Verdicts" in md
    # A finished lr-range trains nothing: no run is started, no run file changes.
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/**/*") if p.is_file()}

    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(runner, "train_one", no_training)
    assert main(["lr-range", str(path), "--out", str(out), "--quiet"]) == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("runs/**/*") if p.is_file()}
    monkeypatch.undo()
    # An unfinished run (no result.json) resumes from its last checkpoint; the others are kept.
    (out / "runs/ok/lr-0.0002/seed-0/result.json").unlink()
    kept = out / "runs/ok/lr-0.0001/seed-0/result.json"
    before = kept.stat().st_mtime_ns
    assert main(["lr-range", str(path), "--out", str(out), "--quiet"]) == 0
    assert kept.stat().st_mtime_ns == before
    redone = json.loads((out / "runs/ok/lr-0.0002/seed-0/result.json").read_text())
    assert redone["final_step"] == 20 and redone["overrides"] == ["train.lr=0.0002"]
    assert json.loads((out / "lr_range.json").read_text())["arms"]["ok"]["seeds"]["0"]["final"] == ok["final"]
    # The rule is pre-registered: changing it afterwards makes every claim post hoc; --report-only trains nothing.
    path.write_text(yaml.safe_dump(_spec(**_lr(rule={"factor": 2.0}))))
    capsys.readouterr()
    assert main(["lr-range", str(path), "--out", str(out), "--report-only"]) == 0
    res = json.loads((out / "lr_range.json").read_text())
    assert res["rule"]["factor"] == 2.0
    assert all(c["registration"].startswith("post hoc (arms, seeds, metric, base config, LR grid or rule")
               for c in res["claims"])
    assert "Report regenerated from the finished runs by" in (out / "lr_range.md").read_text()
    # Report-only on runs that never trained: a one-line error naming the fix.
    assert main(["lr-range", str(path), "--out", str(tmp_path / "none"), "--report-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "8 of 8 runs have not finished" in err[0] and "without --report-only" in err[0]


# ---------------------------------------------------------------------------------------------------------
# mode: ramp (Smith's range test)


def test_the_exp_ramp_schedule_is_the_closed_form_geometric_ramp():
    from steadydiff.config import TrainConfig
    from steadydiff.train.schedules import build_lr_schedule

    t = TrainConfig(lr=1e-4, lr_ramp_end=1.0, lr_schedule="exp_ramp", warmup_steps=0, steps=101)
    lrs = np.array([t.lr * build_lr_schedule(t)(k) for k in range(101)], dtype=np.float64)
    # lr_k = 1e-4 * 10^(4 k / 100): one decade every 25 steps, exactly.
    assert np.allclose(lrs, 1e-4 * 10.0 ** (4 * np.arange(101) / 100), rtol=1e-12)
    assert lrs[0] == pytest.approx(1e-4) and lrs[-1] == pytest.approx(1.0)
    assert [ramp_lr(1e-4, 1.0, 101, k) for k in (0, 25, 100)] == pytest.approx([1e-4, 1e-3, 1.0])
    with pytest.raises(Exception, match="train.lr_ramp_end: must be > 0"):
        TrainConfig(lr_ramp_end=0.0).check()


def _ramp(val, **kw):
    steps = [10 * (i + 1) for i in range(len(val))]
    at = [1e-4 * 10.0 ** (i / 2) for i in range(len(val))]
    return judge_ramp(steps, val, at, Rule(), top_lr=at[-1], **kw), at


def test_ramp_rule_on_a_clean_a_degrading_a_diverged_a_spiky_and_an_early_edge():
    clean, at = _ramp([1.0, 0.6, 0.4, 0.35, 0.34])
    assert clean.edge_step is None and clean.bound == LOWER and clean.max_stable_lr == at[-1]
    assert clean.best_lr == at[4] and clean.best_val == 0.34
    # Falls to 0.3 at point 2, then 0.5 (< 1.5 x 0.3, still stable), then 0.9 (> 1.5 x 0.3): the edge.
    worse, at = _ramp([1.0, 0.6, 0.3, 0.44, 0.9, 2.0])
    assert worse.edge_step == 50 and "0.9 > 1.5 x the lowest before it 0.3" in worse.reason
    assert worse.max_stable_lr == at[3] and worse.bound == "" and worse.best_lr == at[2]
    gone, at = _ramp([1.0, 0.6, 0.4], diverged_at=25)
    assert gone.edge_step == 25 and gone.max_stable_lr == at[1] and gone.reason == "diverged at step 25"
    nonfinite, at = _ramp([1.0, 0.6, math.nan])
    assert nonfinite.edge_step == 30 and nonfinite.max_stable_lr == at[1]
    steps, loss = _loss(spike_at=12)  # a spike at step 26, between the validation points at 20 and 30
    spiky, at = _ramp([1.0, 0.6, 0.4, 0.3], loss_steps=steps, loss=loss)
    assert spiky.edge_step == 26 and "trailing median at step 26" in spiky.reason and spiky.max_stable_lr == at[1]
    early, _ = _ramp([1.0, 0.6], diverged_at=3)
    assert early.max_stable_lr is None and early.bound == UPPER and early.best_lr is None


def test_suggested_grid_brackets_every_best_lr_and_edge_on_the_half_decade_ladder():
    assert suggest_grid([0.004, 0.01], [0.03, 0.05]) == [0.003, 0.01, 0.03, 0.1]
    assert suggest_grid([1e-3], [1e-3]) == [1e-3, 3e-3]
    assert suggest_grid([2e-4, None], [0.3, None]) == [1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0]
    assert suggest_grid([None], [None]) == []


def test_lr_range_ramp_end_to_end_on_toy2d(tmp_path, capsys, monkeypatch):
    """One ramp per (arm, seed): the healthy arm's LR follows the exponential ramp in its log and gets a max
    stable LR and best LR on the ramp; the broken arm's edge is its divergence; a re-run trains nothing."""
    from steadydiff.experiments import runner

    spec = _spec(claims=[], seeds=[0], **_lr(mode="ramp", lrs=[1.0e-3, 1.0]))
    spec["set"] = {**spec["set"], "train.steps": 40, "diagnostics.val_every": 4}
    del spec["set"]["train.warmup_steps"]  # the ramp's own: none
    path, out = tmp_path / "ramp.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(spec))
    assert main(["lr-range", str(path), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "ok: max stable LR" in printed and "broken: max stable LR" in printed
    dirs = sorted(str(p.parent.relative_to(out)) for p in out.glob("runs/*/*/*/result.json"))
    assert dirs == ["runs/broken/ramp/seed-0", "runs/ok/ramp/seed-0"]
    cfg = yaml.safe_load((out / "runs/ok/ramp/seed-0/config.yaml").read_text())["train"]
    assert (cfg["lr_schedule"], cfg["lr"], cfg["lr_ramp_end"], cfg["warmup_steps"]) == ("exp_ramp", 1e-3, 1.0, 0)
    rows = [json.loads(ln) for ln in (out / "runs/ok/ramp/seed-0/metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["lr"]) for r in rows if "lr" in r]
    assert len(logged) >= 10
    # The logged LR at step s is that of the update just taken (step s - 1), on the closed-form ramp.
    assert all(lr == pytest.approx(1e-3 * 1000.0 ** ((s - 1) / 39), rel=1e-6) for s, lr in logged)
    res = json.loads((out / "lr_range.json").read_text())
    assert res["rule"]["mode"] == "ramp" and res["claims"] == []
    ok, broken = res["arms"]["ok"]["seeds"]["0"], res["arms"]["broken"]["seeds"]["0"]
    val = [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r]
    assert ok["curve"]["step"] == [s for s, _ in val] and ok["curve"]["val"] == [v for _, v in val]
    assert ok["curve"]["lr"] == pytest.approx([1e-3 * 1000.0 ** ((s - 1) / 39) for s, _ in val])
    lowest = min(v for s, v in val if ok["edge_step"] is None or s < ok["edge_step"])
    assert ok["best_final"] == lowest and ok["best_lr"] in ok["curve"]["lr"]
    assert broken["reason"] == "diverged at step 5" and broken["edge_step"] == 5
    assert broken["max_stable_lr"] == pytest.approx(1e-3 * 1000.0 ** (3 / 39))  # its one point, step 4
    grid = res["suggested_grid"]
    assert grid and grid[0] <= min(ok["best_lr"], broken["best_lr"]) and grid[-1] > ok["max_stable_lr"]
    md = (out / "lr_range.md").read_text()
    assert "Suggested grid" in md and "diverged at step 5" in md and "| lr | ramp 0.001 -> 1 (exponential) |" in md
    assert (out / "lr_range.png").stat().st_size > 0
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/**/*") if p.is_file()}
    monkeypatch.setattr(runner, "train_one", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained again")))
    assert main(["lr-range", str(path), "--out", str(out), "--quiet"]) == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("runs/**/*") if p.is_file()}


def test_the_spike_series_is_chosen_in_the_rule_and_a_nonpositive_one_is_flagged():
    from steadydiff.experiments.lr_range import spike_series_warnings

    rule = parse_lr_range({"lrs": [1.0e-3], "rule": {"spike_key": None}}).rule
    assert rule.spike_key is None and rule.as_dict()["spike_key"] is None
    assert "spike_key" not in parse_lr_range({"lrs": [1.0e-3]}).design()["rule"]  # the default keeps old designs
    assert parse_lr_range({"lrs": [1.0e-3], "rule": {"spike_key": "grad/total"}}).rule.spike_key == "grad/total"
    # EDM2's training loss with the learned log-variance goes below 0: the report says the spike test misreads it.
    assert spike_series_warnings("loss", 0) == [] and spike_series_warnings(None, 3) == []
    (w,) = spike_series_warnings("loss", 3)
    assert "`loss`, which has values <= 0 after the warm-up in 3 run(s)" in w and "spike_key" in w


def test_claims_that_holm_could_never_pass_are_refused_before_anything_trains(tmp_path, capsys):
    """Holm over k claims: the best any claim can do is the smallest p of its test on these seeds (2/2^n for the
    sign test, two-sided; ~0 for t). Three sign claims on 6 seeds: 3 x 2/64 = 0.094 >= 0.05, none can hold; one
    sign claim among two t claims can (it comes last: 1 x 2/64); two sign claims among two t claims cannot on 6
    seeds (2 x 2/64 = 0.0625) and can on 7 (2 x 2/128 = 0.031)."""
    from steadydiff.experiments.inference import holm, seeds_for_p, smallest_p

    assert smallest_p("sign", 6) == 2 / 64 and smallest_p("t", 6) == 0.0 and seeds_for_p(0.025, "sign") == 7
    assert holm([2 / 64] * 3) == pytest.approx([6 / 64] * 3)  # the arithmetic the check relies on

    def claims(tests, post_hoc=()):
        return [{"name": f"c{i}", "arm": "broken", "kind": "best_final" if t == "t" else "max_stable_lr", "test": t,
                 "post_hoc": i in post_hoc} for i, t in enumerate(tests)]

    def unreachable(tests, seeds=6, post_hoc=(), multiplicity="holm"):
        path = _write(tmp_path, claims=claims(tests, post_hoc), seeds=list(range(seeds)), multiplicity=multiplicity)
        return sorted(load_experiment(path, strict=False).unreachable)

    assert unreachable(["sign"] * 3) == ["c0", "c1", "c2"]
    assert unreachable(["sign"] * 3, multiplicity="none") == []
    assert unreachable(["t", "t", "sign"]) == []
    assert unreachable(["sign", "t", "t", "sign"]) == ["c0", "c3"]
    assert unreachable(["sign", "t", "t", "sign"], seeds=7) == []
    assert unreachable(["sign"] * 3, post_hoc=(1, 2)) == []  # exploratory claims are not in Holm's family
    # Refused in one line, naming what would make it reachable, and nothing is written.
    path = _write(tmp_path, claims=claims(["sign", "t", "t", "sign"]), seeds=list(range(6)), multiplicity="holm")
    out = tmp_path / "out"
    assert main(["lr-range", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "with Holm's correction over 4 confirmatory claims it cannot hold" in err[0]
    assert "use >= 7 seeds, fewer claims, or test: t" in err[0] and not out.exists()
