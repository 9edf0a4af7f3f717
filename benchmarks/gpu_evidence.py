"""ScaleLong and EDM2 evidence on one GPU in time-boxed sessions (issue 18 item 8, issue 28 item 4), by stage.

Stage `main` (the default):

1. `experiments/scalelong-main.yaml` (U-ViT width 128, depth 12, no clipping, Org / CS / LS x 8 seeds) once per
   learning rate, the learning rates as concurrent `steadydiff compare` processes, each training its runs in
   `--workers` processes of its own (all on the one GPU);
2. meanwhile, U-ViT-S at the paper's size (width 512, depth 16 = 8 long skips, patch 2, heads 8, batch 128,
   bf16, AdamW (0.99, 0.999) wd 0.03, lr 2e-4, no clipping), Org and CS (kappa 0.5) side by side, with the
   out-block feature norms logged every 20 steps, stopped when the time budget is spent; then
   `steadydiff diagnose` over the two runs.

Stage `edge`: the edge-of-stability experiments at the papers' scale on the CIFAR-10 store (`--store DIR`,
default stores/cifar10, built once by `steadydiff dataset build cifar-10-python.tar.gz --out stores/cifar10
--labels`), each a `steadydiff lr-range` process training `--edge-workers` runs at once, the three side by side
on the one GPU: `experiments/scalelong-edge-uvit-s2.yaml` and `scalelong-edge-uvit-s2-d16.yaml` (U-ViT-S/2 depth
12 and 16, Org / 1/sqrt2 / CS 0.5 / CS 0.8 / LS x 5 LRs x 8 seeds, 5,000 steps each) and
`experiments/edm2-edge-cifar10.yaml` (EDM2's MP UNet vs the same-width UNet without MP, and MP + CS 0.5, x 5 LRs
x 8 seeds). They need many GPU-hours (the files give the FLOP counts): when `--minutes` is spent the processes
are stopped, every run in flight keeps a checkpoint of its last step, and the same command run again resumes
(finished runs are never trained again); each file's lr_range.md, .json and .png appear in OUT/edge-NAME once
all its runs have finished. Stage `all` runs both stages at once.

No installs and no downloads: Fashion-MNIST comes from `--data DIR` (the idx files) or steadydiff's usual
places, CIFAR-10 from the store. Everything lands in `--out` (default runs/gpu_evidence): one report per
learning rate, the diagnose report, one lr-range directory per edge file, each process's log (NAME.log), and
summary.json (what ran, how it ended, how many runs of each edge file have finished).

    bash benchmarks/gpu_evidence.sh [--lrs 5e-4,1e-3,2e-3] [--minutes 9] [--data DIR] [--out DIR]
    bash benchmarks/gpu_evidence.sh --stage edge --minutes 600 [--store DIR] [--edge-workers 4] [--out DIR]
    PYTHONPATH=src python benchmarks/gpu_evidence.py --tiny --device cpu --out /tmp/ev   # CPU smoke test (CI)
    PYTHONPATH=src python benchmarks/gpu_evidence.py --tiny --device cpu --stage edge --out /tmp/ev

With `--tiny` every stage runs at toy size on the CPU: two seeds (and for the edge files their two smallest
LRs), a few steps, tiny models, and for the edge stage a 64-image random store built under OUT unless `--store`
is given (and not the depth-16 file: at the toy model's depth it is the depth-12 file again).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "experiments" / "scalelong-main.yaml"
EDGE = [ROOT / "experiments" / f for f in ("scalelong-edge-uvit-s2.yaml", "scalelong-edge-uvit-s2-d16.yaml",
                                           "edm2-edge-cifar10.yaml")]
STAGES = ("main", "edge", "all")
STOPPED = "stopped at the time budget"
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
TINY_EDGE = ["train.steps=4", "train.batch_size=8", "train.bf16=false", "train.warmup_steps=1", "train.log_every=1",
             "train.ckpt_every=4", "train.sample_n=4", "train.sample_steps=2", "train.threads=1", "data.workers=0",
             "data.max_items=64", "diagnostics.val_every=2", "diagnostics.val_size=16", "diagnostics.val_bins=2"]
# The smoke test leaves out the depth-16 file: with the toy model's depth it is the depth-12 file again.
TINY_EDGE_MODEL = {  # per file: the model at toy size (32x32 RGB)
    "scalelong-edge-uvit-s2": ["model.embed_dim=32", "model.depth=4", "model.patch_size=8", "model.num_heads=2"],
    "edm2-edge-cifar10": ["model.channels=8", "model.channel_mult=[1,2]", "model.num_res_blocks=1",
                          "model.attn_resolutions=[16]", "model.channels_per_head=8", "model.num_heads=2"],
}


def sets(pairs: list[str]) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def tiny_copy(path: Path, out: Path, lrs: int | None = None) -> Path:
    """A copy of the experiment file for the CPU smoke test, recorded as the run's design: its first two seeds
    and (`lrs`) its first `lrs` grid LRs; every claim judged by t (rank tests cannot reject on 2 seeds and are
    refused at load)."""
    spec = yaml.safe_load(path.read_text())
    spec.update(seeds=spec["seeds"][:2], base=str((path.parent / spec["base"]).resolve()))
    if lrs is not None:
        spec["lr_range"]["lrs"] = spec["lr_range"]["lrs"][:lrs]
    spec["claims"] = [{**c, "test": "t"} for c in spec.get("claims", [])]
    copy = out / f"{path.stem}-tiny.yaml"
    copy.write_text(yaml.safe_dump(spec, sort_keys=False))
    return copy


def tiny_store(path: Path) -> Path:
    """A 64-image random 32x32 RGB store with labels (the CIFAR-10 store's layout), built once."""
    if (path / "dataset.json").is_file():
        return path
    import numpy as np

    from steadydiff.data import build_store

    rng = np.random.default_rng(0)
    npz = path.with_name(path.name + ".npz")
    np.savez(npz, images=rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8), labels=rng.integers(0, 10, 64))
    build_store(str(npz), path, labels=True, shard_size=64, workers=0, progress=False)
    return path


