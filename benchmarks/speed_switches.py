"""Each speed switch of `steadydiff train` against the default step, side by side in one process:
channels-last convolutions, the AdamW kernel (foreach / fused / a plain loop), activation checkpointing,
torch.compile and bf16 autocast, on the demo UNet and the U-ViT preset.

Every variant is built once (compilation happens in its warm-up, not in the timings), then the variants take
turns, `--steps` steps each, for `--rounds` rounds, so that machine noise hits all of them alike. We report the
median step time and, per variant, the median over rounds of (default time / variant time): > 1 is faster.
One step = loss + backward + clip + AdamW + EMA on a fixed random batch (benchmarks/gpu_check.py's step).

    PYTHONPATH=src python benchmarks/speed_switches.py [--configs demo uvit-fashion] [--rounds 5] [--steps 5]
                                                       [--variants ...] [--tiny]

Writes benchmarks/results/speed_switches.json and .md (command, machine, date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import CONFIGS, build, device_name, load, make_step, random_batch, sync  # noqa: E402

ROOT = Path(__file__).resolve().parent
FILES = {"demo": "demo.yaml", "uvit-fashion": "uvit-fashion.yaml", "edm2-fashion": "edm2-fashion.yaml"}

# name -> (config overrides, channels_last, optimizer_impl, compile, bf16)
VARIANTS = {
    "default": ([], False, "auto", False, False),
    "channels_last": ([], True, "auto", False, False),
    "optimizer foreach": ([], False, "foreach", False, False),
    "optimizer fused": ([], False, "fused", False, False),
    "optimizer plain loop": ([], False, "plain", False, False),
    "grad checkpointing": (["model.grad_checkpointing=true"], False, "auto", False, False),
    "compile": ([], False, "auto", True, False),
    "bf16 autocast": ([], False, "auto", False, True),
}


def build_variant(file: str, variant: str, batch: int, device: torch.device, tiny: bool, warmup: int):
    """(step callable, its fixed batch) for one variant, warmed up (compiled, kernels chosen)."""
    extra, channels_last, optimizer_impl, compile_, bf16 = VARIANTS[variant]
    cfg, shape = load(CONFIGS / file, tiny, extra)
    torch.manual_seed(0)  # the same initial weights for every variant
    formulation, model = build(cfg, shape)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device).to(memory_format=fmt)
    x, labels, t, noise = (None if v is None else v.to(device) for v in random_batch(cfg, formulation, shape, batch))
    x, noise = x.contiguous(memory_format=fmt), noise.contiguous(memory_format=fmt)
    step = make_step(model, formulation, cfg, device, bf16, optimizer_impl, compile_)
    args = (x, labels, t, noise)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step(*args)
    sync(device)
    return step, args, time.perf_counter() - t0


def time_steps(step, args, steps: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*args)
    sync(device)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--configs", nargs="+", default=["demo", "uvit-fashion"], choices=sorted(FILES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="shrunken models (a smoke test of this script)")
    ap.add_argument("--out", default=str(ROOT / "results" / "speed_switches"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    variants = ["default"] + [v for v in args.variants if v != "default"]

    results = []
    for name in args.configs:
        built, skipped = {}, {}
        for v in variants:
            try:
                built[v] = build_variant(FILES[name], v, args.batch, device, args.tiny, args.warmup)
            except Exception as e:  # e.g. no fused AdamW kernel, no C++ compiler for torch.compile
                skipped[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                print(f"{name} {v}: skipped ({skipped[v]})", flush=True)
        times: dict[str, list[float]] = {v: [] for v in built}
        for _ in range(args.rounds):
            for v, (step, batch, _) in built.items():
                times[v].append(time_steps(step, batch, args.steps, device))
        for v in variants:
            if v in skipped:
                results.append({"config": name, "variant": v, "skipped": skipped[v]})
                continue
            per_round = [d / s for d, s in zip(times["default"], times[v])]
            row = {"config": name, "variant": v, "ms_per_step": 1e3 * statistics.median(times[v]),
                   "images_per_s": args.batch / statistics.median(times[v]),
                   "speedup_vs_default": statistics.median(per_round), "per_round_speedup": per_round,
                   "warmup_s": built[v][2]}
            results.append(row)
            print(f"{name} {v}: {row['ms_per_step']:.1f} ms/step, x{row['speedup_vs_default']:.2f} vs default "
                  f"(rounds {min(per_round):.2f}-{max(per_round):.2f}), warm-up {row['warmup_s']:.1f} s", flush=True)
        del built

    meta = {"command": "python " + " ".join(sys.argv if argv is None else ["benchmarks/speed_switches.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{device_name(device)}, torch {torch.__version__}", "batch": args.batch,
            "rounds": args.rounds, "steps": args.steps, "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# Speed switches against the default step", "", f"- command: `{meta['command']}`",
             f"- date: {meta['date']}", f"- machine: {meta['machine']}",
             f"- batch {args.batch}; one step = loss + backward + clip + AdamW + EMA on a fixed random batch; "
             f"variants interleaved, {args.rounds} rounds of {args.steps} steps; speed-up = median over rounds of "
             "default time / variant time (> 1: faster; the range is the per-round min-max)", "",
             "| model | variant | ms/step | img/s | speed-up vs default (rounds) | warm-up s |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['config']} | {r['variant']} | - | - | skipped: {r['skipped']} | - |")
            continue
        pr = r["per_round_speedup"]
        lines.append(f"| {r['config']} | {r['variant']} | {r['ms_per_step']:.1f} | {r['images_per_s']:.1f} | "
                     f"{r['speedup_vs_default']:.2f}x ({min(pr):.2f}-{max(pr):.2f}) | {r['warmup_s']:.1f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
