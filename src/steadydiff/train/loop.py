"""The training loop.

The loop knows no method by name: the backbone carries its skip-scaling object, the formulation (VP-SDE)
computes the loss, the LR schedule is an object, and the EMA is an object. Swapping any of them is a
config change, not an edit here.

Reproducibility: every random draw of step k (data order, flips, t, noise, dropout) comes from generators
seeded by (seed, k) and from the data sampler's global position k * batch. The trajectory is therefore a
pure function of (config, weights, optimiser state, k), and resuming from a checkpoint at step k gives
exactly the losses of a run that never stopped.

Distributed data parallel (under torchrun, see `train/distributed.py`): `train.batch_size` is the global
batch. Every rank draws the whole global batch (indices, flips, noise levels, noise) from the same (seed, k)
generators and keeps its contiguous slice, so the trajectory is the same for any number of processes up to
the order of floating-point reductions, and a checkpoint resumes under any number of processes. Only
dropout draws per rank (seeded by (seed, k, rank)): with model.dropout > 0 runs on different numbers of
processes are equal in distribution, not bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from tqdm import tqdm

from ..config import Config, ConfigError, config_from_dict, dump_config
from ..data import InfiniteSampler, get_batch, load_dataset
from ..diagnostics.monitors import (
    GradNormMonitor,
    MagnitudeMonitor,
    Monitor,
    ProbeBatch,
    ProbeMonitor,
    UpdateRatioMonitor,
)
from ..diffusion import build_formulation, draw_normal
from ..nn import build_model
from ..utils.images import save_samples
from ..utils.io import atomic_write, atomic_write_text
from .checkpoint import latest_checkpoint, read_checkpoint, save_checkpoint
from .distributed import (
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    check_replicas_in_sync,
    init_distributed,
    local_main_first,
    same_on_all_ranks,
    shutdown_distributed,
)
from .ema import EMA
from .flops import count_train_flops, measure_peak_flops
from .momentum import build_momentum
from .phema import PowerEMA
from .schedules import build_lr_schedule
from .timesteps import build_timesteps, level_histogram


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient became NaN/Inf (and train.nonfinite=stop, or too many steps in a row were
    skipped); the run stopped and the last good checkpoint is kept."""


class RunDirError(RuntimeError):
    """The run directory holds a different run; the message names the fix."""


# Config keys that may change between a run and its resumption (they do not alter the trajectory).
RESUMABLE_CHANGES = {
    "train.steps", "train.log_every", "train.ckpt_every", "train.keep_ckpts", "train.sample_every",
    "train.sample_n", "train.sample_sampler", "train.sample_steps", "train.sample_clip", "train.threads",
    "train.device",
    "train.fault_nan_at_step", "train.fault_steps", "train.fault_kind", "train.fault_where", "train.nonfinite",
    "train.max_consecutive_skips", "train.phema_snapshot_every", "train.eval_every", "train.eval_metrics",
    "train.eval_n", "train.eval_batch",
    # speed switches: same losses within fp32 round-off (bitwise-exact resume needs them unchanged)
    "train.channels_last", "train.optimizer_impl", "train.compile", "train.peak_flops", "model.grad_checkpointing",
}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(a: Config, b: Config) -> list[str]:
    """Differences that would change the trajectory (monitors and output settings may change on resume)."""
    fa, fb = _flatten(a.to_dict()), _flatten(b.to_dict())
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in fa
            if fa.get(k) != fb.get(k) and k not in RESUMABLE_CHANGES and not k.startswith("diagnostics.")]


