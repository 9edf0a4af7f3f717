"""Training throughput, side by side in one process:

- steadydiff's demo UNet against diffusers' UNet2DModel at matched size;
- steadydiff's U-ViT (configs/uvit-fashion.yaml) against the official U-ViT/ScaleLong model code at the
  identical configuration and weights, when `--official-uvit DIR` points at a checkout of
  sail-sg/ScaleLong (run beside ours, never committed; needs `einops` importable).

Both models take one identical training step (VP-SDE noise-prediction loss, backward, AdamW) on the same
batch, resolution and precision. Steps of the two models are interleaved in rounds so that machine noise
hits both alike; we report medians and the ratio. diffusers is a benchmark-only dependency
(`pip install -e ".[bench]"`).

    python benchmarks/throughput.py [--batch 32] [--rounds 5] [--steps 5] [--precision fp32 bf16]
                                    [--official-uvit PATH/TO/ScaleLong]

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
from steadydiff.train.flops import measure_peak_flops

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from gpu_check import op_breakdown  # noqa: E402  (a sibling script, not a package)


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


def uvit_pair(official_dir: str):
    """Our U-ViT preset and the official model at the same config, holding the same weights."""
    sys.path.insert(0, official_dir)
    from libs.uvit import UViT as OfficialUViT

    from steadydiff.nn.convert import load_official_uvit

    m = load_config(ROOT.parent / "configs" / "uvit-fashion.yaml").model
    torch.manual_seed(0)
    ref = OfficialUViT(img_size=28, patch_size=m.patch_size, in_chans=1, embed_dim=m.embed_dim, depth=m.depth,
                       num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, qkv_bias=m.qkv_bias,
                       mlp_time_embed=m.mlp_time_embed, scalelong=2, kappa=m.kappa)
    mine, _, _ = load_official_uvit(ref.state_dict(), m.num_heads, "cs", m.kappa)
    return mine, OfficialAdapter(ref)


class OfficialAdapter(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, t, labels=None):
        return self.net(x, t)


def train_flops(model, sde, x) -> int:
    """FLOPs of one training step's forward + backward (torch.utils.flop_counter: matmuls, convolutions,
    attention), so that "matched FLOPs" is checked, not assumed."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        sde.loss(model, x, generator=torch.Generator().manual_seed(0)).float().mean().backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def time_shares(model, sde, x, bf16: bool) -> dict[str, float]:
    """Share of a step's time per op category (gpu_check.op_breakdown), over 2 profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_steps(model, sde, x, 2, bf16)
    return op_breakdown(prof, torch.device("cpu"))


def compare(mine, ref, sde, x, bf16: bool, rounds: int, steps: int) -> dict:
    for m in (mine, ref):  # warm-up
        time_steps(m, sde, x, 2, bf16)
    times: dict[str, list[float]] = {"mine": [], "ref": []}
    for _ in range(rounds):
        times["mine"].append(time_steps(mine, sde, x, steps, bf16))
        times["ref"].append(time_steps(ref, sde, x, steps, bf16))
    med = {k: statistics.median(v) for k, v in times.items()}
    shares = {k: time_shares(m, sde, x, bf16) for k, m in (("mine", mine), ("ref", ref))}
    return {
        "steadydiff_time_shares": shares["mine"], "reference_time_shares": shares["ref"],
        "steadydiff_img_per_s": x.shape[0] / med["mine"],
        "reference_img_per_s": x.shape[0] / med["ref"],
        "ratio": med["ref"] / med["mine"],
        "per_round_ratio": [b / a for a, b in zip(times["mine"], times["ref"])],
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction sets that decide bf16's speed on a CPU: with AVX-512 BF16 or AMX the bf16 matmul is native;
# with AVX2 only PyTorch emulates it (the demo UNet trained ~10x slower than fp32 on an AVX2-only EPYC, issue 30).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_features() -> list[str]:
    """The ISA_FLAGS this CPU reports in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--out", default=str(ROOT / "results" / "throughput"))
    ap.add_argument("--official-uvit", help="checkout of sail-sg/ScaleLong to time its U-ViT beside ours")
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
    flops = {"steadydiff": train_flops(ours, sde, x), "diffusers": train_flops(theirs, sde, x)}
    pairs = [("unet", "diffusers UNet2DModel", ours, theirs)]
    if args.official_uvit:
        pairs.append(("uvit", "official U-ViT", *uvit_pair(args.official_uvit)))

    results = []
    for name, ref_name, mine, ref in pairs:
        for prec in args.precision:
            row = compare(mine, ref, sde, x, prec == "bf16", args.rounds, args.steps)
            row.update(model=name, reference=ref_name, precision=prec)
            results.append(row)
            print(f"{name} {prec}: steadydiff {row['steadydiff_img_per_s']:.1f} img/s, {ref_name} "
                  f"{row['reference_img_per_s']:.1f} img/s, ratio {row['ratio']:.2f}x", flush=True)

    meta = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}",
        "cpu_features": cpu_features(),
        "matmul_flops": {"fp32": measure_peak_flops("cpu", torch.float32),
                         "bf16": measure_peak_flops("cpu", torch.bfloat16)},
        "batch": args.batch, "resolution": 28,
        "steadydiff_params": n_ours, "diffusers_params": n_theirs, "diffusers_base_channels": base,
        "unet_flops_per_step": flops,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = [
        "# Training throughput: steadydiff vs reference implementations", "",
        f"- command: `{meta['command']}`", f"- date: {meta['date']}", f"- machine: {meta['machine']}",
        f"- CPU features: {', '.join(meta['cpu_features']) or 'unknown'} (of {', '.join(ISA_FLAGS)}); peak matmul "
        f"measured now: fp32 {meta['matmul_flops']['fp32'] / 1e9:.0f} GFLOP/s, bf16 "
        f"{meta['matmul_flops']['bf16'] / 1e9:.0f} GFLOP/s",
        f"- batch {args.batch}, 28x28x1, one step = VP loss + backward + AdamW; medians of {args.rounds} "
        f"interleaved rounds of {args.steps} steps",
        f"- UNet parameters: steadydiff {n_ours:,}, diffusers {n_theirs:,} (base channels {base}); FLOPs per "
        f"training step (forward + backward, batch {args.batch}): steadydiff {flops['steadydiff'] / 1e9:.2f} G, "
        f"diffusers {flops['diffusers'] / 1e9:.2f} G",
        "- U-ViT: configs/uvit-fashion.yaml, the official model built at the same config with the same weights", "",
        "| model | reference | precision | steadydiff img/s | reference img/s | speed ratio (ours / ref) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['model']} | {r['reference']} | {r['precision']} | {r['steadydiff_img_per_s']:.1f} | "
                     f"{r['reference_img_per_s']:.1f} | {r['ratio']:.2f}x |")
    lines += ["", "## Where the time goes", "",
              "Share of each model's step time in convolutions + matmuls/attention (the FLOPs), from torch.profiler "
              "(2 steps, after the timings). Both models run the same FLOPs on the same kernels, so only the rest "
              "can differ: 1 / (the reference's conv + matmul share) bounds how much faster than the reference "
              "any implementation of the same layers can be.", "",
              "| model | precision | steadydiff conv + matmul | reference conv + matmul | bound on ours / ref |",
              "|---|---|---|---|---|"]
    for r in results:
        fm, fr = (r[k]["convolution"] + r[k]["matmul + attention"]
                  for k in ("steadydiff_time_shares", "reference_time_shares"))
        lines.append(f"| {r['model']} | {r['precision']} | {100 * fm:.1f}% | {100 * fr:.1f}% | {1 / fr:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
