"""Checkpoints: weights and EMA in safetensors, training state loadable with `weights_only=True`.

Layout under `RUN_DIR/checkpoints/`:
    step-000500/model.safetensors   trained weights
    step-000500/ema.safetensors     EMA weights (what `sample` uses by default)
    step-000500/state.pt            step, optimiser state, config (plain tensors/numbers: weights_only safe)
    latest                          text file naming the newest complete checkpoint directory

A checkpoint is written into a hidden temporary directory and renamed into place only once every file
is written and fsynced; `latest` is then replaced atomically. A crash at any moment therefore leaves the
previous checkpoint (and `latest` pointing to it) intact.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..utils.io import atomic_write_text, fsync_dir

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unreadable; the message names the fix."""


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None
    state: dict[str, Any]
    path: Path


def _contiguous(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses non-contiguous and memory-sharing tensors: store plain copies.
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def _write_files(tmp: Path, model_sd, ema_sd, state) -> None:
    tmp.mkdir(parents=True)
    save_file(_contiguous(model_sd), str(tmp / "model.safetensors"))
    if ema_sd is not None:
        save_file(_contiguous(ema_sd), str(tmp / "ema.safetensors"))
    torch.save(state, tmp / "state.pt")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    model_sd: dict[str, torch.Tensor],
    ema_sd: dict[str, torch.Tensor] | None,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step-{step:07d}"
    tmp = ckpt_dir / f".tmp-step-{step:07d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write_files(tmp, model_sd, ema_sd, {**state, "step": step})
        if final.exists():  # an earlier complete write of the same step: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(ckpt_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(ckpt_dir / "latest", final.name + "\n")
    _prune(ckpt_dir, keep, protect=final.name)
    return final


def _complete_dirs(ckpt_dir: Path) -> list[Path]:
    dirs = [p for p in ckpt_dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(dirs, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def _prune(ckpt_dir: Path, keep: int, protect: str) -> None:
    for p in _complete_dirs(ckpt_dir)[:-keep] if keep > 0 else []:
        if p.name != protect:
            shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_dir.glob(".tmp-step-*"):  # leftovers of writes that were killed
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


def load_state(path: Path) -> dict[str, Any]:
    """Training state; `weights_only=True` so a crafted pickle can never run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and friends
        raise CheckpointError(
            f"{path} is not a plain-tensor state file ({type(e).__name__}); steadydiff only loads "
            "safetensors and weights_only state: re-save it with steadydiff or delete it"
        ) from e


def read_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    try:
        model = load_file(str(path / "model.safetensors"))
        ema_file = path / "ema.safetensors"
        ema = load_file(str(ema_file)) if ema_file.exists() else None
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({e}); delete it to fall back to an older one") from e
    state = load_state(path / "state.pt")
    return Checkpoint(step=int(state["step"]), model=model, ema=ema, state=state, path=path)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The directory named by `latest`, or else the newest complete one; None if there is none."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    pointer = ckpt_dir / "latest"
    if pointer.exists():
        target = ckpt_dir / pointer.read_text().strip()
        if target.is_dir():
            return target
    dirs = _complete_dirs(ckpt_dir)
    return dirs[-1] if dirs else None


def find_weights(run_or_dir: str | Path) -> Path:
    """Resolve a run directory or a checkpoint directory to a checkpoint directory."""
    p = Path(run_or_dir)
    if (p / "model.safetensors").exists():
        return p
    ckpt = latest_checkpoint(p / "checkpoints")
    if ckpt is None:
        raise CheckpointError(f"no checkpoint found in {p}; train first with `steadydiff train --out {p}`")
    return ckpt
