"""`steadydiff phema`: post-hoc EMA weights of any length, reconstructed from a run's snapshots (EDM2 Sec. 3.2;
the maths and the snapshots: phema.py), each exported as a sampleable model folder."""

from __future__ import annotations

import math
from pathlib import Path

from ..runs import export_model, read_config, saved_sample_shape
from ..utils.errors import ConfigError
from .phema import SIGMA_REL_MAX, list_snapshots, reconstruct


def export_phema(run: str | Path, out: str | Path, sigma_rels: list[float],
                 step: int | None = None) -> list[tuple[float, int, Path]]:
    """For each relative EMA length in `sigma_rels`, the EMA weights at snapshot step `step` (default: the
    last) exported to OUT/step-SSSSSSS-sigma-R.RRR; returns (sigma_rel, step, folder) per export. Every
    input is checked before anything is written."""
    run, out = Path(run), Path(out)
    cfg = read_config(run)
    snap_dir = run / "phema"
    snaps = list_snapshots(snap_dir) if snap_dir.is_dir() else []
    if not snaps:
        raise ConfigError(f"no post-hoc EMA snapshots in {snap_dir}; train with train.ema_sigma_rels=[0.05,0.1]")
    # sigma_rel < 1/sqrt(12): the power-function profile's widest relative width (EDM2 Eq. 123, as gamma -> 0).
    bad = [sr for sr in sigma_rels if not (math.isfinite(sr) and 0 < sr < SIGMA_REL_MAX)]
    if bad or not sigma_rels:
        raise ConfigError(f"--sigma-rel: each must lie in the open interval (0, {SIGMA_REL_MAX:.4f}) i.e. "
                          f"(0, 1/sqrt(12)), got {bad[0] if bad else 'none'}")
    steps = sorted({sn.step for sn in snaps})
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"--step {step}: no snapshot at that step; available: {steps[0]} ... {steps[-1]}")
    shape = saved_sample_shape(run)
    if shape is None:
        raise ConfigError(f"{run} has no checkpoint to read the sample shape from; let training write one")
    done = []
    for (st, sr), weights in reconstruct(snaps, [(step, sr) for sr in sigma_rels]):
        target = export_model(out / f"step-{st:07d}-sigma-{sr:.3f}", cfg, weights, shape, step=st,
                              weights_kind=f"post-hoc EMA sigma_rel {sr:.3f}", sigma_rel=sr, source=str(run))
        done.append((sr, st, Path(target)))
    return done
