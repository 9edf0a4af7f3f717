"""Which backbones ScaleLong's CS coefficient reaches (issue 18, item 6, first half).

For each backbone, at its trained checkpoint (or at init where none is given): the CS coefficients
kappa_i = 0.5^(i-1), the effective scale e_i = ||y(kappa_i s) - y(0)|| / ||y(s) - y(0)|| of each skip's
contribution at the output of the block that consumes it (`diagnostics.skip_effect`), and for the conv UNet the
share of each skip's channels that sit in GroupNorm groups with no main-path channel.

    PYTHONPATH=src python experiments/skip_effect_study.py --run unet=RUN_DIR --run uvit=RUN_DIR \
        [--init edm2] --out reports/skip-effect

Writes OUT/skip_effect.json and OUT/skip_effect.md (command, machine, date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from steadydiff.config import load_config
from steadydiff.data import load_dataset
from steadydiff.diagnostics.skip_effect import effective_skip_scales
from steadydiff.nn import build_model, cs_coefficients
from steadydiff.runs import load_model

INIT = {"edm2": ["model.backbone=edm2", "model.channels=16", "model.channel_mult=[1,2,2]", "model.num_res_blocks=1",
                 "model.attn_resolutions=[7]", "model.channels_per_head=8"],
        "unet": ["model.backbone=unet", "model.channels=16", "model.channel_mult=[1,2,2]", "model.num_res_blocks=1",
                 "model.attn_resolutions=[7]"]}


def measure(name: str, backbone, formulation, data_cfg, source: str, kappa: float, n: int = 64) -> dict:
    torch.manual_seed(0)
    ds = load_dataset(data_cfg)
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))[:n]
    x0 = ds.data[idx]
    row = {"backbone": name, "source": source, "kappa": kappa, "levels": []}
    coeffs = cs_coefficients(backbone.num_skips, kappa)
    iso = backbone.skip_groupnorm_isolation() if hasattr(backbone, "skip_groupnorm_isolation") else None
    for t in (0.1, 0.5, 0.9):  # VP time: low, middle and high noise
        g = torch.Generator().manual_seed(1)
        noise = torch.randn(x0.shape, generator=g)
        tt = torch.full((n,), t)
        xt = formulation.perturb(x0, tt, noise)
        e = effective_skip_scales(backbone, xt, formulation.model_time(tt), coeffs)
        row["levels"].append({"t": t, "effective": e})
    row["coeffs"], row["isolation"] = coeffs, iso
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", default=[], metavar="NAME=RUN_DIR")
    ap.add_argument("--init", action="append", default=[], choices=sorted(INIT))
    ap.add_argument("--kappa", type=float, default=0.5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from steadydiff.diffusion import VPSDE

    rows = []
    for spec in args.run:
        name, run = spec.split("=", 1)
        m = load_model(run)
        rows.append(measure(name, m.model, m.formulation, m.cfg.data, f"{run} (step {m.step}, EMA)", args.kappa))
    for name in args.init:
        cfg = load_config(None, INIT[name])
        rows.append(measure(name, build_model(cfg.model, (1, 28, 28)), VPSDE(), cfg.data, "random init", args.kappa))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "PYTHONPATH=src python " + " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}", "rows": rows}
    (out / "skip_effect.json").write_text(json.dumps(meta, indent=1) + "\n")
    lines = ["# How much of ScaleLong's CS coefficient reaches each backbone", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}", "",
             "e_i = ||y(kappa_i s) - y(0)|| / ||y(s) - y(0)||: the share of skip i's contribution at the output of "
             "the block that consumes it that survives the CS coefficient kappa_i (1 = the coefficient is undone, "
             "kappa_i = it passes on). 64 Fashion-MNIST images, VP noise at t = 0.1 / 0.5 / 0.9. `isolated` = share "
             "of the skip's channels in GroupNorm groups with no main-path channel (conv UNet only).", ""]
    for r in rows:
        lines += [f"## {r['backbone']} ({r['source']})", "",
                  "| skip (outermost first) | kappa_i | " + " | ".join(f"e_i at t={lv['t']}" for lv in r["levels"])
                  + (" | isolated |" if r["isolation"] else " |"),
                  "|---|---|" + "---|" * len(r["levels"]) + ("---|" if r["isolation"] else "")]
        for i, k in enumerate(r["coeffs"]):
            cells = [f"{lv['effective'][i]:.3f}" for lv in r["levels"]]
            iso = f" | {r['isolation'][i]:.2f}" if r["isolation"] else ""
            lines.append(f"| {i} | {k:.4g} | " + " | ".join(cells) + iso + " |")
        lines.append("")
    (out / "skip_effect.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
