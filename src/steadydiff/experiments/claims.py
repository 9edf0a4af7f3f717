"""Claim kinds: what an experiment can claim about an arm, one class per kind in CLAIM_KINDS.

Every kind reduces a claim to per-seed paired ratios, arm / versus arm on the same seed, that
`inference.judge_ratios` judges against the claim's threshold. A kind says three things:
    validate   which of a claim's fields it accepts (checked when the experiment file is loaded)
    judge      the per-seed ratios from an analysed report (`analysis.analyse`, or a stored results.json),
               and on which side of the threshold the claim lies
    label      the quantity, as report.md's verdict table names it
A new kind is a class here and one line in CLAIM_KINDS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..utils.errors import ConfigError
from ..utils.registry import Registry
from .speedup import BEFORE, BEYOND


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


def per_seed_ratios(base: list[float], arm: list[float]) -> list[float]:
    """arm / base per seed (NaN where base is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return [float(a / b) if b != 0 else math.nan for a, b in zip(arm, base)]


class ClaimKind:
    """The fields every kind shares are checked in `spec.load_experiment`; a kind accepts `versus` (another
    arm than the baseline) unless `takes_versus` is False, and `keys` only if `takes_keys`."""

    takes_versus = True
    takes_keys = False
    reads_time_to_target = False  # its verdict reads steps-to-target, so budget-tied schedule horizons matter

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

    def judge(self, claim, arm, versus, rep):
        ts = arm["time_shift"][claim.target]
        ev = Evidence(None, more=True, value=ts["forward"],
                      extra={"mean_curve": {k: ts[k] for k in ("forward", "forward_flag", "reverse", "reverse_flag")}})
        if ts.get("per_seed") is None:  # `rerender` of results stored without per-seed curves
            ev.note = "per-seed curves were not stored with these runs: seed-mean estimate only, no interval"
        else:
            ev.ratios = ts["per_seed"]
            censored = sum(f in (BEYOND, BEFORE) for f in ts["per_seed_flags"])
            if censored:
                ev.note = (f"{censored} per-seed crossings were outside the budget + one interval and enter at "
                           "their bound")
        return ev

    def label(self, c, versus):
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


CLAIM_KINDS: Registry[ClaimKind] = Registry("claim kind")
CLAIM_KINDS.add("speedup", SpeedupClaim())
CLAIM_KINDS.add("final", FinalClaim())
CLAIM_KINDS.add("stability", StabilityClaim())
CLAIM_KINDS.add("sensitivity", SensitivityClaim())
