"""Pre-registration, enforced by the tool: the first `compare` or `lr-range` run of an experiment records a hash
of its design (arms, seeds, metric, shared overrides, base config; an LR grid and its instability rule) and of
every claim in OUT/preregistration.json, before anything trains. Later reports compare the experiment file with
that record: a claim added or changed afterwards, or any claim after the design changed, is marked "post hoc" in
the report, by the tool. A record is only written into an OUT that holds no run yet."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..utils.io import atomic_write_text, read_json
from .spec import Claim, Experiment

FILE = "preregistration.json"
PRE_REGISTERED = "pre-registered"
NOT_RECORDED = "not recorded"  # the runs predate the record (reports re-rendered from older runs)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def design_hash(exp: Experiment) -> str:
    """What every claim rests on: arms and their overrides, baseline, seeds, metric, shared overrides, the
    base config's content, the multiplicity rule and, in an lr-range experiment, its LR grid and instability
    rule."""
    design = {"arms": exp.arms, "baseline": exp.baseline, "seeds": exp.seeds, "metric": exp.metric,
              "lower_is_better": exp.lower_is_better, "set": exp.set,
              "base": Path(exp.base).read_text() if Path(exp.base).is_file() else str(exp.base)}
    if exp.multiplicity != "none":  # added later: absent from the designs recorded before it existed
        design["multiplicity"] = exp.multiplicity
    if exp.lr_range is not None:  # an lr-range experiment: its grid and instability rule are pre-registered too
        design["lr_range"] = exp.lr_range.design()
    return _digest(design)


# Claim fields added after records were first written: at their default they are left out of the hash, so a
# claim registered before they existed still matches its record.
_ADDED_FIELDS = {"target_value": None}


def claim_hash(claim: Claim) -> str:
    fields = dataclasses.asdict(claim)
    fields.pop("post_hoc", None)  # the author's own marking is not part of what was registered
    for key, default in _ADDED_FIELDS.items():
        if fields.get(key) == default:
            fields.pop(key, None)
    return _digest(fields)


def existing_runs(out: Path) -> list[Path]:
    """Run directories already in OUT (`OUT/runs/<arm>/<run>/`, finished or not)."""
    runs = Path(out) / "runs"
    return sorted(p for p in runs.glob("*/*") if p.is_dir()) if runs.is_dir() else []


def record(exp: Experiment, out: Path) -> bool:
    """Write OUT/preregistration.json unless it exists; True when written now.

    Only before anything has trained: when OUT already holds a run of any experiment (a copied or cleaned
    OUT, a record deleted after the results were read), no record is written, so claims written after seeing
    results can never read "pre-registered" (they stay "not recorded"). The record keeps the run count it saw."""
    path = Path(out) / FILE
    if path.exists() or existing_runs(out):
        return False
    rec = {"experiment": exp.name, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "design": design_hash(exp), "claims": {c.name: claim_hash(c) for c in exp.claims}, "runs_at_record": 0}
    atomic_write_text(path, json.dumps(rec, indent=1) + "\n")
    return True


def claim_status(exp: Experiment, out: Path) -> dict[str, str]:
    """{claim name: "pre-registered" | "post hoc (...why...)" | "not recorded"} against OUT's record."""
    path = Path(out) / FILE
    declared = {c.name: "post hoc (declared in the experiment file)" for c in exp.claims if c.post_hoc}
    if not path.exists():
        return {c.name: declared.get(c.name, NOT_RECORDED) for c in exp.claims}
    rec = read_json(path, "restore it (it records what was declared before the runs)")
    design_changed = rec.get("design") != design_hash(exp)
    status = {}
    for c in exp.claims:
        if c.name in declared:
            status[c.name] = declared[c.name]
        elif design_changed:
            what = "metric, base config, LR grid or rule" if exp.lr_range is not None else "metric or base config"
            status[c.name] = f"post hoc (arms, seeds, {what} changed after the first run)"
        elif c.name not in rec["claims"]:
            status[c.name] = f"post hoc (added after the first run on {rec['date']})"
        elif rec["claims"][c.name] != claim_hash(c):
            status[c.name] = f"post hoc (changed after the first run on {rec['date']})"
        else:
            status[c.name] = PRE_REGISTERED
    return status
