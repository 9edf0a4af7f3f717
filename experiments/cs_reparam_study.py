"""Is ScaleLong's CS just a per-path step size? (issue 18, item 4)

A U-ViT out-block fuses a long skip with `Linear(2D -> D)(cat([x, c s]))` = W_x x + W_s (c s) + b, and CS sets
c = kappa^i (skip_scaling.py). Only the product c W_s reaches the network, so write W'_s = c W_s. Its gradient
is g' = g_s / c; Adam(W) keeps m = c m', v = c^2 v', and one AdamW step on W_s, multiplied by c, reads

    c W_s <- c W_s (1 - lr wd) - c lr m'_hat / (sqrt(v'_hat) + eps / c).

So CS training is *exactly* Org training with the skip half of each fusion weight initialised c times smaller
and given its own AdamW group: lr c lr, weight decay wd / c (the decay factor lr wd is unchanged), eps eps / c.
This script trains both for a few steps from the same draws and reports how far apart they end (float64 makes
the difference rounding only; float32 shows what accumulates in practice).

    python experiments/cs_reparam_study.py [--steps 50] [--depth 12] [--width 128] [--kappa 0.5] [--out DIR]

Implication for a fair baseline: CS's effect is a choice of init scale and per-path learning rate for W_s, a
point in a space Org could reach by tuning those; a gain from CS over Org at one shared lr is a gain of that
tuning, and "CS vs Org, each at its own best lr" is the comparison that asks whether CS adds anything else.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from steadydiff.config import load_config
from steadydiff.data import load_dataset
from steadydiff.diffusion import build_formulation
from steadydiff.nn import build_model

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "uvit-fashion.yaml"


class SplitFusion(nn.Module):
    """`Linear(2D -> D)` on cat([x, s]) with the x and s halves of its weight as separate parameters (so that
    the s half can have its own optimiser group); the same function as the Linear it replaces."""

    def __init__(self, linear: nn.Linear, skip_scale: float):
        super().__init__()
        d = linear.in_features // 2
        self.w_x = nn.Parameter(linear.weight.detach()[:, :d].clone())
        self.w_s = nn.Parameter(linear.weight.detach()[:, d:].clone() * skip_scale)  # W'_s = c W_s
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, z: Tensor) -> Tensor:
        d = self.w_x.shape[1]
        return z[..., :d] @ self.w_x.T + z[..., d:] @ self.w_s.T + self.bias


def twin_runs(steps: int = 50, depth: int = 12, width: int = 128, kappa: float = 0.5, lr: float = 1e-3,
              wd: float = 0.03, batch: int = 32, dtype: torch.dtype = torch.float64, seed: int = 0,
              max_items: int | None = None, fold_lr: bool = True) -> dict:
    """Train a CS U-ViT and its Org reparametrisation side by side from identical draws; return the largest
    relative difference of their parameters, of their losses on a fixed probe batch, and of their training
    losses. `fold_lr=False` is the control: the folded init alone, every group at the shared lr, wd and eps."""
    overrides = [f"model.depth={depth}", f"model.embed_dim={width}", "model.patch_size=4", "model.num_heads=4",
                 f"model.kappa={kappa}"] + ([f"data.max_items={max_items}"] if max_items else [])
    cfg_cs = load_config(CONFIG, overrides + ["model.skip_scaling=cs"])
    cfg_org = load_config(CONFIG, overrides + ["model.skip_scaling=org"])
    ds = load_dataset(cfg_cs.data)
    torch.manual_seed(seed)
    cs = build_model(cfg_cs.model, ds.sample_shape).to(dtype)
    org = build_model(cfg_org.model, ds.sample_shape).to(dtype)
    org.load_state_dict(cs.state_dict())
    coeffs = cs.skip_scaling.coefficients()
    # decoder_blocks()[i] consumes skip i (outermost first); fold c_i into the skip half of its fusion weight.
    groups_org: list[dict] = []
    scaled = set()
    for i, blk in enumerate(org.decoder_blocks()):
        blk.skip_linear = SplitFusion(blk.skip_linear, coeffs[i])
        c = coeffs[i] if fold_lr else 1.0
        groups_org.append({"params": [blk.skip_linear.w_s], "lr": c * lr, "weight_decay": wd / c, "eps": 1e-8 / c,
                           "base_lr": c * lr})
        scaled.add(id(blk.skip_linear.w_s))
    groups_org.insert(0, {"params": [p for p in org.parameters() if id(p) not in scaled], "lr": lr,
                          "weight_decay": wd, "eps": 1e-8, "base_lr": lr})
    opt_cs = torch.optim.AdamW([{"params": list(cs.parameters()), "base_lr": lr}], lr=lr, betas=(0.99, 0.999),
                               weight_decay=wd)
    opt_org = torch.optim.AdamW(groups_org, lr=lr, betas=(0.99, 0.999))
    sde = build_formulation(cfg_cs.diffusion)
    gen = torch.Generator().manual_seed(seed)
    probe_x = ds.items_range(0, 16).to(dtype)
    probe_t = torch.linspace(0.05, 0.95, 16, dtype=dtype)
    probe_noise = torch.randn(probe_x.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    losses = []
    warmup = max(1, steps // 5)
    for step in range(steps):
        idx = torch.randint(0, len(ds), (batch,), generator=gen)
        x0 = ds.items(idx).to(dtype)
        t = sde.sample_t(batch, gen, x0.device).to(dtype)
        noise = torch.randn(x0.shape, generator=gen, dtype=dtype)
        pair = []
        for model, opt in ((cs, opt_cs), (org, opt_org)):
            for g in opt.param_groups:  # linear warm-up on every group alike
                g["lr"] = g["base_lr"] * min(1.0, (step + 1) / warmup)
            loss = sde.loss(model, x0, t=t, noise=noise).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(pair)
    with torch.no_grad():
        probe_cs = sde.loss(cs, probe_x, t=probe_t, noise=probe_noise)
        probe_org = sde.loss(org, probe_x, t=probe_t, noise=probe_noise)
    # The parameters themselves: every Org tensor against its CS counterpart (W'_s against c_i W_s).
    param_diff = 0.0
    cs_params = dict(cs.named_parameters())
    for name, p in org.named_parameters():
        if ".skip_linear." in name:
            blk_name, part = name.rsplit(".skip_linear.", 1)
            w = cs_params[f"{blk_name}.skip_linear.weight"].detach()
            d = w.shape[1] // 2
            i = [b for b in org.decoder_blocks()].index(org.get_submodule(blk_name))
            ref = {"w_x": w[:, :d], "w_s": w[:, d:] * coeffs[i],
                   "bias": cs_params[f"{blk_name}.skip_linear.bias"].detach()}[part]
        else:
            ref = cs_params[name].detach()
        param_diff = max(param_diff, float((p.detach() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return {
        "steps": steps, "depth": depth, "width": width, "kappa": kappa, "lr": lr, "dtype": str(dtype),
        "fold_lr": fold_lr,
        "coefficients": coeffs,
        "max_rel_param_diff": param_diff,
        "max_rel_probe_loss_diff": float(((probe_cs - probe_org).abs() / probe_cs.abs()).max()),
        "max_loss_diff": max(abs(a - b) for a, b in losses),
        "first_loss": losses[0][0], "final_loss_cs": losses[-1][0], "final_loss_org_reparam": losses[-1][1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--kappa", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, default=None, help="write cs_reparam.json here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {}
    for name, dtype, fold in (("float64", torch.float64, True), ("float32", torch.float32, True),
                              ("float64, init folded, lr not (control)", torch.float64, False)):
        t0 = time.perf_counter()
        r = twin_runs(args.steps, args.depth, args.width, args.kappa, args.lr, dtype=dtype, fold_lr=fold)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        res[name] = r
        print(json.dumps(r))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cs_reparam.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
