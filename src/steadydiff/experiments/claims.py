"""Claim kinds: what an experiment can claim about an arm, one class per kind in CLAIM_KINDS.

Every kind reduces a claim to per-seed paired ratios, arm / versus arm on the same seed, that
`inference.judge_ratios` judges against the claim's threshold. A kind says three things:
    validate   which of a claim's fields it accepts (checked when the experiment file is loaded)
    judge      the per-seed ratios from an analysed report (`analysis.analyse`, or a stored results.json),
               and on which side of the threshold the claim lies
    label      the quantity, as report.md's verdict table names it
A new kind is a class here and one line in CLAIM_KINDS. A kind reads either a `compare` report or, with
`lr_range = True`, an `lr-range` one (`lr_range.py`); an experiment file may claim only the kinds its command
judges (`spec.load_experiment`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..utils.errors import ConfigError
from ..utils.registry import Registry
from .speedup import BEFORE, BEYOND, EXTRAPOLATED, INTERPOLATED, monotone_fit, reach_step


@dataclass
class Evidence:
    """What a kind reads off the report for one claim: the per-seed ratios (None when the report lacks
    them), whether the claim is that the ratio is above the threshold (`more`), a note for report.md, the
    estimate to show when there are no ratios, and extra fields for the judged claim."""

    ratios: list[float] | None
    more: bool
    note: str = ""
    value: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)
    bounds: list[str] | None = None  # per seed: "" a value, ">=" / "<=" a bound, "?" open (`judge_ratios`)


def per_seed_ratios(base: list[float], arm: list[float]) -> list[float]:
    """arm / base per seed. Every seed is kept: a statistic of 0 on one side gives 0 or +inf (a bound with a
    known side), 0 on both sides NaN (a tie), a diverged run (inf) +inf or 0 (`inference.judge_ratios`)."""
    out = []
    for a, b in zip(arm, base):
        a, b = float(a), float(b)
        if b == 0:
            out.append(math.nan if a == 0 else math.copysign(math.inf, a))
        elif math.isinf(a) and math.isinf(b):
            out.append(math.nan)  # both diverged: a tie
        else:
            out.append(a / b)
    return out


# How a crossing flag bounds a forward time-shift speed-up (the baseline's step / the arm's): the baseline's
# crossing found past the grid is a lower bound on its step, so the speed-up is at least that; one found by
# extrapolating the last segment of a decelerating curve comes too early, so it is a lower bound too; a
# crossing already at the first evaluation is an upper bound on the step.
FORWARD_BOUND = {BEYOND: ">=", EXTRAPOLATED: ">=", BEFORE: "<=", INTERPOLATED: ""}


def level_speedup(steps, base_curve, arm_curve, level: float, lower_is_better: bool) -> tuple[float, str]:
    """(speed-up, bound) to reach metric `level`: the baseline's step over the arm's (both crossings on the
    monotone fits). Each crossing outside the grid bounds its step; bounds that point opposite ways leave the
    side open ("?")."""
    b, bf = reach_step(steps, monotone_fit(steps, base_curve, lower_is_better), level, lower_is_better)
    a, af = reach_step(steps, monotone_fit(steps, arm_curve, lower_is_better), level, lower_is_better)
    ratio = b / a if a > 0 else math.inf
    # b >= its value makes the ratio >=; a >= its value makes it <= (and the other way round for "before").
    signs = {FORWARD_BOUND[bf], {">=": "<=", "<=": ">=", "": ""}[FORWARD_BOUND[af]]} - {""}
    return ratio, (signs.pop() if len(signs) == 1 else "?" if signs else "")


class ClaimKind:
    """The fields every kind shares are checked in `spec.load_experiment`; a kind accepts `versus` (another
    arm than the baseline) unless `takes_versus` is False, and `keys` only if `takes_keys`."""

    takes_versus = True
    takes_keys = False
    reads_time_to_target = False  # its verdict reads steps-to-target, so budget-tied schedule horizons matter
    lr_range = False  # it reads an lr-range report (`steadydiff lr-range`), not a compare one

    def validate(self, claim, arms: dict[str, Any], where: str) -> None:
        if claim.versus is not None and (claim.versus not in arms or not self.takes_versus):
            fixed = ", ".join(k for k, kind in CLAIM_KINDS.items() if not kind.takes_versus)
            raise ConfigError(f"{where}: versus {claim.versus!r} must name an arm, and {fixed} claims are always "
                              "against the baseline")
        if claim.keys is not None and (not self.takes_keys or not isinstance(claim.keys, list) or not claim.keys
                                       or not all(isinstance(k, str) for k in claim.keys)):
            takers = ", ".join(k for k, kind in CLAIM_KINDS.items() if kind.takes_keys)
            raise ConfigError(f"{where}: keys must be a non-empty list of metrics.jsonl keys, and only on kind: "
                              f"{takers}")

    def judge(self, claim, arm: dict[str, Any], versus: dict[str, Any], rep: dict[str, Any]) -> Evidence:
        raise NotImplementedError

    def label(self, c: dict[str, Any], versus: str) -> str:
        raise NotImplementedError


class SpeedupClaim(ClaimKind):
    """Time-shift speed-up at `target` (half | three_quarters | final: 50 / 75 / 100% of the budget): the step
    at which the baseline reaches the arm's value there, over that step; holds if above `threshold`."""

    takes_versus = False
    reads_time_to_target = True

    def validate(self, claim, arms, where):
        super().validate(claim, arms, where)
        if claim.target_value is not None and not isinstance(claim.target_value, int | float):
            raise ConfigError(f"{where}: target_value must be a number (a metric level), got {claim.target_value!r}")

    def judge(self, claim, arm, versus, rep):
        if claim.target_value is not None:
            return self._judge_level(claim, arm, versus, rep)
        ts = arm["time_shift"].get(claim.target)
        if ts is None:  # the target lies before the first evaluation (`claims_that_cannot_hold` says so at load)
            return Evidence(None, more=True, note=f"no evaluation at or before target {claim.target}")
        ev = Evidence(None, more=True, value=ts["forward"],
                      extra={"mean_curve": {k: ts[k] for k in ("forward", "forward_flag", "reverse", "reverse_flag")}})
        if ts.get("per_seed") is None:  # `rerender` of results stored without per-seed curves
            ev.note = "per-seed curves were not stored with these runs: seed-mean estimate only, no interval"
        else:
            ev.ratios = ts["per_seed"]
            ev.bounds = [FORWARD_BOUND[f] for f in ts["per_seed_flags"]]
            beyond = sum(f == BEYOND for f in ts["per_seed_flags"])
            extrapolated = sum(f == EXTRAPOLATED for f in ts["per_seed_flags"])
            if beyond or extrapolated:
                ev.note = (f"{beyond + extrapolated} of {len(ev.ratios)} per-seed crossings lie past the last "
                           f"evaluation ({beyond} beyond it, {extrapolated} extrapolated on a flattening curve): "
                           "they are lower bounds, not values")
        return ev

    def _judge_level(self, claim, arm, versus, rep):
        """The steps the baseline and the arm need to reach `target_value`, per paired seed."""
        level, lower = float(claim.target_value), rep["lower_is_better"]
        if arm.get("curves_per_seed") is None or versus.get("curves_per_seed") is None:
            return Evidence(None, True, note="per-seed curves were not stored with these runs")
        steps = rep["grid"]
        pairs = [level_speedup(steps, [float(v) for v in b], [float(v) for v in a], level, lower)
                 for b, a in zip(versus["curves_per_seed"], arm["curves_per_seed"])]
        ev = Evidence([r for r, _ in pairs], more=True, bounds=[b for _, b in pairs])
        n_bound = sum(b != "" for _, b in pairs)
        if n_bound:
            ev.note = (f"{n_bound} of {len(pairs)} seeds crossed {level:g} outside the evaluation grid on one side: "
                       "their speed-ups are bounds")
        return ev

    def label(self, c, versus):
        if c.get("target_value") is not None:
            return f"speed-up to reach {c['target_value']:g} (baseline's steps / arm's) vs {versus}"
        return f"time-shift speed-up at {c.get('target', 'final')} budget vs {versus}"


