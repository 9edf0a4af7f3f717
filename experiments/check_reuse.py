"""Check that an existing run can stand in for an arm of another experiment: retrain the arm for its first
N steps and compare every logged number with the existing run's log (exact equality).

    python experiments/check_reuse.py EXPERIMENT ARM SEED EXISTING_RUN_DIR [--steps 300]

Used for experiments/mdlrc-800.yaml, whose uniform arm is the uniform arm of experiments/clts-800.yaml (the
two configs differ only in keys the uniform arm never reads). Exit status 0 when every number matches; the
hardware-dependent fields (throughput, peak FLOP/s, utilisation) are not compared.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from steadydiff.experiments import load_experiment
from steadydiff.train import Trainer

MACHINE_FIELDS = {"images_per_sec", "mfu", "peak_flops"}


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("arm")
    ap.add_argument("seed", type=int)
    ap.add_argument("existing", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_experiment(a.experiment, []).run_config(a.arm, a.seed, [])
    cfg.train.steps = a.steps  # where the loop stops; schedules tied to train.steps would show as mismatches
    with tempfile.TemporaryDirectory() as tmp:
        Trainer(cfg, Path(tmp), show_progress=False).fit()
        new = records(Path(tmp))
    ref: dict[int, list[dict]] = {}
    for r in records(a.existing):
        ref.setdefault(r["step"], []).append(r)
    checked, bad = 0, 0
    for r in new:
        if r["step"] >= a.steps:  # the final step writes end-of-run records the longer run does not have
            continue
        for key, v in r.items():
            if key in MACHINE_FIELDS or key == "step" or not isinstance(v, (int, float)):
                continue
            old = [c[key] for c in ref.get(r["step"], []) if key in c]
            if not old:
                continue
            checked += 1
            if v not in old:
                bad += 1
                print(f"mismatch at step {r['step']}: {key} = {v!r}, existing run {old}")
    print(f"{checked} logged numbers over steps 0-{a.steps - 1} compared, {bad} differ")
    return 0 if checked and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
