"""EDM2 study on top of `steadydiff compare experiments/edm2.yaml --out OUT`:

1. Activation and weight magnitudes (RMS per block, logged by the magnitude monitor) with and without magnitude
   preservation: how much each grows from the first to the last logged step (EDM2 Sec. 2, Fig. 3).
2. The post-hoc EMA sweep: the quality of EMA weights reconstructed for a grid of sigma_rel from the MP arm's
   snapshots (EDM2 Sec. 3), and a held-out check: every other tracked sigma_rel (0.10 inside the range:
   interpolation; 0.03 and 0.25 outside it: extrapolation, where the run tracked them) reconstructed from the
   0.05 and 0.15 snapshots alone, against the EMA that was tracked directly during training: relative L2 of
   the weights and the FD of samples from each.

    python experiments/edm2_study.py OUT [--experiment experiments/edm2-mp-lr.yaml] [--n 200] [--steps 8]
        [--seeds 10,11]

Writes OUT/edm2_study.json, OUT/edm2_study.md, OUT/magnitudes.png and OUT/phema_sweep.png.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from steadydiff.data import load_dataset
from steadydiff.diffusion import build_formulation
from steadydiff.experiments import load_experiment, run_dir
from steadydiff.metrics.evaluate import evaluate
from steadydiff.nn import build_model
from steadydiff.runs import read_metrics
from steadydiff.train.phema import list_snapshots, reconstruct
from steadydiff.utils.io import atomic_write, atomic_write_text

SWEEP = [0.02, 0.04, 0.06, 0.08, 0.10, 0.12, 0.15, 0.20, 0.25]
BASIS = (0.05, 0.15)  # the two snapshot lengths the held-out check reconstructs from


def rel_l2(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over the floating-point tensors of two state dicts."""
    keys = [k for k in b if b[k].is_floating_point()]
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in keys)
    return math.sqrt(num / sum(float(b[k].double().pow(2).sum()) for k in keys))


def magnitude_growth(rows: list[dict], kind: str) -> dict[str, float]:
    """last / first logged RMS of every block for `kind` in (act, weight)."""
    prefix = f"mag/{kind}/"
    rows = [r for r in rows if any(k.startswith(prefix) for k in r)]
    if len(rows) < 2:
        return {}
    first, last = rows[0], rows[-1]
    return {k[len(prefix):]: last[k] / first[k] for k in first if k.startswith(prefix) and k in last and first[k] > 0}


def mean_series(rows: list[dict], kind: str) -> tuple[list[int], list[float]]:
    """Per logged step, the geometric mean over blocks of the RMS (one line per run in the plot)."""
    prefix = f"mag/{kind}/"
    steps, vals = [], []
    for r in rows:
        v = [r[k] for k in r if k.startswith(prefix) and r[k] > 0]
        if v:
            steps.append(r["step"])
            vals.append(float(np.exp(np.mean(np.log(v)))))
    return steps, vals


