"""The `lr_range:` block of an experiment file and its pre-registered instability rule (`steadydiff lr-range`).

    lr_range:
      lrs: [1.0e-4, 3.0e-4, 1.0e-3, 3.0e-3]   # the grid: positive, strictly increasing
      rule: {factor: 1.5, k: 3, window: 50}   # the instability rule (these are its defaults; trained: off)
      mode: grid                              # or ramp: Smith's range test, to place a grid quickly

The grid trains every (arm, LR, seed) as an ordinary run; the rule and the grid are part of the design that
`prereg.py` records before anything trains, like the claims. For one arm and seed, a run is **unstable** when

1. it diverged: a non-finite loss stopped it, or it logged no finite final validation loss;
2. its final validation loss (the experiment's metric: `val/loss` or `val/ema_loss`, on the run's fixed
   stratified validation set, `diagnostics/validation.py`) is more than `factor` times the best final
   validation loss of that arm and seed over the grid, at an LR *above* the one that reached the best (it
   stalled or degraded). A run that much worse at an LR *below* the best one trained too slowly: it is marked
   `slow`, not unstable, so that a grid starting at too small an LR still has a stable range;
3. its logged training loss (`loss`, one point per `train.log_every` steps; `rule.spike_key` names another
   positive series, or null for none) at steps >= `train.warmup_steps` has a spike: a point above `k` times
   the trailing median of the (up to) `window` points before it, once it has 5 of them
   (`diagnostics.stats.spike_indices`, the rule documented there);
4. (only with `rule.trained: f`) it did not train: its final validation loss is above f x L0, the validation
   loss of the untrained network on the same set (below the best LR such a run is `slow`, as in 2). Without
   it, a seed whose every LR collapses to the same poor loss would be "stable" everywhere.

From the verdicts over the grid:

* **max stable LR**: the largest grid LR such that it and every smaller grid LR are stable. It is censored at
  both ends: stable at the grid's top, it is only a lower bound (">=" the top LR); unstable already at the
  grid's bottom, it is null, and an upper bound ("<=" the smallest LR) where a claim compares it.
* **best LR**: the grid LR with the lowest final validation loss among the stable runs (null when none is).
* **LR sensitivity** (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
  instabilities", arXiv 2309.14322): E_lr[min(L(lr), L0) - L*], the expectation over learning rates drawn
  log-uniformly from the grid's range, taken as the mean over the grid's LRs (exact for a grid evenly spaced
  in log LR); L(lr) the final validation loss at lr, L* the best of them over the grid, L0 the validation loss
  of the untrained network on the same set. A diverged run counts as L0. 0 means every LR reaches the best
  loss; L0 - L* means only one does.

**mode: ramp** (Smith 2017, "Cyclical learning rates", arXiv 1506.01186, Sec. 3.3): one run per (arm, seed)
whose LR rises exponentially from the grid's first LR at step 0 to its last at the final step (the LR schedule
`exp_ramp`, no warm-up), scored on the validation set every `diagnostics.val_every` steps. A validation point
at step s is read at the LR of the step before it (the last update it saw). The ramp's **edge** is the first of:
the run diverged; a validation point above `factor` times the lowest one before it; a training-loss spike as
in 3. Its max stable LR is the LR of the last validation point before the edge (">=" the top LR when there is
no edge; null, "<=" the first point's LR, when the edge comes before any point), its best LR that of the lowest
validation point before the edge. A ramp is a scan to place a grid, not a test: it makes no claims, because a
ramp's LR and training time move together (a later point has both a larger LR and more steps behind it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..diagnostics.stats import spike_indices
from ..utils.errors import ConfigError

MODES = ("grid", "ramp")
LOWER, UPPER, EXACT = ">=", "<=", ""  # the bound a max stable LR is: at the grid's top, at its bottom, a value


@dataclass(frozen=True)
class Rule:
    """The instability rule's parameters (see the module docstring)."""

    factor: float = 1.5  # unstable above this many times the best final validation loss (above the best LR)
    k: float = 3.0  # a training-loss spike: above k x its trailing median
    window: int = 50  # points in the trailing median
    # A run "did not train" when its final validation loss is above trained x L0 (the untrained network's); off
    # when None. Without it a seed whose every LR collapses to the same poor loss counts as stable everywhere.
    trained: float | None = None
    # The logged series condition 3 reads (null: no spike condition). It must be positive: EDM2's training loss
    # with the learned log-variance u (Eq. 21) is lambda/e^u err + u, which goes below 0, and "k x its median"
    # then means nothing; there, use null or another positive series.
    spike_key: str | None = "loss"

    def as_dict(self) -> dict[str, Any]:
        """The rule as recorded: `trained` and `spike_key` only when not at their defaults, so files written before
        they existed keep their recorded design."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if not ((k == "trained" and v is None) or (k == "spike_key" and v == "loss"))}


@dataclass(frozen=True)
class LRRange:
    """An experiment's `lr_range:` block, validated."""

    lrs: tuple[float, ...]
    rule: Rule = field(default_factory=Rule)
    mode: str = "grid"

    def design(self) -> dict[str, Any]:
        """What the pre-registration records of it (`prereg.design_hash`)."""
        return {"lrs": list(self.lrs), "rule": self.rule.as_dict(), "mode": self.mode}


