"""Metric costs on this machine: feature-extractor throughput, and wall time of a 5k-sample `fd_fmnist`
eval and a 2k-sample FID eval of a trained demo model (sampling included).

    python benchmarks/metrics_bench.py --run runs/demo [--n-fd 5000] [--n-fid 2000] [--steps 50]

Writes benchmarks/results/metrics.json and .md (command, machine, date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from steadydiff.data import load_dataset
from steadydiff.metrics import evaluate, get_extractor
from steadydiff.runs import load_model

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from throughput import cpu_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--n-fd", type=int, default=5000)
    ap.add_argument("--n-fid", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--sampler", default="dpmpp2m")
    ap.add_argument("--fid-ref-n", type=int, default=2000, help="training images for the FID reference stats")
    args = ap.parse_args()

    images = torch.rand(256, 1, 28, 28) * 2 - 1
    rows = []
    for name in ("fmnist", "inception"):
        ext = get_extractor(name)
        ext.features(images[:16])  # warm-up (and, for fmnist, train or load the cached classifier)
        t0 = time.perf_counter()
        ext.features(images)
        dt = time.perf_counter() - t0
        rows.append({"extractor": name, "dim": ext.dim, "images_per_sec": len(images) / dt})
        print(f"{name}: {len(images) / dt:.1f} img/s", flush=True)

    loaded = load_model(args.run)
    cfg, model, formulation = loaded.cfg, loaded.model, loaded.formulation
    dataset = load_dataset(cfg.data)
    evals = []
    for metric, n, ref_n in (("fd_fmnist", args.n_fd, None), ("fid", args.n_fid, args.fid_ref_n)):
        t0 = time.perf_counter()
        res = evaluate(model, formulation, cfg, dataset, [metric], n, args.sampler, args.steps, seed=0, ref_n=ref_n)
        dt = time.perf_counter() - t0
        evals.append({"metric": metric, "n": n, "ref_n": ref_n or len(dataset), "value": res[metric], "seconds": dt})
        print(f"{metric} n={n}: {res[metric]:.4g} in {dt:.0f} s", flush=True)

    meta = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "run": str(args.run), "run_step": loaded.step, "sampler": f"{args.sampler} {args.steps} steps, EMA weights",
        "extractors": rows, "evals": evals,
    }
    out = ROOT / "results" / "metrics"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# Metric costs", "", f"- command: `{meta['command']}`", f"- date: {meta['date']}",
             f"- machine: {meta['machine']}", f"- model: {args.run} at step {loaded.step}; {meta['sampler']}", "",
             "| extractor | dim | images/s (28x28 input, batch 64) |", "|---|---|---|"]
    lines += [f"| {r['extractor']} | {r['dim']} | {r['images_per_sec']:.1f} |" for r in rows]
    lines += ["", "| eval | samples | reference images | value | wall time (sampling, features, reference stats "
              "if not cached, distance) |", "|---|---|---|---|---|"]
    lines += [f"| {e['metric']} | {e['n']} | {e['ref_n']} | {e['value']:.4g} | {e['seconds']:.0f} s |" for e in evals]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
