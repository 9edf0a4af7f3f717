"""Plot one metrics.jsonl series of every run of a `compare` experiment directory, one panel per arm (seeds as
lines), for series that are not comparable across arms, e.g. each formulation's own validation loss
(reports/formulations/val_curves.png):

    PYTHONPATH=src python experiments/plot_series.py OUT --key val/loss --png OUT/val_curves.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_series(metrics: Path, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in one run's metrics.jsonl, in file order."""
    steps, values = [], []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if key in row:
            steps.append(row["step"])
            values.append(row[key])
    return steps, values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the experiment directory (OUT of steadydiff compare)")
    ap.add_argument("--key", default="val/loss", help="the metrics.jsonl key to plot")
    ap.add_argument("--png", type=Path, required=True)
    args = ap.parse_args(argv)
    arms = sorted(p for p in (args.out / "runs").iterdir() if p.is_dir())
    if not arms:
        print(f"plot_series: error: no runs under {args.out / 'runs'}", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 2.8), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        for run in sorted(arm.glob("seed-*")):
            steps, values = read_series(run / "metrics.jsonl", args.key)
            ax.plot(steps, values, marker="o", ms=3, label=run.name)
        ax.set_title(arm.name, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(args.key)
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
