"""Experiment files: a base config, arms (config overrides), seeds, a metric, and the claims to judge.

    name: scalelong-unet
    base: ../configs/demo.yaml            # relative to this file
    set: {train.steps: 600}               # overrides for every arm
    baseline: org
    arms:
      org: {model.skip_scaling: org}
      cs-0.5: {model.skip_scaling: cs, model.kappa: 0.5}
    seeds: [0, 1, 2]
    metric: {key: eval/fd_fmnist, lower_is_better: true}
    stability: [loss, grad/total]         # metrics.jsonl series whose oscillation is summarised
    sensitivity: true                     # input sensitivity R(t) of every final EMA model
    claims:
      - {name: "CS is faster", arm: cs-0.5, kind: speedup, target: final, threshold: 1.0}

Claim kinds (`claims.py`: speedup, final, stability, sensitivity, each documented there), each a per-seed
paired ratio judged by `inference.judge_ratios` (a paired t-interval on log-ratios, and the claim's
pre-registered `test`: t | wilcoxon | sign, at alpha 0.05).

A speed-up claim reads the time shift at `target` (a fraction of the budget), or, with `target_value: LEVEL`,
the steps the baseline and the arm need to reach that metric level. A claim no outcome could make hold is
refused at load (`claims_that_cannot_hold`). `multiplicity: holm` applies Holm's correction to the confirmatory
(pre-registered) claims; every report states the family-wise chance of a false "holds".

`versus: ARM` compares final / stability / sensitivity with another arm instead of the baseline, and
`direction: more` claims a ratio above the threshold (e.g. "sensitivity grows with depth"). `post_hoc: true`
marks a claim chosen after seeing data; the tool also marks, by itself, every claim added or changed after
the experiment's first run (`prereg.py`).

Optional blocks: `paper:` states the paper's regime beside ours (keys of `regime.REGIME_ROWS`, plus `source`,
`in_regime: false` when the runs are outside it, and `note`); `calibrate:` sets how `compare --calibrate`
measures metric noise (`repeats`, `n`, `reference_n`, `arms`, `seeds`, `metrics`, `sizes`); `lr_range:` makes
the file an LR-range experiment, run by `steadydiff lr-range` (every arm x LR x seed, a pre-registered
instability rule, claims of kind max_stable_lr, best_final and lr_sensitivity; `lr_rule.py`), whose runs set
train.lr only through the grid and read the final val/loss or val/ema_loss (diagnostics.val_every dividing train.steps).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, apply_overrides, config_from_dict, read_yaml
from ..metrics import METRICS
from .claims import CLAIM_KINDS
from .inference import TESTS
from .lr_rule import LRRange, parse_lr_range

STATS = ("n", "mean", "detrended_std", "cv", "median_abs_log_delta", "spike_ratio", "mean_abs_delta", "spikes",
         "spike_frac_5x", "spike_frac_3x", "max_to_median", "log_residual_std", "detrended_cv", "growth")
TARGETS = {"half": 0.5, "three_quarters": 0.75, "final": 1.0}  # speed-up targets: fractions of the budget


@dataclass
class Claim:
    name: str
    arm: str
    kind: str
    threshold: float = 1.0
    target: str = "final"  # speedup: the arm's value at this fraction of the budget
    target_value: float | None = None  # speedup: instead, the steps both arms need to reach this metric level
    series: str = "grad/total"  # stability
    stat: str = "median_abs_log_delta"  # stability
    versus: str | None = None  # final / stability / sensitivity: compare with this arm instead of the baseline
    direction: str = "less"  # stability / sensitivity: the claim is that the ratio is less (or more) than threshold
    keys: list[str] | None = None  # final: judge the mean of these series' last values instead of the metric
    test: str = "t"  # the pre-registered test: t (paired t on log-ratios) | wilcoxon | sign
    post_hoc: bool = False  # chosen after seeing data (the author's marking; the tool adds its own)


@dataclass
class Experiment:
    name: str
    base: Path
    arms: dict[str, dict[str, Any]]
    baseline: str
    seeds: list[int]
    metric: str
    lower_is_better: bool = True
    set: dict[str, Any] = field(default_factory=dict)
    stability: list[str] = field(default_factory=lambda: ["loss", "grad/total"])
    stability_warmup: int | None = None  # steps dropped before oscillation stats (default: train.warmup_steps)
    sensitivity: bool = False
    workers: int = 1
    bootstrap: int = 2000
    claims: list[Claim] = field(default_factory=list)
    description: str = ""
    source: Path | None = None
    paper: dict[str, Any] = field(default_factory=dict)  # the paper's regime, shown beside ours
    calibrate: dict[str, Any] = field(default_factory=dict)  # how `compare --calibrate` measures metric noise
    multiplicity: str = "none"  # holm: Holm's correction over the confirmatory claims (write it in new files)
    unreachable: dict[str, str] = field(default_factory=dict)  # claims no outcome could make hold (set at load)
    lr_range: LRRange | None = None  # an LR-range experiment's grid and instability rule (`steadydiff lr-range`)

    def overrides(self, arm: str, seed: int, extra: list[str] | None = None) -> list[str]:
        """`--set` strings for one run: experiment-wide, then the arm's, then the seed, then the command line."""
        pairs = {**self.set, **self.arms[arm], "train.seed": seed}
        return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                for k, v in pairs.items()] + list(extra or [])

    def run_config(self, arm: str, seed: int, extra: list[str] | None = None):
        data = read_yaml(self.base, "experiment base config", "configs/demo.yaml")
        return config_from_dict(apply_overrides(data, self.overrides(arm, seed, extra)))


