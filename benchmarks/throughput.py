"""Training throughput: steadydiff's demo UNet against diffusers' UNet2DModel at matched size.

Both models take one identical training step (VP-SDE noise-prediction loss, backward, AdamW) on the same
batch, resolution and precision. Steps of the two models are interleaved in rounds so that machine noise
hits both alike; we report medians and the ratio. diffusers is a benchmark-only dependency
(`pip install -e ".[bench]"`).

    python benchmarks/throughput.py [--batch 32] [--rounds 5] [--steps 5] [--precision fp32 bf16]

Writes benchmarks/results/throughput.json and .md (command, machine, date included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from steadydiff.config import load_config
from steadydiff.diffusion import VPSDE
from steadydiff.nn import build_model

ROOT = Path(__file__).resolve().parent


def diffusers_unet(target_params: int, resolution: int):
    """UNet2DModel with the demo's layout (3 levels, 1 res block, attention at the lowest level), its
    width searched so that its parameter count is closest to `target_params`."""
    from diffusers import UNet2DModel

    def make(base: int):
        return UNet2DModel(
            sample_size=resolution, in_channels=1, out_channels=1, layers_per_block=1,
            block_out_channels=(base, 2 * base, 2 * base), norm_num_groups=8,
            down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"), attention_head_dim=8,
        )

    best = min(range(8, 129, 8), key=lambda b: abs(sum(p.numel() for p in make(b).parameters()) - target_params))
    return make(best), best


class DiffusersAdapter(torch.nn.Module):
    """Call UNet2DModel with our (x, t, labels) signature."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, t, labels=None):
        return self.net(x, t).sample


def time_steps(model, sde, x, steps: int, bf16: bool) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = sde.loss(model, x, generator=g).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--out", default=str(ROOT / "results" / "throughput"))
    args = ap.parse_args()

    cfg = load_config(ROOT.parent / "configs" / "demo.yaml")
    torch.manual_seed(0)
    ours = build_model(cfg.model, (1, 28, 28))
    n_ours = sum(p.numel() for p in ours.parameters())
    theirs, base = diffusers_unet(n_ours, 28)
    theirs = DiffusersAdapter(theirs)
    n_theirs = sum(p.numel() for p in theirs.parameters())
    sde = VPSDE()
    x = torch.randn(args.batch, 1, 28, 28)

    results = []
    for prec in args.precision:
        bf16 = prec == "bf16"
        for m in (ours, theirs):  # warm-up
            time_steps(m, sde, x, 2, bf16)
        times: dict[str, list[float]] = {"steadydiff": [], "diffusers": []}
        for _ in range(args.rounds):
            times["steadydiff"].append(time_steps(ours, sde, x, args.steps, bf16))
            times["diffusers"].append(time_steps(theirs, sde, x, args.steps, bf16))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {
            "precision": prec,
            "steadydiff_img_per_s": args.batch / med["steadydiff"],
            "diffusers_img_per_s": args.batch / med["diffusers"],
            "ratio": med["diffusers"] / med["steadydiff"],
            "per_round_ratio": [b / a for a, b in zip(times["steadydiff"], times["diffusers"])],
        }
        results.append(row)
        print(f"{prec}: steadydiff {row['steadydiff_img_per_s']:.1f} img/s, diffusers "
              f"{row['diffusers_img_per_s']:.1f} img/s, ratio {row['ratio']:.2f}x", flush=True)

    meta = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}",
        "batch": args.batch, "resolution": 28,
        "steadydiff_params": n_ours, "diffusers_params": n_theirs, "diffusers_base_channels": base,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = [
        "# Training throughput: demo UNet vs diffusers UNet2DModel", "",
        f"- command: `{meta['command']}`", f"- date: {meta['date']}", f"- machine: {meta['machine']}",
        f"- batch {args.batch}, 28x28, one step = VP loss + backward + AdamW; medians of {args.rounds} "
        f"interleaved rounds of {args.steps} steps",
        f"- parameters: steadydiff {n_ours:,}, diffusers {n_theirs:,} (base channels {base})", "",
        "| precision | steadydiff img/s | diffusers img/s | ratio (ours / theirs) |", "|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['precision']} | {r['steadydiff_img_per_s']:.1f} | {r['diffusers_img_per_s']:.1f} | "
                     f"{r['ratio']:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