def fd_of(weights: dict, cfg, ds, n: int, steps: int, seed: int) -> float:
    formulation = build_formulation(cfg.diffusion)
    model = formulation.wrap(build_model(cfg.model, ds.sample_shape))
    model.load_state_dict(weights)
    res = evaluate(model, formulation, cfg, ds, ["fd_fmnist"], n, cfg.train.sample_sampler, steps, seed=seed)
    return res["fd_fmnist"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the --out of `steadydiff compare experiments/edm2.yaml`")
    ap.add_argument("--experiment", default=str(Path(__file__).with_name("edm2-mp-lr.yaml")))
    ap.add_argument("--n", type=int, default=200, help="samples per FD")
    ap.add_argument("--steps", type=int, default=8, help="Heun steps per sample")
    ap.add_argument("--seeds", help="MP-arm seeds for the post-hoc EMA part, comma-separated (default: all; "
                    "each costs 15 FD evaluations)")
    args = ap.parse_args()
    out = Path(args.out)
    exp = load_experiment(args.experiment)
    t0 = time.perf_counter()
    report: dict = {"magnitudes": {}, "phema": {}}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    for arm in exp.arms:
        growth = {"act": [], "weight": []}
        for s in exp.seeds:
            rows = read_metrics(run_dir(out, arm, s))
            for kind, ax in zip(("act", "weight"), axes):
                g = magnitude_growth(rows, kind)
                growth[kind] += list(g.values())
                st, v = mean_series(rows, kind)
                ax.plot(st, v, lw=1, label=f"{arm} seed {s}",
                        color="tab:red" if arm.startswith("no-mp") else "tab:green" if arm.startswith("mp")
                        else "tab:orange")
        report["magnitudes"][arm] = {
            f"{kind}_growth": {"median": float(np.median(v)) if v else math.nan,
                               "max": float(np.max(v)) if v else math.nan, "blocks_x_seeds": len(v)}
            for kind, v in growth.items()}
    for ax, kind in zip(axes, ("activations", "weights")):
        ax.set_title(f"{kind}: geometric-mean RMS over blocks")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    atomic_write(out / "magnitudes.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)

    torch.set_num_threads(2)
    phema_seeds = [int(v) for v in args.seeds.split(",")] if args.seeds else exp.seeds
    # Seeds measured before with the same --n and --steps are kept (each costs 15 sampling runs), and each new
    # seed is saved as soon as it is done: the study can be stopped, and extended seed by seed.
    report["n"], report["steps"] = args.n, args.steps
    prev_path = out / "edm2_study.json"
    prev = json.loads(prev_path.read_text()) if prev_path.is_file() else {}
    if prev.get("n") == args.n and prev.get("steps") == args.steps:
        for k, r in prev.get("phema", {}).items():
            report["phema"][int(k)] = {**r, "fd_vs_sigma_rel": {float(sr): v for sr, v in r["fd_vs_sigma_rel"].items()}}
    for s in phema_seeds:
        rdir = run_dir(out, "mp", s)
        if s in report["phema"] or not (rdir / "phema").is_dir():
            continue
        cfg = exp.run_config("mp", s)
        ds = load_dataset(cfg.data)
        snaps = list_snapshots(rdir / "phema")
        last = max(sn.step for sn in snaps)
        sweep = {}
        for (_, sr), w in reconstruct(snaps, [(last, sr) for sr in SWEEP]):
            sweep[sr] = fd_of(w, cfg, ds, args.n, args.steps, seed=0)
        # Held out: every other tracked length from the BASIS snapshots only, against its directly tracked EMA
        # (reconstructing from the single tracked snapshot returns it exactly: coefficient 1).
        def near(sn, sr):
            return abs(sn.sigma_rel - sr) < 1e-6
        basis = [sn for sn in snaps if any(near(sn, b) for b in BASIS)]
        held = sorted({sn.sigma_rel for sn in snaps if not any(near(sn, b) for b in BASIS)})
        checks = {}
        for sr in held:
            (_, recon), = list(reconstruct(basis, [(last, sr)]))
            (_, tracked), = list(reconstruct([sn for sn in snaps if near(sn, sr) and sn.step == last], [(last, sr)]))
            checks[f"{sr:g}"] = {"kind": "interpolation" if BASIS[0] < sr < BASIS[1] else "extrapolation",
                                 "rel_l2": rel_l2(recon, tracked),
                                 "fd_tracked": fd_of(tracked, cfg, ds, args.n, args.steps, seed=0),
                                 "fd_reconstructed": fd_of(recon, cfg, ds, args.n, args.steps, seed=0)}
        report["phema"][s] = {"step": last, "snapshots": len(snaps), "fd_vs_sigma_rel": sweep, "heldout": checks}
        atomic_write_text(prev_path, json.dumps(report, indent=1) + "\n")
    report["phema"] = dict(sorted(report["phema"].items()))
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=100)
    for s, r in report["phema"].items():
        ax.plot(list(r["fd_vs_sigma_rel"]), list(r["fd_vs_sigma_rel"].values()), "o-", lw=1, label=f"seed {s}")
    ax.set_xlabel("sigma_rel (post-hoc EMA length)")
    ax.set_ylabel("fd_fmnist")
    ax.set_title("post-hoc EMA sweep (MP UNet, final step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(out / "phema_sweep.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    atomic_write_text(out / "edm2_study.json", json.dumps(report, indent=1) + "\n")

    lines = ["# EDM2 study: magnitudes and post-hoc EMA", "",
             f"Command: `python experiments/edm2_study.py {args.out} --n {args.n} --steps {args.steps}"
             f"{' --seeds ' + args.seeds if args.seeds else ''}` "
             f"({report['wall_s']:.0f} s; seeds measured by an earlier call with the same --n and --steps are kept: "
             f"{', '.join(str(k) for k in report['phema'])} in all)", "",
             "## Magnitude growth, last / first logged RMS per block (median and max over blocks and seeds)", "",
             "| arm | activations median | activations max | weights median | weights max |", "|---|---|---|---|---|"]
    for arm, m in report["magnitudes"].items():
        lines.append(f"| {arm} | {m['act_growth']['median']:.3g} | {m['act_growth']['max']:.3g} | "
                     f"{m['weight_growth']['median']:.3g} | {m['weight_growth']['max']:.3g} |")
    lines += ["", "## Post-hoc EMA (MP arm, final step): FD of reconstructed EMAs", "",
              "| seed | " + " | ".join(f"sr={sr}" for sr in SWEEP) + " |", "|---|" + "---|" * len(SWEEP)]
    for s, r in report["phema"].items():
        lines.append(f"| {s} | " + " | ".join(f"{r['fd_vs_sigma_rel'][sr]:.3g}" for sr in SWEEP) + " |")
    lines += ["", f"## Held out: reconstructed from the sigma_rel {BASIS[0]} and {BASIS[1]} snapshots alone, "
              "against the directly tracked EMA", "",
              "| seed | sigma_rel | kind | rel. L2 of weights | FD tracked | FD reconstructed |",
              "|---|---|---|---|---|---|"]
    for s, r in report["phema"].items():
        for sr, c in r["heldout"].items():
            lines.append(f"| {s} | {sr} | {c['kind']} | {c['rel_l2']:.2e} | {c['fd_tracked']:.3g} | "
                         f"{c['fd_reconstructed']:.3g} |")
    lines += ["", "![magnitudes](magnitudes.png)", "", "![post-hoc EMA sweep](phema_sweep.png)", ""]
    atomic_write_text(out / "edm2_study.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