class FinalClaim(ClaimKind):
    """arm / versus ratio of the final metric; holds if on the better side of `threshold`. With `keys: [a, b,
    ...]` the value is instead the mean of those metrics.jsonl series at their last logged step (e.g. the
    high-noise bins `val/ema_loss/bin7..9`, or a final-only `eval/fd_fmnist`); they share the metric's
    direction."""

    takes_keys = True

    def judge(self, claim, arm, versus, rep):
        more = not rep["lower_is_better"]
        if not claim.keys:
            return Evidence(per_seed_ratios(versus["final_per_seed"], arm["final_per_seed"]), more)
        if all(k in arm.get("final_of", {}) and k in versus.get("final_of", {}) for k in claim.keys):
            return Evidence(per_seed_ratios(*(np.mean([x["final_of"][k] for k in claim.keys], axis=0).tolist()
                                              for x in (versus, arm))), more)
        return Evidence(None, more, note=f"{', '.join(claim.keys)} were not stored with these runs")

    def label(self, c, versus):
        if c.get("keys"):
            return f"ratio of the mean final {', '.join(c['keys'])} vs {versus}"
        return f"final metric ratio vs {versus}"


class StabilityClaim(ClaimKind):
    """arm / versus ratio of `stat` of `series` (oscillation statistics); holds if below `threshold` (less
    oscillation), or above it with `direction: more`."""

    def judge(self, claim, arm, versus, rep):
        more = claim.direction == "more"
        sa, sb = arm["stability"].get(claim.series, {}), versus["stability"].get(claim.series, {})
        if claim.stat in sa and claim.stat in sb:
            return Evidence(per_seed_ratios(sb[claim.stat]["per_seed"], sa[claim.stat]["per_seed"]), more)
        return Evidence(None, more, note=f"{claim.stat} of {claim.series} was not logged or not computed for these "
                                         "runs")

    def label(self, c, versus):
        return f"{c.get('stat', '')} of {c.get('series', '')}, ratio vs {versus}"