_KEYS = {"name", "base", "set", "baseline", "arms", "seeds", "metric", "stability", "stability_warmup",
         "sensitivity", "workers", "bootstrap", "claims", "description", "paper", "calibrate", "multiplicity",
         "lr_range"}
MULTIPLICITY = ("none", "holm")
_CALIBRATE_KEYS = {"repeats", "n", "reference_n", "arms", "seeds", "metrics", "sizes"}


def calibrated_metrics(exp: Experiment) -> list[str]:
    """The metrics `compare --calibrate` re-measures (`calibrate.py`): eval/<a metric of METRICS>, val/loss or
    val/ema_loss; a ConfigError for any other (default: the experiment's metric)."""
    metrics = list(exp.calibrate.get("metrics", [exp.metric]))
    for m in metrics:
        if m not in ("val/loss", "val/ema_loss") and not (m.startswith("eval/") and m.removeprefix("eval/") in METRICS):
            raise ConfigError(f"experiment calibrate: cannot calibrate {m!r}; calibration re-measures eval/<metric> "
                              f"({', '.join(METRICS)}), val/loss or val/ema_loss")
    return metrics


_NFE_KEY = re.compile(r"^(eval/[^@]+)@nfe(\d+)$")


def split_nfe(key: str) -> tuple[str, int | None]:
    """`eval/fd_fmnist@nfe10` -> ("eval/fd_fmnist", 10): a periodic-eval key at a network-evaluation budget
    (train.eval_nfe); any other key -> (key, None)."""
    m = _NFE_KEY.match(key)
    return (m.group(1), int(m.group(2))) if m else (key, None)


def _check_eval_key(key: str, exp: Experiment, extra: list[str] | None, where: str) -> None:
    """An eval/ key names a metric of METRICS, as `eval/<metric>` or `eval/<metric>@nfe<N>` with N one of every
    arm's train.eval_nfe; a one-line ConfigError otherwise. Other keys (val/, probe/, loss) are not checked."""
    if not key.startswith("eval/"):
        return
    base, nfe = split_nfe(key)
    name = base.removeprefix("eval/")
    if name not in METRICS or ("@" in key and nfe is None):
        raise ConfigError(f"{where}: {key!r} is not eval/<metric> or eval/<metric>@nfe<N> with a metric of "
                          f"{', '.join(METRICS)}")
    if nfe is not None:
        for arm in exp.arms:
            budgets = exp.run_config(arm, exp.seeds[0], extra).train.eval_nfe
            if nfe not in budgets:
                raise ConfigError(f"{where}: {key} needs {nfe} in train.eval_nfe (arm {arm!r} has {budgets}); add it "
                                  "to the experiment's set:")


def _mapping(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"experiment {key}: expected a mapping of config overrides like {{train.lr: 1e-4}}")
    return value