def step_generator(seed: int, step: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """An independent generator for (seed, step, stream): draws never depend on what came before."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) * 16 + stream)
    return g


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    return torch.device(name)


def build_optimizer(params, t, device: torch.device) -> torch.optim.AdamW:
    """AdamW with the kernel train.optimizer_impl asks for: auto (PyTorch's default choice), foreach
    (multi-tensor), fused (one kernel per step; CUDA, and CPU in PyTorch >= 2.4) or plain (a Python loop)."""
    kw = {"auto": {}, "foreach": {"foreach": True}, "plain": {"foreach": False}, "fused": {"fused": True}}
    try:
        return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                 **kw[t.optimizer_impl])
    except (RuntimeError, ValueError) as e:  # e.g. fused on a device this PyTorch has no fused kernel for
        raise ConfigError(f"train.optimizer_impl={t.optimizer_impl} is not available on {device.type} with "
                          f"torch {torch.__version__} ({e}); use auto or foreach") from e


class TrainLoss(nn.Module):
    """The per-sample training loss as one module, so that DDP and torch.compile wrap all parameter use of a
    step (the backbone and, for EDM, the learned u(sigma)) inside a single forward."""

    def __init__(self, model: nn.Module, formulation):
        super().__init__()
        self.model = model
        self.formulation = formulation

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None, t: torch.Tensor,
                noise: torch.Tensor) -> torch.Tensor:
        return self.formulation.loss(self.model, x, labels, t=t, noise=noise)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    diagnostics: dict[str, float] = field(default_factory=dict)
    levels: torch.Tensor | None = None  # the noise levels s drawn this step
    skipped: bool = False  # non-finite loss/gradient under train.nonfinite=skip: no update was made


class Trainer:
    """Train `cfg` into `run_dir`, resuming from its latest checkpoint when there is one.

    `model`: train your own backbone instead of `cfg.model` (any module called as `model(x, t, labels)`
    that predicts the noise; see `steadydiff.nn.diffusers_compat.DiffusersUNetAdapter`). `steadydiff
    sample` rebuilds models from `cfg.model`, so for such runs sample from Python with `generate`.

    Under torchrun (WORLD_SIZE > 1) the trainer joins the process group itself and trains with DDP;
    `self.model` stays the unwrapped module (monitors, EMA and checkpoints see plain parameter names).
    Rank 0 writes every file and runs the periodic eval. `save` is collective: call it on every rank.
    Call `close()` when done to leave a process group the trainer created.
    """

    def __init__(self, cfg: Config, run_dir: str | Path, show_progress: bool = True,
                 model: torch.nn.Module | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.show_progress = show_progress
        self._check_run_dir()
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.dist, self.device = init_distributed(pick_device(t.device))
        try:
            self._setup(model)
        except BaseException:
            self.close()
            raise

    def _setup(self, model: nn.Module | None) -> None:
        cfg, t, world = self.cfg, self.cfg.train, self.dist.world_size
        if t.batch_size % (world * t.grad_accum):
            raise ConfigError(
                f"train.batch_size={t.batch_size} is the global batch and must be divisible by the number of "
                f"processes ({world}) x train.grad_accum ({t.grad_accum}); use a multiple of {world * t.grad_accum}"
            )
        with local_main_first(self.dist):  # a first run may download the data: once per node
            self.dataset = load_dataset(cfg.data)
        self.sampler = InfiniteSampler(len(self.dataset), seed=t.seed)
        if cfg.model.num_classes and cfg.model.num_classes != self.dataset.num_classes:
            raise ConfigError(
                f"model.num_classes={cfg.model.num_classes} but the dataset has {self.dataset.num_classes} "
                f"classes; set model.num_classes={self.dataset.num_classes} or 0 (unconditional)"
            )
        torch.manual_seed(t.seed)
        self.diffusion = build_formulation(cfg.diffusion)
        net = model if model is not None else build_model(cfg.model, self.dataset.sample_shape)
        # The trained module: the backbone (VP) or the EDM preconditioner holding it and u(sigma).
        self.model = self.diffusion.wrap(net).to(self.device)
        if t.channels_last:  # conv weights NHWC; batches are made NHWC in train_step
            self.model = self.model.to(memory_format=torch.channels_last)
        self.lr_schedule = build_lr_schedule(t)
        self.momentum = build_momentum(cfg)  # beta1 and LR factor per step (MDLRC and its controls)
        self.timesteps = build_timesteps(cfg, self.diffusion)  # noise-level sampler (base or CLTS)
        self.optimizer = build_optimizer(self.model.parameters(), t, self.device)
        # Every rank keeps the EMA (identical everywhere: same weights, same updates), so any rank could
        # sample; only rank 0's is saved.
        self.ema = EMA(self.model, t.ema_decay, t.ema_warmup)
        # EDM2 power-function EMAs (post-hoc EMA): parameter averages only, never forwarded in training mode.
        # Only rank 0 writes their snapshots, so only rank 0 holds them (they cost a model copy per sigma_rel).
        self.power_ema = PowerEMA(self.model, t.ema_sigma_rels) if t.ema_sigma_rels and self.dist.is_main else None
        self.step = 0
        self._last_saved: int | None = None  # the step of the newest checkpoint on disk
        self.skipped_steps = 0  # train.nonfinite=skip: steps whose update was skipped, and the current streak
        self.consecutive_skips = 0
        self.log_window: list[StepResult] = []  # steps since the last metrics.jsonl record (saved in checkpoints)
        self._resume()
        self._check_same_start()
        self.monitors: list[Monitor] | None = None  # built in fit(): the probe batch lives in the run dir
        self._flops: dict[str, float] | None = None  # flop_report(), once per trainer
        self._build_step_forward()

    def _build_step_forward(self) -> None:
        """The callable a training step runs: the loss module, wrapped in DDP and/or torch.compile."""
        self._loss_module = TrainLoss(self.model, self.diffusion)
        self._ddp = None
        forward: nn.Module = self._loss_module
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            # Broadcasts rank 0's weights once here; afterwards DDP averages gradients in backward.
            self._ddp = DistributedDataParallel(
                self._loss_module, device_ids=[self.device.index] if self.device.type == "cuda" else None)
            forward = self._ddp
        if self.cfg.train.compile:
            # Compiling the DDP module lets Dynamo split the graph at DDP's gradient buckets, so the
            # all-reduce still overlaps the backward.
            forward = torch.compile(forward)
        self._step_forward = forward

    def close(self) -> None:
        """Leave the process group if this trainer created it (`steadydiff train` does this at the end)."""
        shutdown_distributed(self.dist)

    def _build_monitors(self) -> list[Monitor]:
        d = self.cfg.diagnostics
        monitors: list[Monitor] = [GradNormMonitor(d.grad_every), UpdateRatioMonitor(d.update_every)]
        if d.probe_every or d.magnitude_every:
            probe = ProbeBatch.load_or_create(self.run_dir / "probe.safetensors", self, d.probe_size,
                                              d.probe_seed).to(self.device)
            monitors += [ProbeMonitor(d.probe_every, probe), MagnitudeMonitor(d.magnitude_every, probe)]
        return [m for m in monitors if m.every > 0]

    # ---------------------------------------------------------------------------------------------
    # run directory and resume

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def _check_run_dir(self) -> None:
        cfg_file = self.run_dir / "config.yaml"
        if not cfg_file.exists():
            return
        try:
            old = config_from_dict(yaml.safe_load(cfg_file.read_text()))
        except (ConfigError, yaml.YAMLError) as e:
            raise RunDirError(f"{cfg_file} is not a steadydiff config ({e}); use a new --out directory") from e
        diffs = config_differences(old, self.cfg)
        if diffs:
            raise RunDirError(
                f"{self.run_dir} holds a run with a different config ({'; '.join(diffs[:3])}); "
                "use a new --out directory, or the same config to resume"
            )

    def _resume(self) -> None:
        ckpt_path = latest_checkpoint(self.ckpt_dir)
        if ckpt_path is None:
            return
        ckpt = read_checkpoint(ckpt_path)
        saved, now = ckpt.state.get("sample_shape"), list(self.dataset.sample_shape)
        if saved is not None and list(saved) != now:  # e.g. a colour image added to a grayscale folder
            raise RunDirError(
                f"{self.run_dir} was trained on data of shape {list(saved)} but the data now has shape {now}; "
                "restore the data or use a new --out directory"
            )
        self.model.load_state_dict(ckpt.model)
        if ckpt.ema is not None:
            self.ema.model.load_state_dict(ckpt.ema)
        if "optimizer" in ckpt.state:  # absent in converted checkpoints: fine-tuning starts a fresh optimiser
            self.optimizer.load_state_dict(ckpt.state["optimizer"])
        if self.power_ema is not None and "power_ema" in ckpt.state:
            self.power_ema.load_state_dict(ckpt.state["power_ema"])
        nonfinite = ckpt.state.get("nonfinite", {})
        self.skipped_steps = int(nonfinite.get("skipped_steps", 0))
        self.consecutive_skips = int(nonfinite.get("consecutive", 0))
        # The steps since the last log record, so a record averaged across the checkpoint matches an
        # uninterrupted run's.
        self.log_window = [StepResult(r["loss"], r["grad_norm"], levels=r["levels"], skipped=r["skipped"])
                           for r in ckpt.state.get("log_window", [])]
        self.step = self._last_saved = ckpt.step

    def _check_same_start(self) -> None:
        """Every rank must start from the same checkpoint (or none): the run directory is shared."""
        if not same_on_all_ranks(self.step, self.dist, self.device):
            raise RunDirError(
                f"the processes found different checkpoints in {self.run_dir} (this one: step {self.step}); put "
                "--out on a file system that every node sees"
            )

    def _truncate_metrics(self) -> None:
        """Drop log lines written after the checkpoint we resume from (they will be written again)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        text = path.read_text()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        keep = [ln for ln in lines if (rec := _parse_line(ln)) is not None and rec.get("step", 0) <= self.step]
        # A process killed mid-write leaves a torn last line (or one without its newline, which the next
        # append would glue onto): rewrite the file whenever it is not exactly the lines we keep.
        if len(keep) != len(lines) or (text and not text.endswith("\n")):
            atomic_write_text(path, "".join(ln + "\n" for ln in keep))

    # ---------------------------------------------------------------------------------------------
    # one optimiser step

    def _autocast(self):
        if not self.cfg.train.bf16:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def train_step(self) -> StepResult:
        t, k = self.cfg.train, self.step
        self.model.train()
        lr = t.lr * self.lr_schedule(k) * self.momentum.lr_factor(k)
        beta1 = self.momentum.beta1(k)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["betas"] = (beta1, t.betas[1])
        rank, world = self.dist.rank, self.dist.world_size
        # Dropout and any other global-RNG draw. Rank 0 keeps the single-process seed; other ranks get their
        # own stream (the same stream on every rank would repeat one dropout pattern across the shards).
        torch.manual_seed(t.seed * 1_000_003 + k + (rank << 40))
        gen = step_generator(t.seed, k, stream=0, device=self.device)
        flip_gen = step_generator(t.seed, k, stream=1)
        # The whole global batch is drawn on every rank, in the single-process order (levels, then noise),
        # and each rank keeps its slice: the step does not depend on the number of processes.
        idx = self.sampler.indices(k * t.batch_size, t.batch_size)
        x, labels = get_batch(self.dataset, idx, self.cfg.data.hflip, flip_gen)
        levels = self.timesteps.sample(t.batch_size, k, gen, self.device)
        weights = self.timesteps.weights(levels, k)
        noise = draw_normal(x.shape, gen, self.device, dtype=x.dtype)
        lo, hi = rank * t.batch_size // world, (rank + 1) * t.batch_size // world
        x = x[lo:hi].to(self.device, non_blocking=True)
        labels = labels[lo:hi].to(self.device) if (labels is not None and self.cfg.model.num_classes) else None
        lv, noise = levels[lo:hi], noise[lo:hi]
        w = None if weights is None else weights[lo:hi]
        if t.channels_last and x.dim() == 4:
            x, noise = (v.contiguous(memory_format=torch.channels_last) for v in (x, noise))

        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        micro = (hi - lo) // t.grad_accum
        for m in range(t.grad_accum):
            sl = slice(m * micro, (m + 1) * micro)
            # DDP: accumulate locally and all-reduce only in the last micro-batch's backward.
            sync = self._ddp is None or m == t.grad_accum - 1
            with nullcontext() if sync else self._ddp.no_sync():
                with self._autocast():
                    loss = self._step_forward(x[sl], None if labels is None else labels[sl], lv[sl],
                                              noise[sl]).float()
                    loss = (loss if w is None else loss * w[sl]).mean()
                if (bad := self._fault(k, "loss")) is not None:
                    loss = loss * bad
                # Shards are equal in size, so DDP's gradient average over ranks of these micro-batch means
                # is the gradient of the global-batch mean.
                (loss / t.grad_accum).backward()
            total += loss.detach() / t.grad_accum
        if (bad := self._fault(k, "grad")) is not None:
            g = next(p.grad for p in self.model.parameters() if p.grad is not None)
            g.view(-1)[0] = bad
        loss_value = float(all_reduce_mean(total, self.dist))  # every rank sees a NaN and stops together
        if not math.isfinite(loss_value):
            return self._nonfinite(k, f"loss is {loss_value}", loss_value, levels)
        diag: dict[str, float] = {}
        due = [m for m in self.monitors or [] if m.due(k + 1)]
        for m in due:  # gradient norms before clipping: the oscillation the papers talk about
            diag.update(m.after_backward(self, k + 1))
        max_norm = t.grad_clip if t.grad_clip is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not math.isfinite(grad_norm):  # e.g. an overflow in one parameter's gradient, with a finite loss
            return self._nonfinite(k, f"gradient norm is {grad_norm}", loss_value, levels)
        self.consecutive_skips = 0
        for m in due:
            m.before_step(self, k + 1)
        self.optimizer.step()
        self.ema.update(self.model, k)
        self.step = k + 1
        if self.power_ema is not None:
            self.power_ema.update(self.model, self.step)
        for m in due:
            diag.update(m.after_step(self, self.step))
        return StepResult(loss_value, grad_norm, diag, levels)

    def _fault(self, k: int, where: str) -> float | None:
        """Testing (train.fault_*): the NaN/Inf to inject into the loss or a gradient at step k, or None."""
        t = self.cfg.train
        if t.fault_where == where and k in t.fault_steps:
            return float(t.fault_kind)  # "nan" / "inf"
        if where == "loss" and k == t.fault_nan_at_step:
            return float("nan")
        return None

    def _nonfinite(self, k: int, what: str, loss_value: float, levels: torch.Tensor) -> StepResult:
        """A non-finite loss or gradient at step k: stop (train.nonfinite=stop, or too many in a row), or skip
        the update. A skipped step still advances the step counter, so step k's randomness stays a function
        of (seed, k) and resuming stays exact; the weights, EMAs and optimiser state are left untouched."""
        t = self.cfg.train
        self.optimizer.zero_grad(set_to_none=True)
        kept = f"stopped without saving (last good checkpoint kept in {self.ckpt_dir})"
        if t.nonfinite == "stop":
            raise NonFiniteLossError(
                f"{what} at step {k}; {kept}; lower train.lr, set train.grad_clip, disable train.bf16, "
                "or set train.nonfinite=skip to skip such steps"
            )
        if self.consecutive_skips >= t.max_consecutive_skips:
            raise NonFiniteLossError(
                f"{what} at step {k} after {self.consecutive_skips} skipped steps in a row "
                f"(train.max_consecutive_skips={t.max_consecutive_skips}); {kept}; the run diverged: lower "
                "train.lr or disable train.bf16"
            )
        self.skipped_steps += 1
        self.consecutive_skips += 1
        tqdm.write(f"steadydiff: warning: {what} at step {k}; skipped the update ({self.skipped_steps} skipped, "
                   f"{self.consecutive_skips} in a row, limit train.max_consecutive_skips="
                   f"{t.max_consecutive_skips})", file=sys.stderr)
        self.step = k + 1
        return StepResult(loss_value, float("nan"), {}, levels, skipped=True)

    # ---------------------------------------------------------------------------------------------
    # outputs

    def save(self) -> Path | None:
        """Write a checkpoint (rank 0; returns its path, None on other ranks). Collective under DDP: it also
        checks that every rank holds rank 0's weights, which makes it the barrier after the write."""
        path = None
        if self.dist.is_main:
            state = {"optimizer": self.optimizer.state_dict(), "config": dump_config(self.cfg),
                     "data_position": self.step * self.cfg.train.batch_size,
                     "sample_shape": list(self.dataset.sample_shape), "world_size": self.dist.world_size,
                     "nonfinite": {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive_skips},
                     "log_window": [{"loss": r.loss, "grad_norm": r.grad_norm, "skipped": r.skipped,
                                     "levels": None if r.levels is None else r.levels.cpu()}
                                    for r in self.log_window]}
            if self.power_ema is not None:
                state["power_ema"] = self.power_ema.state_dict()
            path = save_checkpoint(self.ckpt_dir, self.step, self.model.state_dict(),
                                   self.ema.model.state_dict(), state, keep=self.cfg.train.keep_ckpts)
        check_replicas_in_sync(self.model, self.dist, self.device)
        self._last_saved = self.step
        return path

    def flop_report(self) -> dict[str, float]:
        """{"flops_per_step": training FLOPs of one step at the global batch (0 when the model cannot be
        counted), "peak_flops": peak FLOP/s of all processes together}; computed once.

        The peak is train.peak_flops x processes, or else each rank's measured matmul rate summed over
        ranks (measured concurrently, so processes sharing one CPU share its peak).
        """
        if self._flops is None:
            t = self.cfg.train
            flops = 0
            if self.dist.is_main:  # only rank 0 reports it
                try:
                    flops = count_train_flops(self.model, self.diffusion, self.cfg, self.dataset.sample_shape)
                except RuntimeError as e:
                    warnings.warn(f"no FLOP count, so no MFU in the log: {e}", stacklevel=2)
            if t.peak_flops:
                peak = t.peak_flops * self.dist.world_size
            else:
                dtype = torch.bfloat16 if t.bf16 else torch.float32
                peak = all_reduce_sum(measure_peak_flops(self.device, dtype), self.dist, self.device)
            self._flops = {"flops_per_step": float(flops), "peak_flops": float(peak)}
        return self._flops

    def _tensorboard(self):
        if not self.cfg.diagnostics.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(
                "diagnostics.tensorboard=true needs the tensorboard package: pip install tensorboard "
                "(or set diagnostics.tensorboard=false)"
            ) from e
        return SummaryWriter(str(self.run_dir / "tb"))

    @torch.no_grad()
    def sample(self, n: int, sampler: str, steps: int, seed: int, use_ema: bool = True) -> torch.Tensor:
        model = self.ema.model if use_ema else self.model
        return generate(model, self.diffusion, self.dataset.sample_shape, n, sampler, steps, seed, self.device,
                        self.cfg.model.num_classes, clip=self.cfg.train.sample_clip)

    def evaluate(self) -> dict[str, float]:
        """Quick eval of the EMA weights (train.eval_metrics on train.eval_n samples), keys `eval/<metric>`.
        Collective under DDP: every rank draws its share of the samples; rank 0 gets the metrics, others {}."""
        from ..metrics.evaluate import evaluate

        t = self.cfg.train
        res = evaluate(self.ema.model, self.diffusion, self.cfg, self.dataset, t.eval_metrics, t.eval_n,
                       t.sample_sampler, t.sample_steps, seed=t.seed, device=self.device, clip=t.sample_clip,
                       batch=t.eval_batch, dist_info=self.dist)
        return {f"eval/{k}": v for k, v in res.items()}

    def _write_samples(self) -> None:
        t = self.cfg.train
        x = self.sample(t.sample_n, t.sample_sampler, t.sample_steps, seed=t.seed)
        ref = self.dataset.data if x.ndim == 2 else None
        save_samples(x, self.run_dir / "samples" / f"step-{self.step:07d}.png", reference=ref)

    def fit(self) -> dict[str, Any]:
        """Train to train.steps. Under DDP every rank calls it; rank 0 writes the outputs."""
        t, main = self.cfg.train, self.dist.is_main
        log_path = self.run_dir / "metrics.jsonl"
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / "config.yaml", dump_config(self.cfg))
            self._truncate_metrics()
        fl = self.flop_report()
        window = self.log_window
        bar = tqdm(total=t.steps, initial=self.step, desc="train", disable=not (self.show_progress and main),
                   dynamic_ncols=True)
        # Monitors only on rank 0: after DDP's all-reduce its gradients and weights are everyone's.
        self.monitors = self._build_monitors() if main else []
        tb = self._tensorboard() if main else None
        with open(log_path, "a") if main else _NullLog() as log:
            if fl["flops_per_step"] and self.step == 0:  # once per run: a resumed run keeps its record
                log.write(json.dumps({"step": self.step, "flops_per_step": fl["flops_per_step"],
                                      "peak_flops": fl["peak_flops"], "world_size": self.dist.world_size}) + "\n")
            t0, n_img = time.perf_counter(), 0
            while self.step < t.steps:
                res = self.train_step()
                window.append(res)
                if res.diagnostics:
                    log.write(json.dumps({"step": self.step, **res.diagnostics}) + "\n")
                    if tb is not None:
                        for key, v in res.diagnostics.items():
                            tb.add_scalar(key, v, self.step)
                n_img += t.batch_size
                bar.update(1)
                if self.step % t.log_every == 0 or self.step == t.steps:
                    dt = time.perf_counter() - t0
                    good = [r for r in window if not r.skipped]  # skipped steps have no finite loss to average
                    rec = {
                        "step": self.step,
                        "loss": sum(r.loss for r in good) / len(good) if good else None,
                        "grad_norm": sum(r.grad_norm for r in good) / len(good) if good else None,
                        "lr": self.optimizer.param_groups[0]["lr"],
                        "beta1": self.optimizer.param_groups[0]["betas"][0],
                        "level_hist": level_histogram([r.levels for r in good if r.levels is not None]),
                        "images_per_sec": n_img / dt if dt > 0 else float("nan"),
                    }
                    if fl["flops_per_step"] and dt > 0:  # achieved FLOP/s over the peak of all processes
                        rec["mfu"] = fl["flops_per_step"] * (n_img // t.batch_size) / dt / fl["peak_flops"]
                    if t.nonfinite == "skip":
                        rec["skipped_steps"] = self.skipped_steps
                    scaling = getattr(self.model, "skip_scaling", None)
                    if scaling is not None:
                        rec["skip_coeffs"] = [round(c, 6) for c in scaling.coefficients()]
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    if tb is not None:
                        for key in ("loss", "grad_norm", "lr", "images_per_sec"):
                            if rec[key] is not None:  # None: every step of the window was skipped
                                tb.add_scalar(f"train/{key}", rec[key], self.step)
                    bar.set_postfix(loss="skipped" if rec["loss"] is None else f"{rec['loss']:.4f}")
                    window.clear()
                    t0, n_img = time.perf_counter(), 0
                if self.power_ema is not None and self.step % (t.phema_snapshot_every or t.ckpt_every) == 0:
                    # rank 0 only (the other ranks hold no power EMA)
                    sd = self.model.state_dict()  # persistent buffers only: what load_state_dict expects
                    buffers = {k: b for k, b in self.model.named_buffers() if k in sd}
                    self.power_ema.snapshot(self.run_dir / "phema", self.step, buffers)
                if self.step % t.ckpt_every == 0 or self.step == t.steps:
                    # Log lines up to this step must be on disk before the checkpoint that makes them final:
                    # a resume from it never rewrites them.
                    log.flush()
                    if main:
                        os.fsync(log.fileno())
                    self.save()  # every rank: it ends with a barrier
                    if main:
                        plot_curves(log_path, self.run_dir / "curves.png")
                if main and t.sample_every and self.step % t.sample_every == 0 and self.step != t.steps:
                    self._write_samples()
                # Periodic eval, shared by all ranks (each samples its chunks; rank 0 gathers the features and
                # scores them): its samples are those of a single-process run, whatever the number of processes.
                if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                    res = self.evaluate()
                    if main:
                        log.write(json.dumps({"step": self.step, **res}) + "\n")
                        log.flush()
        bar.close()
        if tb is not None:
            tb.close()
        if self._last_saved != self.step:  # decided from state every rank shares: save is collective
            self.save()
        if main:
            self._write_samples()
            plot_curves(log_path, self.run_dir / "curves.png")
        barrier(self.dist)  # nobody leaves (and tears the group down) while rank 0 still writes
        return {"step": self.step, "run_dir": str(self.run_dir)}


class _NullLog:
    """Stands in for metrics.jsonl on ranks other than 0."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def chunk_seed(seed: int, k: int) -> int:
    """Seed of sample chunk k: `seed` itself for the first chunk (so a set of up to one chunk is what a plain
    `torch.Generator().manual_seed(seed)` draws), an independent stream derived from (seed, k) for the rest."""
    if k == 0:
        return seed
    return int(np.random.SeedSequence([seed % 2**64, k]).generate_state(1, dtype=np.uint64)[0] >> 1)


@torch.no_grad()
def generate_chunks(model, formulation, sample_shape, n: int, sampler: str, steps: int, seed: int,
                    device: torch.device | str = "cpu", num_classes: int = 0, batch: int = 256,
                    clip: bool = True, rank: int = 0, world_size: int = 1) -> dict[int, torch.Tensor]:
    """{k: chunk k} for this process's share of `n` samples.

    Chunk k holds samples [k * batch, min(n, (k + 1) * batch)) and draws its prior noise and any sampler
    noise from its own generator (`chunk_seed(seed, k)`), so it is a pure function of (seed, k, batch): any
    process can draw any chunk and the union does not depend on how they were shared out. This process
    draws the chunks with k % world_size == rank. Labels cycle 0..num_classes-1 over the sample index.
    `clip`: for image data (in [-1, 1]) keep the denoised estimate in that range at every step; points
    (toy2d) are never clipped.
    """
    if batch <= 0:
        raise ValueError(f"batch must be > 0, got {batch}")
    model.eval()
    out = {}
    for k in range(rank, math.ceil(n / batch), world_size):
        start = k * batch
        b = min(batch, n - start)
        g = torch.Generator(device=device).manual_seed(chunk_seed(seed, k))
        x_T = torch.randn((b, *sample_shape), generator=g, device=device)
        labels = (torch.arange(start, start + b, device=device) % num_classes) if num_classes else None
        x = formulation.generate(model, x_T, sampler, steps, labels, generator=g,
                                 clip=clip and len(sample_shape) == 3)
        out[k] = x.float().cpu()
    return out


def merge_chunks(shards: list[dict[int, torch.Tensor]]) -> torch.Tensor:
    """The chunks {k: tensor} held by the ranks, concatenated in chunk order (each k exactly once)."""
    chunks = {}
    for shard in shards:
        for k, v in shard.items():
            if k in chunks:
                raise ValueError(f"chunk {k} was drawn by two processes")
            chunks[k] = v
    if sorted(chunks) != list(range(len(chunks))):
        raise ValueError(f"chunks {sorted(chunks)} are not 0..{len(chunks) - 1}")
    return torch.cat([chunks[k] for k in range(len(chunks))])


def generate(model, formulation, sample_shape, n: int, sampler: str, steps: int, seed: int,
             device: torch.device | str = "cpu", num_classes: int = 0, batch: int = 256,
             clip: bool = True) -> torch.Tensor:
    """Draw `n` samples with one of the formulation's samplers, in chunks of `batch` (see `generate_chunks`);
    a pure function of (seed, batch)."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    chunks = generate_chunks(model, formulation, sample_shape, n, sampler, steps, seed, device, num_classes,
                             batch, clip)
    return merge_chunks([chunks])


def load_run_model(run: str | Path, use_ema: bool = True):
    """(config, trained module with weights loaded, formulation, checkpoint) of a run directory, or of a
    directory holding `config.yaml` and `model.safetensors` (e.g. `steadydiff phema` output)."""
    from .checkpoint import find_weights

    run = Path(run)
    cfg_file = run / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"{run} is not a steadydiff run directory (no config.yaml); pass the --out of a train run")
    cfg = config_from_dict(yaml.safe_load(cfg_file.read_text()))
    ckpt = read_checkpoint(find_weights(run))
    formulation = build_formulation(cfg.diffusion)
    shape = tuple(int(s) for s in ckpt.state["sample_shape"])
    model = formulation.wrap(build_model(cfg.model, shape))
    model.load_state_dict(ckpt.ema if use_ema and ckpt.ema is not None else ckpt.model)
    return cfg, model.eval(), formulation, ckpt


def _parse_line(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl record, or None for a line torn by a crash mid-write."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def plot_curves(metrics_path: Path, out_path: Path) -> None:
    """Loss, gradient norm and learning rate against step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [_parse_line(ln) for ln in Path(metrics_path).read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if r is not None and r.get("loss") is not None]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2), dpi=100)
    for ax, key, log in zip(axes, ("loss", "grad_norm", "lr"), (True, True, False)):
        ax.plot(steps, [r[key] for r in rows], lw=1)
        ax.set_title(key)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(out_path, lambda p: fig.savefig(p, format="png"))
    plt.close(fig)