class SensitivityClaim(ClaimKind):
    """arm / versus ratio of the mean input sensitivity R(t); holds if below `threshold`, or above it with
    `direction: more` (e.g. "sensitivity grows with depth")."""

    def judge(self, claim, arm, versus, rep):
        more = claim.direction == "more"
        if "sensitivity" in arm and "sensitivity" in versus:
            return Evidence(per_seed_ratios(versus["sensitivity"]["mean_per_seed"],
                                            arm["sensitivity"]["mean_per_seed"]), more)
        return Evidence(None, more, note="set sensitivity: true in the experiment")

    def label(self, c, versus):
        return f"mean R(t), ratio vs {versus}"


# How a censored max stable LR bounds a ratio: the arm's bound keeps its sign, the reference's flips.
_FLIP = {">=": "<=", "<=": ">=", "": ""}


class MaxStableLRClaim(ClaimKind):
    """lr-range: arm / versus ratio of the max stable LR on each seed (`lr_rule.py`); holds if above
    `threshold` (the arm tolerates larger learning rates). A max stable LR at the grid's top is only a lower
    bound, one below the grid's bottom an upper bound (the smallest LR): the ratio of such a seed is a bound,
    or open when the two bounds point opposite ways, and is judged as one (`inference.judge_ratios`)."""

    lr_range = True

    def judge(self, claim, arm, versus, rep):
        lowest = float(rep["lrs"][0])
        ratios, bounds = [], []
        for va, ba, vb, bb in zip(arm["max_stable_lr_per_seed"], arm["max_stable_lr_bounds"],
                                  versus["max_stable_lr_per_seed"], versus["max_stable_lr_bounds"]):
            a, b = (lowest if v is None else float(v) for v in (va, vb))
            ratios.append(a / b)
            signs = {ba, _FLIP[bb]} - {""}
            bounds.append(signs.pop() if len(signs) == 1 else "?" if signs else "")
        ev = Evidence(ratios, more=True, bounds=bounds)
        top = sum(b == ">=" for x in (arm, versus) for b in x["max_stable_lr_bounds"])
        bottom = sum(b == "<=" for x in (arm, versus) for b in x["max_stable_lr_bounds"])
        parts = []
        if top:
            parts.append(f"{top} max stable LRs are at the grid's top ({rep['lrs'][-1]:g}): censored, lower bounds")
        if bottom:
            parts.append(f"{bottom} are below the grid's bottom (unstable at {lowest:g}): upper bounds")
        ev.note = "; ".join(parts)
        return ev

    def label(self, c, versus):
        return f"max stable LR, ratio vs {versus}"


class BestFinalClaim(ClaimKind):
    """lr-range: arm / versus ratio of the best final validation loss on each seed, each arm at its own best
    (stable) LR; holds if on the better side of `threshold`. An arm with no stable run on a seed counts as its
    worst outcome (inf), a bound."""

    lr_range = True

    def judge(self, claim, arm, versus, rep):
        return Evidence(per_seed_ratios(versus["best_final_per_seed"], arm["best_final_per_seed"]),
                        more=not rep["lower_is_better"])

    def label(self, c, versus):
        return f"best final validation loss (each arm at its own best LR), ratio vs {versus}"


class LRSensitivityClaim(ClaimKind):
    """lr-range: arm / versus ratio of the LR sensitivity on each seed (Wortsman et al. 2023, `lr_rule.py`: the
    mean over the grid of min(L(lr), L0) - L*); holds if below `threshold` (the arm's loss-vs-LR curve is
    flatter). A seed with an unknown L0 (no stored validation set) has no value (nan): a tie, it drops out."""

    lr_range = True

    def judge(self, claim, arm, versus, rep):
        return Evidence(per_seed_ratios(versus["lr_sensitivity_per_seed"], arm["lr_sensitivity_per_seed"]),
                        more=claim.direction == "more")

    def label(self, c, versus):
        return f"LR sensitivity, ratio vs {versus}"


CLAIM_KINDS: Registry[ClaimKind] = Registry("claim kind")
CLAIM_KINDS.add("speedup", SpeedupClaim())
CLAIM_KINDS.add("final", FinalClaim())
CLAIM_KINDS.add("stability", StabilityClaim())
CLAIM_KINDS.add("sensitivity", SensitivityClaim())
CLAIM_KINDS.add("max_stable_lr", MaxStableLRClaim())
CLAIM_KINDS.add("best_final", BestFinalClaim())
CLAIM_KINDS.add("lr_sensitivity", LRSensitivityClaim())