def load_experiment(path: str | Path, extra: list[str] | None = None, strict: bool = True) -> Experiment:
    """Read and validate an experiment file; every arm's config is built once here so errors show up
    before any training starts. `strict=False` (re-judging finished runs) keeps claims that no outcome could
    make hold, listed in `exp.unreachable`, instead of refusing the file."""
    path = Path(path)
    raw = read_yaml(path, "experiment file", "experiments/scalelong-unet.yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"experiment file {path} must be a mapping with keys {', '.join(sorted(_KEYS))}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ConfigError(f"unknown experiment key {unknown[0]}; valid keys: {', '.join(sorted(_KEYS))}")
    for key in ("name", "base", "arms", "baseline", "seeds", "metric"):
        if key not in raw:
            raise ConfigError(f"experiment {path}: missing key {key!r}")
    base = Path(raw["base"])
    if not base.is_absolute():
        base = (path.parent / base).resolve()
    if not base.is_file():
        raise ConfigError(f"experiment base config {base} not found; `base:` is relative to the experiment file")
    arms = raw["arms"]
    if not isinstance(arms, dict) or not arms:
        raise ConfigError("experiment arms: expected a mapping arm-name -> {config overrides}")
    arms = {str(k): _mapping(v, f"arms.{k}") for k, v in arms.items()}
    if raw["baseline"] not in arms:
        raise ConfigError(f"experiment baseline {raw['baseline']!r} is not an arm; choose one of {', '.join(arms)}")
    seeds = raw["seeds"]
    if isinstance(seeds, int):
        seeds = list(range(seeds))
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError("experiment seeds: expected a list of integers like [0, 1, 2] (or a count)")
    metric = raw["metric"]
    if isinstance(metric, str):
        metric = {"key": metric}
    if not isinstance(metric, dict) or "key" not in metric or set(metric) - {"key", "lower_is_better"}:
        raise ConfigError("experiment metric: expected {key: eval/fd_fmnist, lower_is_better: true}")
    lr_range = parse_lr_range(raw["lr_range"]) if "lr_range" in raw else None
    claims = []
    for i, c in enumerate(raw.get("claims") or []):
        if not isinstance(c, dict):
            raise ConfigError(f"experiment claims[{i}]: expected a mapping with name, arm, kind")
        bad = sorted(set(c) - set(Claim.__dataclass_fields__))
        if bad:
            raise ConfigError(f"experiment claims[{i}]: unknown key {bad[0]}; valid: "
                              f"{', '.join(Claim.__dataclass_fields__)}")
        try:
            claim = Claim(**c)
        except TypeError as e:
            raise ConfigError(f"experiment claims[{i}]: {e}; give name, arm and kind") from e
        if claim.arm not in arms:
            raise ConfigError(f"experiment claims[{i}]: arm {claim.arm!r} is not an arm; "
                              f"choose one of {', '.join(arms)}")
        kind = CLAIM_KINDS.choose(claim.kind, f"experiment claims[{i}]")
        kind.validate(claim, arms, f"experiment claims[{i}]")
        if kind.lr_range != (lr_range is not None):
            lr_kinds = ", ".join(k for k, v in CLAIM_KINDS.items() if v.lr_range)
            raise ConfigError(f"experiment claims[{i}]: kind {claim.kind} reads an lr-range grid; add an lr_range: "
                              "block and run `steadydiff lr-range`" if kind.lr_range else
                              f"experiment claims[{i}]: kind {claim.kind} is judged by `steadydiff compare`; an "
                              f"lr_range experiment claims {lr_kinds}")
        if claim.direction not in ("less", "more"):
            raise ConfigError(f"experiment claims[{i}]: direction {claim.direction!r}; choose less or more")
        if claim.target not in TARGETS:
            raise ConfigError(f"experiment claims[{i}]: target {claim.target!r}; choose one of {', '.join(TARGETS)}")
        if claim.test not in TESTS:
            raise ConfigError(f"experiment claims[{i}]: test {claim.test!r}; choose one of {', '.join(TESTS)}")
        if claim.stat not in STATS:
            raise ConfigError(f"experiment claims[{i}]: stat {claim.stat!r}; choose one of {', '.join(STATS)}")
        claims.append(claim)
    stability = raw.get("stability", ["loss", "grad/total"])
    if not isinstance(stability, list):
        raise ConfigError("experiment stability: expected a list of metrics.jsonl keys like [loss, grad/total]")
    paper = _mapping(raw.get("paper"), "paper")
    calibrate = _mapping(raw.get("calibrate"), "calibrate")
    if set(calibrate) - _CALIBRATE_KEYS:
        raise ConfigError(f"experiment calibrate: unknown key {sorted(set(calibrate) - _CALIBRATE_KEYS)[0]}; valid: "
                          f"{', '.join(sorted(_CALIBRATE_KEYS))}")
    workers = raw.get("workers", 1)
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError("experiment workers: expected an integer >= 1")
    multiplicity = str(raw.get("multiplicity", "none"))
    if multiplicity not in MULTIPLICITY:
        raise ConfigError(f"experiment multiplicity: {multiplicity!r}; choose one of {', '.join(MULTIPLICITY)}")
    exp = Experiment(
        name=str(raw["name"]), base=base, arms=arms, baseline=str(raw["baseline"]), seeds=seeds,
        metric=str(metric["key"]), lower_is_better=bool(metric.get("lower_is_better", True)),
        set=_mapping(raw.get("set"), "set"), stability=[str(s) for s in stability],
        stability_warmup=raw.get("stability_warmup"), sensitivity=bool(raw.get("sensitivity", False)),
        workers=workers, bootstrap=int(raw.get("bootstrap", 2000)), claims=claims,
        description=str(raw.get("description", "")), source=path, paper=paper, calibrate=calibrate,
        multiplicity=multiplicity, lr_range=lr_range,
    )
    if "metrics" in calibrate:
        calibrated_metrics(exp)
    for arm in arms:  # fail now, not after hours of training the other arms (the config checks its sampler)
        try:
            exp.run_config(arm, seeds[0], extra)
        except ConfigError as e:
            raise ConfigError(f"experiment arm {arm!r}: {e}") from e
    _check_eval_key(exp.metric, exp, extra, "experiment metric")
    for i, c in enumerate(claims):
        for k in c.keys or []:
            _check_eval_key(k, exp, extra, f"experiment claims[{i}] keys")
    if lr_range is not None:
        _check_lr_range(exp, extra)
    exp.unreachable = claims_that_cannot_hold(exp, extra)
    if strict and exp.unreachable:
        raise ConfigError(next(iter(exp.unreachable.values())))
    return exp


LR_KEY = "train.lr"
# What a ramp sets in every run (`lr_ramp.ramp_overrides`: its schedule, its end, no warm-up).
RAMP_KEYS = ("train.lr_schedule", "train.lr_ramp_end", "train.warmup_steps")
VALIDATION_METRICS = ("val/loss", "val/ema_loss")


def _check_lr_range(exp: Experiment, extra: list[str] | None) -> None:
    """What an LR-range experiment needs: the grid alone sets train.lr, the rule reads the final validation
    loss (the metric is val/loss or val/ema_loss, logged at the last step)."""
    for where, keys in (("set", exp.set), *((f"arms.{a}", o) for a, o in exp.arms.items()),
                        ("--set", [e.partition("=")[0].strip() for e in extra or []])):
        if LR_KEY in keys:
            raise ConfigError(f"experiment {where}: sets {LR_KEY}, which the lr_range grid sets in every run; remove "
                              "it (put the learning rates in lr_range.lrs)")
        ramp_key = next((k for k in RAMP_KEYS if k in keys), None)
        if exp.lr_range.mode == "ramp" and ramp_key:
            raise ConfigError(f"experiment {where}: sets {ramp_key}, which mode ramp sets in every run; remove it "
                              "(the ramp runs from lr_range.lrs[0] to lrs[-1])")
    if exp.lr_range.mode == "ramp" and exp.claims:
        raise ConfigError("experiment claims: a ramp (lr_range.mode: ramp) places a grid and makes no claims (its LR "
                          "and training time rise together); move the claims to the grid experiment it places")
    unused = [k for k, v in (("sensitivity", exp.sensitivity), ("calibrate", exp.calibrate)) if v]
    if unused:
        raise ConfigError(f"experiment {unused[0]}: `steadydiff lr-range` does not measure it; remove it from the "
                          "lr_range experiment (it belongs to `steadydiff compare`)")
    if exp.metric not in VALIDATION_METRICS:
        raise ConfigError(f"experiment metric: {exp.metric!r}; the lr-range rule reads the final validation loss, so "
                          f"set metric: {{key: val/loss}} (or {VALIDATION_METRICS[1]})")
    for arm in exp.arms:
        cfg = exp.run_config(arm, exp.seeds[0], extra)
        every, steps = cfg.diagnostics.val_every, cfg.train.steps
        if every <= 0 or steps % every:
            raise ConfigError(f"experiment arm {arm!r}: the lr-range rule reads the validation loss at the last step; "
                              f"set diagnostics.val_every to a divisor of train.steps ({steps}), got {every}")


def metric_interval(cfg, metric: str) -> int:
    """Steps between two logged values of `metric` in a run of `cfg` (its evaluation grid's spacing)."""
    if metric.startswith("eval/"):
        return cfg.train.eval_every
    if metric.startswith("val/"):
        return cfg.diagnostics.val_every
    if metric.startswith("probe/"):
        return cfg.diagnostics.probe_every
    return cfg.train.log_every


def speedup_cap(steps: int, interval: int, fraction: float) -> float:
    """The largest time-shift speed-up the grid can report at `fraction` of the budget S as a value: the
    baseline's crossing can be found at most one evaluation interval past its last evaluation, so
    (S + interval) / (fraction S); anything larger is only ever a bound."""
    return (steps + interval) / (fraction * steps)


def claims_that_cannot_hold(exp: Experiment, extra: list[str] | None = None) -> dict[str, str]:
    """{claim name: why} for claims that no outcome could make hold: a speed-up threshold at or above what
    the evaluation grid can report at its target, and a sign or Wilcoxon test with fewer seeds than it needs
    to reject at alpha 0.05. `load_experiment` refuses such a file before anything trains."""
    from .inference import min_seeds

    cfg = exp.run_config(exp.baseline, exp.seeds[0], extra)
    out = {}
    for i, c in enumerate(exp.claims):
        where = f"experiment claims[{i}] ({c.name!r})"
        need = min_seeds(c.test)
        if len(exp.seeds) < need:
            out[c.name] = (f"{where}: the {c.test} test cannot reject at alpha 0.05 with {len(exp.seeds)} seeds "
                           f"(it needs {need}); add seeds or pre-register test: t")
        elif c.kind == "speedup" and c.target_value is None:
            interval = metric_interval(cfg, exp.metric) or cfg.train.steps
            cap = speedup_cap(cfg.train.steps, interval, TARGETS[c.target])
            if TARGETS[c.target] * cfg.train.steps < min(interval, cfg.train.steps):
                out[c.name] = (f"{where}: target {c.target} lies before the first evaluation of {exp.metric} (step "
                               f"{interval}); evaluate more often or use a later target")
            elif c.threshold >= cap:
                out[c.name] = (f"{where}: a speed-up above {c.threshold:g} at target {c.target} can never be shown: "
                               f"with {cfg.train.steps} steps evaluated every {interval} the grid reports at most "
                               f"{cap:.3g} there (larger values are bounds); use an earlier target, more budget, or "
                               "target_value: a metric level both arms reach")
    if exp.multiplicity == "holm":
        out.update(_unreachable_under_holm(exp, out))
    return out


def _unreachable_under_holm(exp: Experiment, unreachable: dict[str, str]) -> dict[str, str]:
    """Claims that Holm's correction keeps from holding whatever the data: give every confirmatory claim the
    smallest p its test can reach on these seeds (`inference.smallest_p`; 1 for one already unreachable), the
    most favourable outcome there is; a claim whose Holm-adjusted p is still >= alpha can never hold (e.g. six
    sign-tested claims on six seeds: 2/64 x 6 > 0.05)."""
    from .inference import ALPHA, holm, seeds_for_p, smallest_p

    family = [c for c in exp.claims if not c.post_hoc]
    n = len(exp.seeds)
    best = [1.0 if c.name in unreachable else smallest_p(c.test, n) for c in family]
    out = {}
    for i, (c, adj) in enumerate(zip(family, holm(best))):
        if adj >= ALPHA and c.name not in unreachable:
            need = seeds_for_p(ALPHA / sum(p >= best[i] for p in best), c.test)
            out[c.name] = (f"experiment claims[{exp.claims.index(c)}] ({c.name!r}): with Holm's correction over "
                           f"{len(family)} confirmatory claims it cannot hold even if every claim with a smaller "
                           f"reachable p holds first: its {c.test} test's smallest p on {n} seeds is {best[i]:.3g}, "
                           f"adjusted {adj:.3g} >= {ALPHA:g}; use >= {need} seeds, fewer claims, or test: t")
    return out