def grid_progress(experiment: Path, rdir: Path) -> dict[str, int]:
    """{finished, total}: the lr-range runs of `experiment` under `rdir` that have their result.json."""
    spec = yaml.safe_load(experiment.read_text())
    total = len(spec["arms"]) * len(spec["lr_range"]["lrs"]) * len(spec["seeds"])
    return {"finished": len(list(rdir.glob("runs/*/lr-*/seed-*/result.json"))), "total": total}


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """`cmd` in a process group of its own (its training workers too), its output in `log`."""
    with log.open("w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, grace_s: float = 300.0) -> None:
    """SIGTERM to the process and every worker it started: each run finishes its step and saves a checkpoint
    of it (`train.stop_signals`); SIGKILL after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.is_file() else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", default="main", choices=STAGES,
                    help="main: the main test and U-ViT-S Org vs CS; edge: the lr-range edge experiments on CIFAR-10 "
                         "(many GPU-hours, in sessions of --minutes that resume); all: both at once")
    ap.add_argument("--lrs", default="5e-4,1e-3,2e-3", help="learning rates of the main test (one compare each)")
    ap.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of the whole script")
    ap.add_argument("--workers", type=int, default=8, help="runs trained at once per learning rate (main)")
    ap.add_argument("--edge-workers", type=int, default=4,
                    help="runs trained at once per edge experiment file (three files: 3x this many on the GPU)")
    ap.add_argument("--data", help="directory holding the Fashion-MNIST idx files (data.root of the main stage)")
    ap.add_argument("--store", help="the CIFAR-10 store of the edge stage (data.root; default stores/cifar10 in this "
                                    "checkout; with --tiny, a random 64-image store built under --out)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny models, 2 seeds, a few steps")
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_evidence"))
    args = ap.parse_args(argv)
    t_end = time.monotonic() + 60 * args.minutes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    device = [f"train.device={args.device}"]
    steadydiff = [sys.executable, "-m", "steadydiff.cli"]
    procs: dict[str, subprocess.Popen] = {}
    margin: dict[str, float] = {}  # seconds before the budget's end at which each process is stopped
    edge_dirs: dict[str, tuple[Path, Path]] = {}  # edge name -> (experiment file run, its --out)
    lrs: list[float] = []

    if args.stage in ("edge", "all"):
        store = Path(args.store) if args.store else (tiny_store(out / "tiny-store") if args.tiny
                                                     else ROOT / "stores" / "cifar10")
        if not (store / "dataset.json").is_file():
            print(f"gpu_evidence: error: {store} is not a dataset store (no dataset.json); build it once with\n"
                  "  curl -O https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz\n"
                  f"  steadydiff dataset build cifar-10-python.tar.gz --out {store} --labels\n"
                  "or pass --store DIR", file=sys.stderr)
            return 2
        for path in [p for p in EDGE if not args.tiny or p.stem in TINY_EDGE_MODEL]:
            experiment, extra = path, device + [f"data.root={store.resolve()}"]
            if args.tiny:  # two seeds, two LRs, tiny models, in-process (no start-up cost per run)
                experiment, extra = tiny_copy(path, out, lrs=2), extra + TINY_EDGE + TINY_EDGE_MODEL[path.stem]
            name, rdir = f"edge-{path.stem}", out / f"edge-{path.stem}"
            workers = 1 if args.tiny else args.edge_workers
            cmd = steadydiff + ["lr-range", str(experiment), "--out", str(rdir), "--quiet", "--workers", str(workers),
                                *sets(extra)]
            procs[name], margin[name] = start(cmd, out / f"{name}.log", env), 30.0
            edge_dirs[name] = (experiment, rdir)

    if args.stage in ("main", "all"):
        common = device + ([f"data.root={args.data}"] if args.data else [])
        experiment, workers = MAIN, args.workers
        main_sets = common + (TINY_MAIN if args.tiny else [])
        if args.tiny:  # two seeds instead of eight
            experiment, workers = tiny_copy(MAIN, out), 1  # in-process: no start-up cost per run
        lrs = [float(v) for v in args.lrs.split(",") if v.strip()]
        for lr in lrs:
            name = f"main-lr{lr:g}"
            cmd = steadydiff + ["compare", str(experiment), "--out", str(out / name), "--quiet", "--workers",
                                str(workers), *sets(main_sets + [f"train.lr={lr}"])]
            procs[name], margin[name] = start(cmd, out / f"{name}.log", env), 30.0
        # The paper-size runs use what the budget leaves after a minute of margin for the reports.
        big_sets = common + UVIT_S + (TINY_UVIT_S if args.tiny else [])
        for arm, scaling in (("org", ["model.skip_scaling=org"]), ("cs", ["model.skip_scaling=cs", "model.kappa=0.5"])):
            name = f"uvit-s-{arm}"
            cmd = steadydiff + ["train", "--out", str(out / name), "--quiet", *sets(big_sets + scaling)]
            procs[name], margin[name] = start(cmd, out / f"{name}.log", env), 60.0

    status = {}
    try:
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(5.0, t_end - margin[name] - time.monotonic()))
                status[name] = {"exit": proc.returncode}
            except subprocess.TimeoutExpired:
                stop(proc)  # the budget is spent: the runs keep their last checkpoint
                status[name] = {"exit": STOPPED}
            status[name]["tail"] = tail(out / f"{name}.log")
    finally:  # an interrupted script (Ctrl-C) leaves no training behind: the processes are in their own groups
        for proc in procs.values():
            if proc.poll() is None:
                stop(proc)
    if args.stage in ("main", "all"):
        runs = [str(out / f"uvit-s-{arm}") for arm in ("org", "cs")]
        diag = subprocess.run(steadydiff + ["diagnose", *runs, "--out", str(out / "uvit-s-diagnose")], env=env,
                              capture_output=True, text=True)
        status["uvit-s-diagnose"] = {"exit": diag.returncode, "tail": (diag.stdout + diag.stderr)[-2000:]}
    edge = {name: {"experiment": str(exp), "out": str(rdir), **grid_progress(exp, rdir),
                   "report": str(rdir / "lr_range.md") if (rdir / "lr_range.md").is_file() else None}
            for name, (exp, rdir) in edge_dirs.items()}
    summary = {"stage": args.stage, "lrs": lrs, "tiny": args.tiny, "device": args.device, "minutes": args.minutes,
               "status": status, "edge": edge}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, st in status.items():
        print(f"{name}: {st['exit']}")
    failed = [n for n, st in status.items() if st["exit"] not in (0, STOPPED)]
    if failed:
        print(f"gpu_evidence: error: {', '.join(failed)} failed; see {out / 'summary.json'} and {out}/NAME.log",
              file=sys.stderr)
        return 1
    if args.stage in ("main", "all"):
        print(f"reports: {out}/main-lr*/report.md, {out}/uvit-s-diagnose/stability.md")
    for name, e in edge.items():
        where = e["report"] or "not yet: run the same command again to continue (finished runs are kept)"
        print(f"{name}: {e['finished']}/{e['total']} runs finished; report: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
