"""Cost of the training monitors: step time with diagnostics off vs at the default intervals vs all on.

Each arm is a full `Trainer` on the demo config (Fashion-MNIST, demo UNet) for the same steps; the arms
run interleaved in rounds in one process and we compare median time per step. The goal (roadmap 3) is
<= 10% overhead at the default intervals.

    python benchmarks/monitor_overhead.py [--steps 40] [--rounds 3]

Writes benchmarks/results/monitor_overhead.json and .md (command, machine, date included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from steadydiff.config import load_config
from steadydiff.train import Trainer

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from throughput import cpu_name  # noqa: E402

ARMS = {
    "off": ["diagnostics.grad_every=0"],
    "default": [],  # grad_every=1, everything else off
    "all (probe/update/magnitude every 50)": ["diagnostics.probe_every=50", "diagnostics.update_every=50",
                                              "diagnostics.magnitude_every=50"],
}


def time_arm(overrides: list[str], steps: int) -> float:
    cfg = load_config(ROOT.parent / "configs" / "demo.yaml",
                      [f"train.steps={steps}", "train.ckpt_every=100000", "train.sample_every=0",
                       "train.log_every=25", "data.max_items=4096", *overrides])
    with tempfile.TemporaryDirectory() as d:
        tr = Trainer(cfg, Path(d) / "run", show_progress=False)
        tr.monitors = tr._build_monitors()
        for _ in range(3):  # warm-up
            tr.train_step()
        t0 = time.perf_counter()
        while tr.step < steps:
            tr.train_step()
        return (time.perf_counter() - t0) / (steps - 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    times: dict[str, list[float]] = {k: [] for k in ARMS}
    for r in range(args.rounds):
        for name, ov in ARMS.items():
            times[name].append(time_arm(ov, args.steps))
            print(f"round {r} {name}: {times[name][-1] * 1000:.0f} ms/step", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"arm": k, "ms_per_step": med[k] * 1000, "overhead": med[k] / med["off"] - 1} for k in ARMS]
    meta = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "config": "configs/demo.yaml (batch 32, 28x28, demo UNet)", "results": rows, "raw_seconds": times,
    }
    out = ROOT / "results" / "monitor_overhead"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# Monitor overhead", "", f"- command: `{meta['command']}`", f"- date: {meta['date']}",
             f"- machine: {meta['machine']}", f"- {meta['config']}; medians of {args.rounds} interleaved rounds of "
             f"{args.steps} steps", "", "| arm | ms/step | overhead vs off |", "|---|---|---|"]
    lines += [f"| {r['arm']} | {r['ms_per_step']:.0f} | {r['overhead'] * 100:+.1f}% |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    for r in rows:
        print(f"{r['arm']}: {r['ms_per_step']:.0f} ms/step ({r['overhead'] * 100:+.1f}%)")


if __name__ == "__main__":
    main()
