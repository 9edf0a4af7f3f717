"""The run directory and the exported-model folder: how steadydiff lays out what it writes, and the one place
that reads it back.

A run directory (`steadydiff train --out RUN`):
    RUN/config.yaml          the resolved config (a resumed run must match it, see `check_run_dir`)
    RUN/metrics.jsonl        the metrics log (`runs.metrics_log`)
    RUN/checkpoints/         weights, EMA and training state (`runs.checkpoint`)
    RUN/phema/               post-hoc EMA snapshots (`train.phema`)
    RUN/probe.safetensors    the diagnostics' fixed probe batch; RUN/samples/, RUN/curves.png

An exported model folder (`steadydiff phema`, `steadydiff convert uvit-official`, `export_model`) is
self-describing, like a saved diffusers model: everything needed to rebuild and sample it sits side by side.
    OUT/config.yaml          the config that builds the network and its formulation
    OUT/model.json           format, sample shape, training step, which weights these are, provenance
    OUT/model.safetensors    the weights

`load_model(path)` opens either (or a single checkpoint directory) in one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from ..config import Config, ConfigError, config_differences, config_from_dict, dump_config
from ..utils.errors import SteadydiffError
from ..utils.io import atomic_write, atomic_write_text
from .checkpoint import CheckpointError, find_weights, latest_checkpoint, load_state, read_checkpoint

CONFIG = "config.yaml"
MODEL_JSON = "model.json"
MODEL_WEIGHTS = "model.safetensors"
MODEL_FORMAT = "steadydiff-model-1"


class RunDirError(SteadydiffError):
    """The run directory holds a different run, or data that no longer matches it; the message names the fix."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def saved_sample_shape(run_dir: str | Path) -> list[int] | None:
    """The data shape a run directory was trained on (from its latest checkpoint), or None before one."""
    latest = latest_checkpoint(checkpoint_dir(run_dir))
    return None if latest is None else load_state(latest / "state.pt").get("sample_shape")


def write_config(run_dir: str | Path, cfg: Config) -> None:
    atomic_write_text(Path(run_dir) / CONFIG, dump_config(cfg))


def read_config(run_dir: str | Path) -> Config:
    """The config of a run directory or model folder; a one-line ConfigError when it is missing or invalid."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a steadydiff run directory (no config.yaml); pass the --out of a "
                          "train run or an exported model folder")
    try:
        return config_from_dict(yaml.safe_load(path.read_text()))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML ({str(e).splitlines()[0]})") from e


def check_run_dir(run_dir: str | Path, cfg: Config) -> None:
    """Refuse to train `cfg` into a directory that holds a run with a config that differs in a way that
    changes the trajectory (resumable fields may differ)."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).exists():
        return
    try:
        old = read_config(run_dir)
    except ConfigError as e:
        raise RunDirError(f"{run_dir / CONFIG} is not a steadydiff config ({e}); use a new --out directory") from e
    diffs = config_differences(old, cfg)
    if diffs:
        raise RunDirError(
            f"{run_dir} holds a run with a different config ({'; '.join(diffs[:3])}); "
            "use a new --out directory, or the same config to resume"
        )


def check_sample_shape(run_dir: str | Path, saved: list[int] | None, now: tuple[int, ...]) -> None:
    """A checkpoint trained on data of another shape cannot be resumed on this data."""
    if saved is not None and list(saved) != list(now):  # e.g. a colour image added to a grayscale folder
        raise RunDirError(
            f"{run_dir} was trained on data of shape {list(saved)} but the data now has shape {list(now)}; "
            "restore the data or use a new --out directory"
        )


def export_model(out: str | Path, cfg: Config, weights: dict[str, torch.Tensor], sample_shape: tuple[int, ...],
                 step: int, weights_kind: str, **provenance: Any) -> Path:
    """Write a self-describing model folder (see the module docstring); returns `out`.

    `weights_kind` says which weights these are (e.g. "ema", "raw", "post-hoc EMA sigma_rel 0.100",
    "converted"); `provenance` adds JSON-able facts such as the source file or run.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_config(out, cfg)
    tensors = {k: v.detach().contiguous().clone() for k, v in weights.items()}
    atomic_write(out / MODEL_WEIGHTS, lambda p: save_file(tensors, str(p)))
    meta = {"format": MODEL_FORMAT, "sample_shape": [int(s) for s in sample_shape], "step": int(step),
            "weights": weights_kind, **provenance}
    atomic_write_text(out / MODEL_JSON, json.dumps(meta, indent=2) + "\n")
    return out


@dataclass
class LoadedModel:
    """A model rebuilt from a run directory, checkpoint directory or exported model folder."""

    cfg: Config
    model: nn.Module  # the trained module (backbone, or the EDM preconditioner holding it), in eval mode
    formulation: Any
    sample_shape: tuple[int, ...]
    step: int
    weights: str  # which weights were loaded: "EMA", "raw", "post-hoc EMA ...", "converted", ...
    path: Path  # the checkpoint directory or model folder the weights came from
    info: dict[str, Any] = field(default_factory=dict)  # model.json of an exported folder; {} otherwise


def _read_model_folder(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    try:
        info = json.loads((path / MODEL_JSON).read_text())
        if info.get("format") != MODEL_FORMAT:
            raise ValueError(f"format {info.get('format')!r}")
        weights = load_file(str(path / MODEL_WEIGHTS))
    except Exception as e:  # unreadable JSON or safetensors, a newer format
        raise CheckpointError(f"model folder {path} is unreadable ({e}); export it again with steadydiff") from e
    return weights, info


def is_model_folder(path: str | Path) -> bool:
    """An exported model folder (as opposed to a run directory or a checkpoint directory inside one)."""
    return (Path(path) / MODEL_JSON).is_file()


def source_config(path: str | Path) -> Config:
    """The config of what `load_model(path)` would load, without reading any weights: a run directory's, the run
    of a checkpoint directory inside one (RUN/checkpoints/step-N), or an exported model folder's."""
    path = Path(path)
    is_ckpt = not is_model_folder(path) and (path / MODEL_WEIGHTS).is_file()
    return read_config(path.parent.parent if is_ckpt else path)


def load_model(path: str | Path, use_ema: bool = True) -> LoadedModel:
    """Rebuild the model saved at `path`: a run directory (its latest checkpoint), a checkpoint directory
    inside one, or an exported model folder. `use_ema`: the EMA weights when the checkpoint has them."""
    from ..diffusion import build_formulation
    from ..nn import build_model

    path = Path(path)
    cfg = source_config(path)
    if is_model_folder(path):
        weights, info = _read_model_folder(path)
        shape, step, kind, src = tuple(info["sample_shape"]), int(info["step"]), str(info["weights"]), path
    else:
        src = find_weights(path)  # the latest checkpoint of a run, or `path` itself when it is one
        ckpt = read_checkpoint(src)
        use = use_ema and ckpt.ema is not None
        weights, info = (ckpt.ema if use else ckpt.model), {}
        shape, step, kind = tuple(int(s) for s in ckpt.state["sample_shape"]), ckpt.step, "EMA" if use else "raw"
    formulation = build_formulation(cfg.diffusion)
    model = formulation.wrap(build_model(cfg.model, shape))
    model.load_state_dict(weights)
    return LoadedModel(cfg, model.eval(), formulation, shape, step, kind, src, info)
