"""Datasets beyond RAM: memory and loader throughput of a dataset store (issue 20, item 4).

1. Two stores built by `steadydiff dataset build` from generated uint8 arrays of 64x64x3 images: a large one
   (default 200,000 images, 2.5 GB) and a small one (10,000). The arrays are written as memory-mapped .npy
   files, so generating them needs no RAM either.
2. Memory: the peak RSS (ru_maxrss) of `steadydiff train` on each store (the demo UNet at 64x64x3, a few
   steps, in a fresh process); the claim is that they differ by less than 100 MB.
3. Throughput, side by side in one run: the loader's images/s (batch 256, random indices, data.workers 1 /
   2 / 4, reading through the `Prefetcher` exactly as training does) against the training step's images/s of
   the demo UNet and the U-ViT preset at 64x64x3 (batch 32, fp32, `Trainer.train_step` timed after warm-up).
   The loader reads a store that was just written, so its pages are in the OS cache: this measures the
   loader, not the disk.

    PYTHONPATH=src python benchmarks/data_scale.py [--n-large 200000] [--n-small 10000] [--work DIR]

Writes benchmarks/results/data_scale.json and data_scale.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import cpu_name  # noqa: E402  (a sibling script, not a package)

from steadydiff.config import load_config  # noqa: E402
from steadydiff.data import Prefetcher, build_store, get_batch, load_dataset  # noqa: E402
from steadydiff.train import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RES = 64


def make_array(path: Path, n: int, seed: int) -> None:
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(n, RES, RES, 3))
    g = np.random.default_rng(seed)
    for i in range(0, n, 10_000):
        arr[i:i + 10_000] = g.integers(0, 256, (min(10_000, n - i), RES, RES, 3), dtype=np.uint8)
    arr.flush()
    del arr


TRAIN_PROBE = """
import resource, sys
from steadydiff.cli import main
rc = main(sys.argv[1:])
print("MAXRSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(rc)
"""


def train_rss(store: Path, out: Path, steps: int) -> int:
    args = ["train", "--config", str(ROOT / "configs" / "demo.yaml"), "--out", str(out), "--quiet"]
    for kv in ("data.name=store", f"data.root={store}", f"data.resolution={RES}", f"train.steps={steps}",
               "train.sample_every=0", "train.sample_n=4", "train.sample_steps=2", f"train.ckpt_every={steps}",
               "train.log_every=1", "train.threads=1", "model.attn_resolutions=[]"):
        args += ["--set", kv]
    res = subprocess.run([sys.executable, "-c", TRAIN_PROBE, *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if res.returncode != 0:
        raise SystemExit(f"training on {store} failed: {res.stderr.strip()[-500:]}")
    return int(res.stdout.split("MAXRSS_KB")[-1].split()[0]) * 1024


def loader_rate(store: Path, workers: int, batches: int, batch: int = 256) -> float:
    ds = load_dataset(load_config(None, ["data.name=store", f"data.root={store}", f"data.resolution={RES}"]).data)
    n = len(ds)

    def read(k: int):
        idx = torch.randint(0, n, (batch,), generator=torch.Generator().manual_seed(k))
        return get_batch(ds, idx, True, torch.Generator().manual_seed(k + 1))

    p = Prefetcher(read, workers)
    p.get(0)  # threads started
    t0 = time.perf_counter()
    for k in range(1, batches + 1):
        p.get(k)
    dt = time.perf_counter() - t0
    p.close()
    return batches * batch / dt


def step_rate(config: str, store: Path, work: Path, steps: int, warmup: int = 2) -> float:
    cfg = load_config(ROOT / "configs" / config, ["data.name=store", f"data.root={store}", f"data.resolution={RES}",
                                                  "train.batch_size=32", "train.threads=2", "data.workers=0",
                                                  f"train.steps={steps + warmup}"])
    tr = Trainer(cfg, work / f"step-{config}", show_progress=False)
    for _ in range(warmup):
        tr.train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.train_step()
    dt = time.perf_counter() - t0
    tr.close()
    return steps * 32 / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-large", type=int, default=200_000)
    ap.add_argument("--n-small", type=int, default=10_000)
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--loader-batches", type=int, default=60)
    ap.add_argument("--step-steps", type=int, default=5)
    ap.add_argument("--work", default="/tmp/steadydiff-data-scale")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_scale"))
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res: dict = {"command": "PYTHONPATH=src python benchmarks/data_scale.py " + " ".join(sys.argv[1:]),
                 "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
                 "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    stores = {}
    for name, n in (("large", args.n_large), ("small", args.n_small)):
        src = work / f"{name}.npy"
        t0 = time.perf_counter()
        make_array(src, n, seed=len(name))
        t1 = time.perf_counter()
        meta = build_store(str(src), work / f"store-{name}", shard_size=10_000, progress=False)
        t2 = time.perf_counter()
        src.unlink()
        size = sum(f.stat().st_size for f in (work / f"store-{name}").iterdir())
        stores[name] = work / f"store-{name}"
        res[f"store_{name}"] = {"count": meta["count"], "bytes": size, "generate_s": round(t1 - t0, 1),
                                "build_s": round(t2 - t1, 1)}
        print(f"{name}: {meta['count']} images, {size / 2**30:.2f} GiB, built in {t2 - t1:.1f} s", flush=True)
    rss = {name: train_rss(store, work / f"train-{name}", args.train_steps) for name, store in stores.items()}
    res["train_peak_rss_bytes"] = rss
    res["rss_difference_bytes"] = rss["large"] - rss["small"]
    print(f"peak RSS: large {rss['large'] / 2**20:.0f} MiB, small {rss['small'] / 2**20:.0f} MiB", flush=True)
    res["loader_images_per_s"] = {w: loader_rate(stores["large"], w, args.loader_batches) for w in (1, 2, 4)}
    res["step_images_per_s"] = {c: step_rate(c, stores["large"], work, args.step_steps)
                                for c in ("demo.yaml", "uvit-fashion.yaml")}
    print(json.dumps(res, indent=1), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    lr, st = res["loader_images_per_s"], res["step_images_per_s"]
    lines = ["# Dataset store at scale", "", f"- Command: `{res['command']}`", f"- Machine: {res['machine']}",
             f"- Date: {res['date']}", "",
             "| store | images | size | build |", "|---|---|---|---|"]
    for name in ("large", "small"):
        s = res[f"store_{name}"]
        lines.append(f"| {name} | {s['count']:,} | {s['bytes'] / 2**30:.2f} GiB | {s['build_s']} s |")
    lines += ["", f"Peak RSS of `steadydiff train` (demo UNet, 64x64x3, {args.train_steps} steps): large "
              f"{rss['large'] / 2**20:.0f} MiB, small {rss['small'] / 2**20:.0f} MiB, difference "
              f"{res['rss_difference_bytes'] / 2**20:+.1f} MiB (target: < 100 MB).", "",
              "| loader workers | images/s (batch 256) | / demo UNet step | / U-ViT preset step |", "|---|---|---|---|"]
    for w, v in lr.items():
        lines.append(f"| {w} | {v:,.0f} | {v / st['demo.yaml']:.0f}x | {v / st['uvit-fashion.yaml']:.0f}x |")
    lines += ["", f"Training step (batch 32, fp32, 2 threads): demo UNet {st['demo.yaml']:.1f} images/s, U-ViT preset "
              f"{st['uvit-fashion.yaml']:.1f} images/s.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
