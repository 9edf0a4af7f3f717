"""Post-hoc EMA reconstruction cost vs the number of stored snapshots (steadydiff.train.phema.reconstruct).

A synthetic ~10M-parameter model (10 tensors of 1000x1000) is tracked with two power EMAs (sigma_rel 0.05, 0.10)
and snapshotted (fp16 safetensors, the real `PowerEMA.snapshot` path) at 32 uniformly spaced steps = 64 files in a
temporary directory. For each n in {8, 16, 32, 64} snapshot files (n/2 uniformly spaced times x 2 EMAs) a *fresh
subprocess* reconstructs one target (last step, sigma_rel 0.15) and reports the wall time of `reconstruct` and its
peak RSS above the RSS just before the call, two ways: `resource.getrusage(RUSAGE_SELF).ru_maxrss` at the end
minus VmRSS before, and VmHWM after resetting the high-water mark (`/proc/self/clear_refs` = 5) minus VmRSS.
The orchestrating process imports neither torch nor steadydiff (snapshots are written by another subprocess):
Linux carries the parent's RSS high-water mark into ru_maxrss across fork+exec, which would otherwise mask the
worker's peak. Streaming should give time linear in n and memory flat in n (about one fp32 model copy for the
accumulator plus one tensor / one mapped file).

    python benchmarks/phema_bench.py [--reps 2] [--ns 8 16 32 64]

Writes benchmarks/results/phema.json and .md (command, machine, date included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent

N_TENSORS, SHAPE = 10, (1000, 1000)
TIMES = 32  # snapshot times; 2 EMAs each -> 64 files
STEP_EVERY = 100


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def vm_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_snapshots(directory: Path) -> None:
    import torch
    from torch import nn

    from steadydiff.train.phema import PowerEMA

    model = nn.ParameterList([nn.Parameter(torch.zeros(SHAPE)) for _ in range(N_TENSORS)])
    ema = PowerEMA(model, (0.05, 0.10))
    g = torch.Generator().manual_seed(0)
    for k in range(1, TIMES + 1):
        with torch.no_grad():
            for p in model:
                p.normal_(generator=g).add_(0.05 * k)
        step = k * STEP_EVERY
        # one update per snapshot interval (dt = STEP_EVERY): enough for synthetic data
        ema.update(model, step)
        ema.snapshot(directory, step, {})
    print(json.dumps({"torch": torch.__version__}))


def worker(directory: str, n: int) -> None:
    import torch

    from steadydiff.train.phema import list_snapshots, reconstruct

    torch.set_num_threads(1)
    snaps = list_snapshots(directory)
    stride = TIMES // (n // 2)
    chosen = [s for s in snaps if (s.step // STEP_EVERY) % stride == 0]
    assert len(chosen) == n, (len(chosen), n)
    last = max(s.step for s in chosen)
    rss0 = vm_mb("VmRSS")
    max0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        hwm_ok = True
    except OSError:
        hwm_ok = False
    t0 = time.perf_counter()
    checksum = 0.0
    for _, state in reconstruct(chosen, [(last, 0.15)]):
        checksum += float(sum(float(v.sum()) for v in state.values()))
        del state
    dt = time.perf_counter() - t0
    max1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    hwm = vm_mb("VmHWM") if hwm_ok else float("nan")
    print(json.dumps({"n": n, "seconds": dt, "rss_before_mb": rss0, "maxrss_before_mb": max0,
                      "maxrss_after_mb": max1, "peak_delta_mb": max1 - rss0, "hwm_after_mb": hwm,
                      "hwm_delta_mb": hwm - rss0, "checksum": checksum}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--make", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    if args.make:
        make_snapshots(Path(args.make))
        return
    for n in args.ns:
        if n % 2 or TIMES % (n // 2):
            raise SystemExit(f"n must be even and n/2 must divide {TIMES}: {n}")
    params = N_TENSORS * SHAPE[0] * SHAPE[1]
    raw: dict[int, list[dict]] = {n: [] for n in args.ns}
    with tempfile.TemporaryDirectory(prefix="phema-bench-") as d:
        env = dict(os.environ, PYTHONPATH=str(ROOT.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        made = subprocess.run([sys.executable, __file__, "--make", d], check=True, capture_output=True, text=True,
                              env=env).stdout
        t_write = time.perf_counter() - t0
        torch_version = json.loads(made.strip().splitlines()[-1])["torch"]
        file_mb = statistics.mean(p.stat().st_size for p in Path(d).iterdir()) / 2 ** 20
        print(f"wrote {TIMES * 2} snapshots of {params / 1e6:.0f}M params ({file_mb:.1f} MiB each) in {t_write:.1f} s",
              flush=True)
        for r in range(args.reps):
            for n in args.ns:
                out = subprocess.run([sys.executable, __file__, "--worker", d, str(n)], check=True,
                                     capture_output=True, text=True, env=env).stdout
                row = json.loads(out.strip().splitlines()[-1])
                raw[n].append(row)
                print(f"rep {r} n={n}: {row['seconds']:.2f} s, peak +{row['peak_delta_mb']:.0f} MiB (maxrss), "
                      f"+{row['hwm_delta_mb']:.0f} MiB (VmHWM)", flush=True)
    rows = []
    for n in args.ns:
        secs = [x["seconds"] for x in raw[n]]
        med = statistics.median(secs)
        rows.append({"n": n, "seconds_median": med, "ms_per_snapshot": med / n * 1e3,
                     "peak_rss_delta_mb_max": max(x["peak_delta_mb"] for x in raw[n]),
                     "peak_hwm_delta_mb_max": max(x["hwm_delta_mb"] for x in raw[n])})
    fp32_mb = params * 4 / 2 ** 20
    meta = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_name()}, {os.cpu_count()} cpus, workers use 1 torch thread, torch {torch_version}",
        "setup": (f"{params / 1e6:.0f}M params ({N_TENSORS} x {SHAPE[0]}x{SHAPE[1]}), fp16 safetensors "
                  f"{file_mb:.1f} MiB/file, fp32 model copy {fp32_mb:.1f} MiB; one target (last step, sigma_rel 0.15); "
                  f"n files = n/2 uniformly spaced steps x EMAs (0.05, 0.10); fresh subprocess per run; "
                  f"page cache warm (files just written)"),
        "write_seconds_64_files": t_write, "results": rows, "raw": {str(k): v for k, v in raw.items()},
    }
    out = ROOT / "results" / "phema"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# Post-hoc EMA reconstruction: time and memory vs number of snapshots", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}", f"- machine: {meta['machine']}",
             f"- {meta['setup']}; medians of {args.reps} runs (memory: max)", "",
             "| snapshots n | time (s) | ms / snapshot | peak RSS above start, ru_maxrss (MiB) | same, VmHWM (MiB) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['seconds_median']:.2f} | {r['ms_per_snapshot']:.0f} | "
              f"{r['peak_rss_delta_mb_max']:.0f} | {r['peak_hwm_delta_mb_max']:.0f} |" for r in rows]
    lines += ["", f"One fp32 model copy = {fp32_mb:.0f} MiB; one snapshot file = {file_mb:.0f} MiB. Loading all n "
              f"snapshots at once would need about n x {file_mb:.0f} MiB."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
