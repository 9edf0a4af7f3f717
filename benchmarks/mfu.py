"""FLOPs per training step and model FLOP utilisation (MFU) of the demo UNet and the U-ViT preset, in fp32 and
bf16 autocast, against this machine's measured matmul peak in the same dtype; plus a torch.profiler table of
the top ops per (model, precision), so that the gap to the roofline has names.

One step = VP loss + backward + grad clipping + AdamW + EMA, on random data (the step of benchmarks/gpu_check.py,
i.e. `Trainer.train_step` without data loading). FLOPs: steadydiff.train.flops.count_train_flops (matmuls,
convolutions and attention; 2 FLOPs per multiply-add).

    PYTHONPATH=src python benchmarks/mfu.py [--device cpu|cuda] [--batch 32] [--steps 10] [--rounds 3]
                                            [--configs demo uvit-fashion] [--precision fp32 bf16]

Writes benchmarks/results/mfu.json, mfu.md and mfu_profile_<config>_<precision>.txt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import device_name, time_config  # noqa: E402  (a sibling script, not a package)

from steadydiff.train.flops import measure_peak_flops  # noqa: E402

ROOT = Path(__file__).resolve().parent
FILES = {"demo": "demo.yaml", "uvit-fashion": "uvit-fashion.yaml", "uvit-cifar10-s2": "uvit-cifar10-s2.yaml",
         "edm2-fashion": "edm2-fashion.yaml"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per (model, precision), interleaved; median")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=["demo", "uvit-fashion"], choices=sorted(FILES))
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--tiny", action="store_true", help="shrunken models (a smoke test of this script)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "mfu"))
    args = ap.parse_args()

    device = torch.device(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    peaks = {p: measure_peak_flops(device, torch.bfloat16 if p == "bf16" else torch.float32, seconds=0.5)
             for p in args.precision}
    for p, v in peaks.items():
        print(f"measured {p} matmul peak: {v / 1e9:.1f} GFLOP/s", flush=True)

    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):  # interleaved, so that machine noise hits every row alike
        for name in args.configs:
            for prec in args.precision:
                row = time_config(name, FILES[name], args.batch, device, args.tiny, prec == "bf16", args.steps,
                                  args.warmup, peaks[prec])
                runs.setdefault((name, prec), []).append(row)
    results = []
    for (name, prec), rows in runs.items():
        dt = statistics.median(r["ms_per_step"] for r in rows) / 1e3
        r0 = rows[0]
        res = {"config": name, "precision": prec, "batch": args.batch, "params": r0["params"],
               "flops_per_step": r0["flops_per_step"], "ms_per_step": 1e3 * dt, "images_per_s": args.batch / dt,
               "achieved_flops": r0["flops_per_step"] / dt, "peak_flops": peaks[prec],
               "mfu": r0["flops_per_step"] / dt / peaks[prec], "ms_per_step_rounds": [r["ms_per_step"] for r in rows]}
        if not args.no_profile:  # a separate short run: the profiler's overhead stays out of the timings
            target = out.parent / f"{out.name}_profile_{name}_{prec}.txt"
            prof = time_config(name, FILES[name], args.batch, device, args.tiny, prec == "bf16", 1, 1, peaks[prec],
                               profile_path=target)
            res["profile"] = target.name
            res["time_shares"] = prof["time_shares"]
        results.append(res)
        print(f"{name} {prec}: {res['flops_per_step'] / 1e9:.2f} GFLOP/step, {res['images_per_s']:.1f} img/s, "
              f"{res['achieved_flops'] / 1e9:.1f} GFLOP/s, MFU {100 * res['mfu']:.1f}%", flush=True)

    meta = {"command": "python " + " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{device_name(device)}, torch {torch.__version__}", "peaks": peaks, "results": results}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# FLOPs per step and MFU", "", f"- command: `{meta['command']}`", f"- date: {meta['date']}",
             f"- machine: {meta['machine']}",
             f"- batch {args.batch}; one step = VP loss + backward + clip + AdamW + EMA on random data; medians of "
             f"{args.rounds} interleaved rounds of {args.steps} steps",
             "- peak: measured square matmul in the step's dtype (achievable, not datasheet): "
             + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()), "",
             "| model | precision | params | GFLOP/step | ms/step | img/s | GFLOP/s | MFU | top ops |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['config']} | {r['precision']} | {r['params'] / 1e6:.2f}M | "
                     f"{r['flops_per_step'] / 1e9:.2f} | {r['ms_per_step']:.1f} | {r['images_per_s']:.1f} | "
                     f"{r['achieved_flops'] / 1e9:.1f} | "
                     f"{100 * r['mfu']:.1f}% | {r.get('profile', '-')} |")
    shared = [r for r in results if "time_shares" in r]
    if shared:
        cats = list(shared[0]["time_shares"])
        lines += ["", "## Where the time goes", "",
                  "Share of the step's self time per op category (torch.profiler, 3 steps, separate from the timed "
                  "runs). Convolutions and matmuls carry the FLOPs; the rest is time the same FLOPs on the same "
                  "kernels could at best save, so 1 / (conv + matmul share) bounds the speed-up of any "
                  "re-implementation that keeps the kernels.", "",
                  "| model | precision | " + " | ".join(cats) + " | bound |", "|---|---|" + "---|" * (len(cats) + 1)]
        for r in shared:
            sh = r["time_shares"]
            flop_share = sh["convolution"] + sh["matmul + attention"]
            lines.append(f"| {r['config']} | {r['precision']} | " + " | ".join(f"{100 * sh[c]:.1f}%" for c in cats)
                         + f" | {1 / max(flop_share, 1e-9):.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')}, .md and the profiles")


if __name__ == "__main__":
    main()