def lr_tag(lr: float) -> str:
    """The canonical name of a grid LR: in run directories (`lr-<tag>`) and as the key of lr_range.json."""
    return f"{lr:.3g}"


def _number(v: Any) -> float | None:
    """A YAML number (PyYAML reads `1e-4`, without a dot, as a string)."""
    if isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def parse_lr_range(raw: Any) -> LRRange:
    """The `lr_range:` block, or a one-line ConfigError naming the fix."""
    where = "experiment lr_range"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping like {{lrs: [1.0e-4, 3.0e-4, 1.0e-3], rule: {{factor: 1.5}}}}")
    keys = ("lrs", "rule", "mode")
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]}; valid: {', '.join(keys)}")
    lrs = raw.get("lrs")
    if not isinstance(lrs, list) or not lrs:
        raise ConfigError(f"{where}.lrs: give a non-empty list of learning rates like [1.0e-4, 3.0e-4, 1.0e-3]")
    values = []
    for v in lrs:
        x = _number(v)
        if x is None or not math.isfinite(x):
            raise ConfigError(f"{where}.lrs: {v!r} is not a learning rate; give numbers like 3.0e-4")
        if x <= 0:
            raise ConfigError(f"{where}.lrs: every learning rate must be > 0, got {v!r}; drop it")
        if values and x <= values[-1]:
            raise ConfigError(f"{where}.lrs: must be strictly increasing, got {v!r} after {values[-1]:g}; sort them "
                              "and drop repeats")
        if values and lr_tag(x) == lr_tag(values[-1]):
            raise ConfigError(f"{where}.lrs: {values[-1]:g} and {x:g} both name the run directory lr-{lr_tag(x)}; "
                              "space them further apart")
        values.append(x)
    rule_raw = raw.get("rule") or {}
    if not isinstance(rule_raw, dict):
        raise ConfigError(f"{where}.rule: expected a mapping like {{factor: 1.5, k: 3, window: 50}}")
    names = [f.name for f in dataclasses.fields(Rule)]
    bad = sorted(set(rule_raw) - set(names))
    if bad:
        raise ConfigError(f"{where}.rule: unknown key {bad[0]}; valid: {', '.join(names)}")
    rule = {}
    if rule_raw.get("trained") is not None:
        x = _number(rule_raw["trained"])
        if x is None or not 0 < x < 1:
            raise ConfigError(f"{where}.rule.trained: must be a number in (0, 1) (a fraction of the untrained "
                              f"network's validation loss) or null, got {rule_raw['trained']!r}")
        rule["trained"] = x
    if "spike_key" in rule_raw:
        key = rule_raw["spike_key"]
        if key is not None and (not isinstance(key, str) or not key):
            raise ConfigError(f"{where}.rule.spike_key: a logged series like loss or grad/total, or null (no spike "
                              f"condition), got {key!r}")
        rule["spike_key"] = key
    for name, lowest in (("factor", 1.0), ("k", 1.0)):
        if name in rule_raw:
            x = _number(rule_raw[name])
            if x is None or not x > lowest or not math.isfinite(x):
                raise ConfigError(f"{where}.rule.{name}: must be a number > {lowest:g}, got {rule_raw[name]!r}")
            rule[name] = x
    if "window" in rule_raw:
        w = rule_raw["window"]
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ConfigError(f"{where}.rule.window: must be an integer >= 1 (points), got {w!r}")
        rule["window"] = w
    mode = str(raw.get("mode", "grid"))
    if mode not in MODES:
        raise ConfigError(f"{where}.mode: {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "ramp" and len(values) != 2:
        raise ConfigError(f"{where}.lrs: mode ramp sweeps from the first LR to the last; give exactly two, like "
                          f"[1.0e-4, 1.0], got {len(values)}")
    return LRRange(tuple(values), Rule(**rule), mode)


# ---------------------------------------------------------------------------------------------------------
# The rule, on what the runs logged


@dataclass
class RunOutcome:
    """What the rule reads of one run of the grid."""

    lr: float
    final: float  # the final validation loss (non-finite, or nan, when the run diverged or logged none)
    diverged: bool = False
    diverged_at: int | None = None
    loss_steps: Sequence[int] = ()  # the logged training loss, for the spike test
    loss: Sequence[float] = ()
    warmup: int = 0  # train.warmup_steps: points logged before it are not judged


@dataclass
class Verdict:
    """The rule's verdict on one run: stable or not, and why; `slow` marks a run far worse than the best at a
    smaller LR (not unstable)."""

    lr: float
    stable: bool
    reasons: list[str] = field(default_factory=list)
    slow: bool = False


def best_final(runs: Sequence[RunOutcome]) -> tuple[float, float | None]:
    """(the best final validation loss over the grid, its LR); (nan, None) when no run has a finite one."""
    ok = [(r.final, r.lr) for r in runs if not r.diverged and math.isfinite(r.final)]
    return min(ok) if ok else (math.nan, None)


def judge_grid(runs: Sequence[RunOutcome], rule: Rule, init_loss: float = math.nan) -> list[Verdict]:
    """The rule's verdict on every run of one arm and seed over the grid (module docstring); `init_loss`: L0,
    read only by `rule.trained` (which is skipped when L0 is unknown)."""
    best, best_lr_ = best_final(runs)
    out = []
    for r in runs:
        v = Verdict(r.lr, True)
        if r.diverged or not math.isfinite(r.final):
            v.stable = False
            v.reasons.append("diverged" + (f" at step {r.diverged_at}" if r.diverged_at is not None else ""))
            out.append(v)
            continue
        if r.final > rule.factor * best:
            if r.lr > best_lr_:
                v.stable = False
                v.reasons.append(f"final {r.final:.4g} > {rule.factor:g} x best {best:.4g}")
            else:
                v.slow = True
        if rule.trained is not None and math.isfinite(init_loss) and r.final > rule.trained * init_loss:
            if r.lr >= best_lr_:
                v.stable = False
                v.reasons.append(f"did not train: final {r.final:.4g} > {rule.trained:g} x L0 {init_loss:.4g}")
            else:
                v.slow = True
        if len(r.loss):
            spikes = spike_indices(np.asarray(r.loss, dtype=np.float64), k=rule.k, window=rule.window,
                                   warmup=r.warmup, steps=np.asarray(r.loss_steps, dtype=np.float64))
            if spikes:
                v.stable = False
                v.reasons.append(f"training loss above {rule.k:g}x its trailing median at step "
                                 f"{int(r.loss_steps[spikes[0]])}" + (f" (+{len(spikes) - 1} more)" if len(spikes) > 1
                                                                       else ""))
        out.append(v)
    return out


def max_stable_lr(lrs: Sequence[float], stable: Sequence[bool]) -> tuple[float | None, str]:
    """(max stable LR, its bound): the largest LR with it and every smaller one stable; ">=" when that is the
    grid's top, "<=" with None when the smallest LR is already unstable, "" otherwise."""
    n = 0
    while n < len(stable) and stable[n]:
        n += 1
    if n == 0:
        return None, UPPER
    return lrs[n - 1], (LOWER if n == len(lrs) else EXACT)


def best_lr(lrs: Sequence[float], finals: Sequence[float], stable: Sequence[bool]) -> tuple[float | None, float]:
    """(the stable LR with the lowest final validation loss, that loss); (None, inf) when no run is stable."""
    ok = [(f, lr) for lr, f, s in zip(lrs, finals, stable) if s and math.isfinite(f)]
    if not ok:
        return None, math.inf
    f, lr = min(ok)
    return lr, f


def lr_sensitivity(finals: Sequence[float], init_loss: float) -> float:
    """Wortsman et al.'s LR sensitivity, mean over the grid of min(L(lr), L0) - L* (a non-finite L(lr), a
    diverged run, counts as L0); nan when no run has a finite final loss or L0 is unknown."""
    ok = [f for f in finals if math.isfinite(f)]
    if not ok or not math.isfinite(init_loss):
        return math.nan
    best = min(ok)
    return float(np.mean([min(f if math.isfinite(f) else init_loss, init_loss) - best for f in finals]))


# ---------------------------------------------------------------------------------------------------------
# mode: ramp


def ramp_lr(lr_start: float, lr_end: float, steps: int, step: float) -> float:
    """The LR of `exp_ramp` at optimiser step `step` (0-based) of a `steps`-step run (`train/schedules.py`)."""
    return lr_start * (lr_end / lr_start) ** min(1.0, step / max(1, steps - 1))


@dataclass
class RampVerdict:
    """One ramp run, judged (module docstring): its edge and why, the max stable and best LR."""

    edge_step: int | None  # the step where the edge was found (None: no edge)
    reason: str
    max_stable_lr: float | None
    bound: str
    best_lr: float | None
    best_val: float


def judge_ramp(val_steps: Sequence[int], val: Sequence[float], lrs_at: Sequence[float], rule: Rule, *,
               diverged_at: int | None = None, loss_steps: Sequence[int] = (), loss: Sequence[float] = (),
               top_lr: float) -> RampVerdict:
    """The ramp's verdict from its validation points (`val` at `val_steps`, read at the LRs `lrs_at`), its
    divergence step and its logged training loss. `top_lr`: the ramp's last LR (the censoring bound)."""
    edges: list[tuple[int, str]] = []
    if diverged_at is not None:
        edges.append((int(diverged_at), f"diverged at step {diverged_at}"))
    lowest = math.inf
    for s, v in zip(val_steps, val):
        if not math.isfinite(v):
            edges.append((int(s), f"non-finite validation loss at step {s}"))
            break
        if v > rule.factor * lowest:
            edges.append((int(s), f"validation loss {v:.4g} > {rule.factor:g} x the lowest before it {lowest:.4g} at "
                                  f"step {s}"))
            break
        lowest = min(lowest, v)
    if len(loss):
        spikes = spike_indices(np.asarray(loss, dtype=np.float64), k=rule.k, window=rule.window, warmup=0,
                               steps=np.asarray(loss_steps, dtype=np.float64))
        if spikes:
            s = int(loss_steps[spikes[0]])
            edges.append((s, f"training loss above {rule.k:g}x its trailing median at step {s}"))
    edge, reason = min(edges) if edges else (None, "no edge: stable to the ramp's top")
    before = [(v, lr) for s, v, lr in zip(val_steps, val, lrs_at) if (edge is None or s < edge) and math.isfinite(v)]
    if not before:
        return RampVerdict(edge, reason, None, UPPER, None, math.inf)
    best_val, best = min(before)
    if edge is None:
        return RampVerdict(None, reason, top_lr, LOWER, best, best_val)
    return RampVerdict(edge, reason, before[-1][1], EXACT, best, best_val)


def suggest_grid(best_lrs: Sequence[float | None], max_stable: Sequence[float | None]) -> list[float]:
    """A grid to run next: the half-decade points (1 and 3 x 10^k) from the one at or below the smallest best LR
    to the first above the largest max stable LR, so the grid brackets every arm's best LR and edge."""
    lows = [x for x in best_lrs if x]
    highs = [x for x in max_stable if x]
    if not lows or not highs:
        return []

    def ladder(k: int) -> float:  # ..., 1e-3, 3e-3, 1e-2, ... indexed by k
        return float(f"{(1.0 if k % 2 == 0 else 3.0) * 10.0 ** (k // 2):.3g}")

    k = math.floor(2 * math.log10(min(lows))) - 1
    while ladder(k + 1) <= min(lows):
        k += 1
    grid = [ladder(k)]
    while grid[-1] <= max(highs):
        k += 1
        grid.append(ladder(k))
    return grid
