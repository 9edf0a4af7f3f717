"""ScaleLong evidence on one GPU in one go (issue 18, item 8): the main test at several learning rates, and the
paper-size U-ViT-S Org vs CS for the minutes that remain.

1. `experiments/scalelong-main.yaml` (U-ViT width 128, depth 12, no clipping, Org / CS / LS x 8 seeds) once per
   learning rate, the learning rates as concurrent `steadydiff compare` processes, each training its runs in
   `--workers` processes of its own (all on the one GPU);
2. meanwhile, U-ViT-S at the paper's size (width 512, depth 16 = 8 long skips, patch 2, heads 8, batch 128,
   bf16, AdamW (0.99, 0.999) wd 0.03, lr 2e-4, no clipping), Org and CS (kappa 0.5) side by side, with the
   out-block feature norms logged every 20 steps, stopped when the time budget is spent; then
   `steadydiff diagnose` over the two runs.

No installs and no downloads: Fashion-MNIST comes from `--data DIR` (the idx files) or steadydiff's usual
places. Everything lands in `--out` (default runs/gpu_evidence): one report per learning rate, the diagnose
report, and summary.json.

    bash benchmarks/gpu_evidence.sh [--lrs 5e-4,1e-3,2e-3] [--minutes 9] [--data DIR] [--out DIR]
    PYTHONPATH=src python benchmarks/gpu_evidence.py --tiny --device cpu --out /tmp/ev   # CPU smoke test (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "experiments" / "scalelong-main.yaml"
UVIT_S = ["model.backbone=uvit", "model.embed_dim=512", "model.depth=16", "model.patch_size=2", "model.num_heads=8",
          "train.batch_size=128", "train.bf16=true", "train.betas=[0.99,0.999]", "train.weight_decay=0.03",
          "train.lr=2e-4", "train.warmup_steps=2500", "train.grad_clip=null", "train.steps=1000000",
          "train.log_every=20", "train.ckpt_every=500", "train.sample_every=0", "train.sample_n=16",
          "diagnostics.probe_every=20", "diagnostics.grad_every=1"]
# The CPU smoke test: every stage, at sizes that finish in about a minute.
TINY_MAIN = ["model.depth=4", "model.embed_dim=32", "model.num_heads=2", "train.steps=4", "train.batch_size=8",
             "train.warmup_steps=1", "train.log_every=1", "train.ckpt_every=4", "diagnostics.probe_every=2",
             "diagnostics.probe_size=4", "diagnostics.val_every=2", "diagnostics.val_size=16",
             "diagnostics.val_bins=2", "data.max_items=64"]
TINY_UVIT_S = ["model.embed_dim=32", "model.depth=4", "model.patch_size=4", "model.num_heads=2", "train.batch_size=8",
               "train.bf16=false", "train.warmup_steps=1", "train.steps=6", "train.log_every=1", "train.ckpt_every=2",
               "diagnostics.probe_every=2", "diagnostics.probe_size=4", "data.max_items=64"]


def sets(pairs: list[str]) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", default="5e-4,1e-3,2e-3", help="learning rates of the main test (one compare each)")
    ap.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of the whole script")
    ap.add_argument("--workers", type=int, default=8, help="runs trained at once per learning rate")
    ap.add_argument("--data", help="directory holding the Fashion-MNIST idx files (data.root)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny models, 2 seeds, a few steps")
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_evidence"))
    args = ap.parse_args(argv)
    t_end = time.monotonic() + 60 * args.minutes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    common = [f"train.device={args.device}"] + ([f"data.root={args.data}"] if args.data else [])
    steadydiff = [sys.executable, "-m", "steadydiff.cli"]

    experiment, workers = MAIN, args.workers
    main_sets = common + (TINY_MAIN if args.tiny else [])
    if args.tiny:  # two seeds instead of eight: a copy of the experiment file, recorded as the run's design
        spec = yaml.safe_load(MAIN.read_text())
        spec.update(seeds=[0, 1], base=str((MAIN.parent / spec["base"]).resolve()))
        # Rank tests cannot reject on 2 seeds and are refused at load; the smoke test judges every claim by t.
        spec["claims"] = [{**c, "test": "t"} for c in spec["claims"]]
        experiment, workers = out / "scalelong-main-tiny.yaml", 1  # in-process: no start-up cost per run
        experiment.write_text(yaml.safe_dump(spec, sort_keys=False))
    lrs = [float(v) for v in args.lrs.split(",") if v.strip()]
    procs = {}
    for lr in lrs:
        cmd = steadydiff + ["compare", str(experiment), "--out", str(out / f"main-lr{lr:g}"), "--quiet",
                            "--workers", str(workers), *sets(main_sets + [f"train.lr={lr}"])]
        procs[f"main-lr{lr:g}"] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                   text=True)
    # The paper-size runs use what the budget leaves after a minute of margin for the reports.
    big_sets = common + UVIT_S + (TINY_UVIT_S if args.tiny else [])
    for arm, scaling in (("org", ["model.skip_scaling=org"]), ("cs", ["model.skip_scaling=cs", "model.kappa=0.5"])):
        cmd = steadydiff + ["train", "--out", str(out / f"uvit-s-{arm}"), "--quiet", *sets(big_sets + scaling)]
        procs[f"uvit-s-{arm}"] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  text=True)
    status = {}
    for name, proc in procs.items():
        budget = max(5.0, t_end - 60 - time.monotonic()) if name.startswith("uvit-s") else max(
            5.0, t_end - 30 - time.monotonic())
        try:
            text, _ = proc.communicate(timeout=budget)
            status[name] = {"exit": proc.returncode, "tail": text[-2000:]}
        except subprocess.TimeoutExpired:
            proc.terminate()  # the budget is spent: the runs keep their last checkpoint
            text, _ = proc.communicate()
            status[name] = {"exit": "stopped at the time budget", "tail": text[-2000:]}
    runs = [str(out / f"uvit-s-{arm}") for arm in ("org", "cs")]
    diag = subprocess.run(steadydiff + ["diagnose", *runs, "--out", str(out / "uvit-s-diagnose")], env=env,
                          capture_output=True, text=True)
    status["uvit-s-diagnose"] = {"exit": diag.returncode, "tail": (diag.stdout + diag.stderr)[-2000:]}
    summary = {"lrs": lrs, "tiny": args.tiny, "device": args.device, "minutes": args.minutes, "status": status}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, st in status.items():
        print(f"{name}: {st['exit']}")
    failed = [n for n, st in status.items() if st["exit"] not in (0, "stopped at the time budget")]
    if failed:
        print(f"gpu_evidence: error: {', '.join(failed)} failed; see {out / 'summary.json'}", file=sys.stderr)
        return 1
    print(f"reports: {out}/main-lr*/report.md, {out}/uvit-s-diagnose/stability.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
