"""The training state a checkpoint holds and a resume restores, and its on-disk schema in one place.

A checkpoint (`runs/checkpoint.py`) is three files:
    model.safetensors  the trained weights                    <- `model.state_dict()`
    ema.safetensors    the EMA weights (what sampling uses)   <- `ema.state_dict()`
    state.pt           everything else, plain tensors and numbers (`weights_only=True` safe) <- `to_dict()`:
        step            the number of optimiser steps taken
        optimizer       AdamW's state_dict
        config          the resolved config (YAML text)
        data_position   step x global batch: where the seeded index stream continues
        sample_shape    the data's sample shape (a resume on other data is refused)
        world_size      the number of processes that wrote it (any number may resume it)
        nonfinite       the non-finite policy's counters
        log_window      the steps since the last metrics.jsonl record, so a record averaged across the
                        checkpoint equals an uninterrupted run's
        power_ema       the post-hoc EMA averages (only when train.ema_sigma_rels is set)
Keys are read with defaults where older checkpoints lack them (a converted checkpoint has no optimiser: it
fine-tunes with a fresh one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import runs
from ..config import Config, dump_config
from .ema import EMA
from .phema import PowerEMA


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    diagnostics: dict[str, float] = field(default_factory=dict)
    levels: torch.Tensor | None = None  # the noise levels s drawn this step
    skipped: bool = False  # non-finite loss/gradient under train.nonfinite=skip: no update was made

    def to_dict(self) -> dict[str, Any]:
        """The part a checkpoint keeps (diagnostics are already in metrics.jsonl)."""
        return {"loss": self.loss, "grad_norm": self.grad_norm, "skipped": self.skipped,
                "levels": None if self.levels is None else self.levels.cpu()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepResult:
        return cls(d["loss"], d["grad_norm"], levels=d["levels"], skipped=d["skipped"])


class TrainState:
    """The mutable state of a training run: weights, optimiser, weight averagers, non-finite counters, the step
    and the log window. `save` writes it as one checkpoint, `restore` reads one back (see the module docstring
    for the schema). Every averager has the same interface (`update(model, step)`, `state_dict()`,
    `load_state_dict(state)`); the EMA's state is the weights file, the others' go into state.pt by name."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA,
                 extra_averagers: dict[str, Any], nonfinite):
        self.model, self.optimizer, self.ema, self.nonfinite = model, optimizer, ema, nonfinite
        self.extra_averagers = dict(extra_averagers)  # e.g. {"power_ema": PowerEMA}; rank 0 only
        self.step = 0
        self.log_window: list[StepResult] = []

    @property
    def averagers(self) -> list:
        return [self.ema, *self.extra_averagers.values()]

    def to_dict(self, cfg: Config, sample_shape, world_size: int) -> dict[str, Any]:
        """state.pt's contents (the weights files are written beside it)."""
        state = {"step": self.step, "optimizer": self.optimizer.state_dict(), "config": dump_config(cfg),
                 "data_position": self.step * cfg.train.batch_size, "sample_shape": list(sample_shape),
                 "world_size": world_size, "nonfinite": self.nonfinite.state_dict(),
                 "log_window": [r.to_dict() for r in self.log_window]}
        state.update({name: a.state_dict() for name, a in self.extra_averagers.items()})
        return state

    def load_dict(self, state: dict[str, Any]) -> None:
        """Restore from `to_dict`'s output (older checkpoints: missing keys keep their fresh values)."""
        if "optimizer" in state:  # absent in converted checkpoints: fine-tuning starts a fresh optimiser
            self.optimizer.load_state_dict(state["optimizer"])
        for name, averager in self.extra_averagers.items():
            if name in state:
                averager.load_state_dict(state[name])
        self.nonfinite.load_state_dict(state.get("nonfinite", {}))
        self.log_window = [StepResult.from_dict(r) for r in state.get("log_window", [])]
        self.step = int(state["step"])

    def save(self, ckpt_dir: Path, cfg: Config, sample_shape, world_size: int) -> Path:
        return runs.save_checkpoint(ckpt_dir, self.step, self.model.state_dict(), self.ema.state_dict(),
                                    self.to_dict(cfg, sample_shape, world_size), keep=cfg.train.keep_ckpts)

    def restore(self, ckpt: runs.Checkpoint) -> None:
        self.model.load_state_dict(ckpt.model)
        if ckpt.ema is not None:
            self.ema.load_state_dict(ckpt.ema)
        self.load_dict(ckpt.state)

    def resume(self, ckpt_dir: Path, run_dir: Path, sample_shape) -> int | None:
        """Restore the newest checkpoint in `ckpt_dir`, if any (a run on data of another shape is refused);
        returns its step, None when there is none."""
        path = runs.latest_checkpoint(ckpt_dir)
        if path is None:
            return None
        ckpt = runs.read_checkpoint(path)
        runs.check_sample_shape(run_dir, ckpt.state.get("sample_shape"), sample_shape)
        self.restore(ckpt)
        return ckpt.step


def build_averagers(model: nn.Module, t, is_main: bool, run_dir: Path) -> tuple[EMA, dict[str, Any]]:
    """(the EMA, the other averagers by checkpoint key) that TrainConfig `t` asks for.

    Every rank keeps the EMA (identical everywhere), so any rank could sample; only rank 0's is saved. EDM2's
    power-function EMAs (post-hoc EMA, `train.ema_sigma_rels`) are parameter averages whose snapshots only
    rank 0 writes, so only rank 0 holds them (they cost a model copy per sigma_rel)."""
    extra = {}
    if t.ema_sigma_rels and is_main:
        extra["power_ema"] = PowerEMA(model, t.ema_sigma_rels, snapshot_dir=Path(run_dir) / "phema",
                                      snapshot_every=t.phema_snapshot_every or t.ckpt_every)
    return EMA(model, t.ema_decay, t.ema_warmup), extra
