"""ScaleLong's robustness theorem at initialisation (issue 18, item 5).

The bound of ScaleLong's Theorem 3.4 (shared/papers/scalelong-notes.md §2.3),
    ||UNet(x + d) - UNet(x)|| <= ||d|| [ sum_{i=1..N} kappa_i M_0^i + c_0 ],
grows exponentially in the number N of long skips for Org (kappa_i = 1) when the block gain M_0 > 1, is only
divided by sqrt 2 under the constant 1/sqrt2 scaling, and stays bounded for CS (kappa_i = kappa^(i-1)) when
kappa M_0 < 1. A bound need not be tight, so we measure the quantity itself: on freshly initialised U-ViTs
(width 128, patch 4, heads 4, the ScaleLong test bed) of depth 4..24 (N = 2..12 skips), for each of Org,
1/sqrt2 and CS kappa 0.5 and 16 random inits per point,
  * J: the largest singular value of the per-sample input Jacobian at t = 0.5 (power iteration, 10 steps), and
  * R: the random-direction gain ||f(x + d) - f(x)|| / ||d||, ||d|| = 1e-2 ||x||, mean over t in 0.1, 0.5, 0.9,
on 2 fixed Fashion-MNIST images noised by the VP forward process. Then per method the OLS slope of log J
and log R against N, with a 95% t-interval (n = 6 depths x 16 inits), and the Org - CS slope difference (95%
interval from the two slopes' standard errors, Welch-Satterthwaite degrees of freedom).

Pre-registered reading (before the run): the theorem's prediction holds at init if slope(Org) > 0 with its
interval above 0 and slope(Org) - slope(CS) > 0 with its interval above 0; 1/sqrt2 should have Org's slope.

    python experiments/sensitivity_at_init.py --out reports/sensitivity-at-init [--inits 16]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from steadydiff.config import load_config
from steadydiff.data import load_dataset
from steadydiff.diagnostics.sensitivity import jacobian_spectral_norm, perturbation_ratio
from steadydiff.diffusion import build_formulation
from steadydiff.experiments.inference import t_ppf
from steadydiff.nn import build_model
from steadydiff.utils.io import atomic_write, atomic_write_text

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "uvit-fashion.yaml"
DEPTHS = [4, 8, 12, 16, 20, 24]
METHODS = {"org": ["model.skip_scaling=org"], "inv_sqrt2": ["model.skip_scaling=inv_sqrt2"],
           "cs-0.5": ["model.skip_scaling=cs", "model.kappa=0.5"]}
RATIO_TS = [0.1, 0.5, 0.9]


def ols_slope(x: np.ndarray, y: np.ndarray) -> dict:
    """OLS slope of y on x with its standard error, residual df and 95% t-interval."""
    xc = x - x.mean()
    slope = float((xc * (y - y.mean())).sum() / (xc**2).sum())
    resid = y - y.mean() - slope * xc
    df = len(x) - 2
    se = float(math.sqrt((resid**2).sum() / df / (xc**2).sum()))
    q = t_ppf(0.975, df)
    return {"slope": slope, "se": se, "df": df, "ci": [slope - q * se, slope + q * se]}


def slope_difference(a: dict, b: dict) -> dict:
    """a - b for two independent OLS slopes: 95% t-interval with Welch-Satterthwaite df."""
    d = a["slope"] - b["slope"]
    se = math.hypot(a["se"], b["se"])
    df = (a["se"] ** 2 + b["se"] ** 2) ** 2 / (a["se"] ** 4 / a["df"] + b["se"] ** 4 / b["df"])
    q = t_ppf(0.975, df)
    return {"diff": d, "se": se, "df": df, "ci": [d - q * se, d + q * se]}


def measure(depth: int, method: str, init: int, x0: torch.Tensor, noise: torch.Tensor) -> dict:
    cfg = load_config(CONFIG, [f"model.depth={depth}", "model.embed_dim=128", "model.patch_size=4",
                               "model.num_heads=4", *METHODS[method]])
    torch.manual_seed(1000 * depth + init)  # the same init draws for every method at a given depth and init
    model = build_model(cfg.model, tuple(x0.shape[1:]))
    sde = build_formulation(cfg.diffusion)
    gen = torch.Generator().manual_seed(init)
    ratios = []
    for t in RATIO_TS:
        tt = torch.full((x0.shape[0],), t)
        ratios.append(float(perturbation_ratio(model, sde.perturb(x0, tt, noise), sde.model_time(tt),
                                               generator=gen).mean()))
    tt = torch.full((x0.shape[0],), 0.5)
    jac = float(jacobian_spectral_norm(model, sde.perturb(x0, tt, noise), sde.model_time(tt), iters=10,
                                       generator=gen).mean())
    return {"depth": depth, "skips": depth // 2, "method": method, "init": init, "J": jac,
            "R": float(np.mean(ratios))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--inits", type=int, default=16)
    ap.add_argument("--depths", type=int, nargs="+", default=DEPTHS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "points.jsonl"
    done = {}
    if cache.exists():  # resumable: one line per measured point
        for line in cache.read_text().splitlines():
            p = json.loads(line)
            done[p["depth"], p["method"], p["init"]] = p
    cfg = load_config(CONFIG)
    ds = load_dataset(cfg.data)
    x0 = ds.items_range(0, 2).clone()
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7))
    t0 = time.perf_counter()
    todo = [(d, m, i) for d in args.depths for i in range(args.inits) for m in METHODS if (d, m, i) not in done]
    for k, key in enumerate(todo):
        p = measure(*key, x0, noise)
        done[key] = p
        with cache.open("a") as f:
            f.write(json.dumps(p) + "\n")
        print(f"[{k + 1}/{len(todo)}] {p}", flush=True)
    points = [done[d, m, i] for d in args.depths for m in METHODS for i in range(args.inits)]
    fits = {}
    for q in ("J", "R"):
        fits[q] = {}
        for m in METHODS:
            sel = [p for p in points if p["method"] == m]
            fits[q][m] = ols_slope(np.array([p["skips"] for p in sel], float), np.log([p[q] for p in sel]))
        fits[q]["org - cs-0.5"] = slope_difference(fits[q]["org"], fits[q]["cs-0.5"])
        fits[q]["org - inv_sqrt2"] = slope_difference(fits[q]["org"], fits[q]["inv_sqrt2"])
    result = {"points": points, "fits": fits, "wall_s": round(time.perf_counter() - t0, 1),
              "command": f"python experiments/sensitivity_at_init.py --out {args.out} --inits {args.inits}"}
    atomic_write_text(args.out / "results.json", json.dumps(result, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    for ax, q, label in zip(axes, ("J", "R"), ("Jacobian spectral norm (t = 0.5)", "random-direction gain R")):
        for m, colour in zip(METHODS, ("tab:red", "tab:orange", "tab:green")):
            sel = [p for p in points if p["method"] == m]
            xs = np.array([p["skips"] for p in sel], float)
            ax.scatter(xs + {"org": -0.15, "inv_sqrt2": 0.0, "cs-0.5": 0.15}[m], [p[q] for p in sel], s=6,
                       color=colour, alpha=0.5)
            f = fits[q][m]
            grid = np.array(sorted(set(xs)))
            mean_log = np.mean(np.log([p[q] for p in sel]))
            ax.plot(grid, np.exp(mean_log + f["slope"] * (grid - xs.mean())), color=colour,
                    label=f"{m}: slope {f['slope']:+.3f}/skip")
        ax.set_yscale("log")
        ax.set_xlabel("long skips N (depth / 2)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(args.out / "sensitivity_vs_skips.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)
    print(json.dumps(fits, indent=1))


if __name__ == "__main__":
    main()
