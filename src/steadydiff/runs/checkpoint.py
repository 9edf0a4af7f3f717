"""Checkpoints: weights and EMA in safetensors, training state loadable with `weights_only=True`.

Layout under `RUN_DIR/checkpoints/`:
    step-000500/model.safetensors   trained weights
    step-000500/ema.safetensors     EMA weights (what `sample` uses by default)
    step-000500/state.pt            step, optimiser state, config (plain tensors/numbers: weights_only safe)
    latest                          text file naming the newest complete checkpoint directory

A checkpoint is written into a hidden temporary directory and renamed into place only once every file
is written and fsynced; `latest` is then replaced atomically. Directories are removed (pruning, or
replacing a checkpoint of the same step) by first renaming them to a hidden `.trash-*` name, so a
`step-*` directory is always complete. A crash at any moment therefore leaves the previous checkpoint
(and `latest` pointing to it) intact; a failed write (disk full) raises `CheckpointError` and leaves the
directory as it was.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..utils.errors import SteadydiffError
from ..utils.io import atomic_write_text, fsync_dir

_STEP_DIR = re.compile(r"^step-(\d+)$")
# Test hook (crash-resume soak, benchmarks/soak.py): seconds to pause after each checkpoint file, so that a
# SIGKILL at a random moment lands inside a checkpoint write often enough to exercise that path.
_DELAY_ENV = "STEADYDIFF_TEST_CKPT_WRITE_DELAY"


class CheckpointError(SteadydiffError):
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
    delay = float(os.environ.get(_DELAY_ENV) or 0)
    tmp.mkdir(parents=True)
    save_file(_contiguous(model_sd), str(tmp / "model.safetensors"))
    time.sleep(delay)
    if ema_sd is not None:
        save_file(_contiguous(ema_sd), str(tmp / "ema.safetensors"))
        time.sleep(delay)
    torch.save(state, tmp / "state.pt")
    time.sleep(delay)
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
    final = ckpt_dir / f"step-{step:07d}"
    tmp = ckpt_dir / f".tmp-step-{step:07d}-{os.getpid()}"
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            _write_files(tmp, model_sd, ema_sd, {**state, "step": step})
            if final.exists():  # an earlier complete write of the same step (its `latest` update was lost)
                _remove(final)
            os.rename(tmp, final)
            fsync_dir(ckpt_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            atomic_write_text(ckpt_dir / "latest", final.name + "\n")
        except OSError:
            # `latest` still names the previous checkpoint; drop the new one so the directory is as before.
            _remove(final)
            raise
    except OSError as e:
        raise CheckpointError(f"could not write checkpoint {final} ({_reason(e)}); {_fix(e)} "
                              "(the previous checkpoint is kept; re-run the same command to resume)") from e
    _prune(ckpt_dir, keep, protect=final.name)
    return final


def _reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


def _fix(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space or change --out"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make the run directory writable or change --out"
    return "check the disk or change --out"


def _remove(path: Path) -> None:
    """Delete a checkpoint directory so that no half-deleted `step-*` directory is ever visible: rename it
    to a hidden trash name first (atomic), then delete that. A crash leaves only hidden trash behind."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _complete_dirs(ckpt_dir: Path) -> list[Path]:
    dirs = [p for p in ckpt_dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(dirs, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def _prune(ckpt_dir: Path, keep: int, protect: str) -> None:
    for p in _complete_dirs(ckpt_dir)[:-keep] if keep > 0 else []:
        if p.name != protect:
            try:
                _remove(p)
            except OSError:  # pruning is housekeeping: a failure here must not fail the run
                pass
    for pattern in (".tmp-step-*", ".trash-step-*"):  # leftovers of writes and deletions that were killed
        for p in ckpt_dir.glob(pattern):
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
