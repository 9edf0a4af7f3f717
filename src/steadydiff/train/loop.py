"""The training loop.

The loop knows no method by name: the backbone carries its skip-scaling object, the formulation (VP-SDE or
EDM) computes the loss, the LR schedule, momentum schedule, noise-level sampler, weight averagers and the
non-finite policy are objects. Swapping any of them is a config change, not an edit here.

Reproducibility: every random draw of step k (data order, flips, t, noise, dropout) comes from generators
seeded by (seed, k) and from the data sampler's global position k * batch. The trajectory is therefore a
pure function of (config, weights, optimiser state, k), and resuming from a checkpoint at step k gives
exactly the losses of a run that never stopped.

Distributed data parallel (under torchrun, see `utils/distributed.py`): `train.batch_size` is the global
batch. Every rank draws the whole global batch (indices, flips, noise levels, noise) from the same (seed, k)
generators and keeps its contiguous slice, so the trajectory is the same for any number of processes up to
the order of floating-point reductions, and a checkpoint resumes under any number of processes. Only
dropout draws per rank (seeded by (seed, k, rank)): with model.dropout > 0 runs on different numbers of
processes are equal in distribution, not bit for bit.
"""

from __future__ import annotations

import functools
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from .. import runs
from ..config import Config, ConfigError, dump_config
from ..data import InfiniteSampler, Prefetcher, get_batch, load_dataset
from ..diagnostics.monitors import Monitor, build_monitors
from ..diffusion import build_formulation, check_sampler, generate
from ..nn import NULL_LABEL, build_model
from ..utils import distributed as dist_utils
from ..utils.device import pick_device
from ..utils.images import save_samples
from ..utils.rng import draw_normal, draw_uniform, step_generator
from .batch import check_global_batch, rank_slice
from .ema import EMA
from .faults import with_faults
from .flops import flop_report
from .momentum import build_momentum
from .nonfinite import build_nonfinite_policy
from .phema import PowerEMA
from .schedules import build_lr_schedule
from .step import TrainLoss, build_optimizer, wrap_loss_module
from .timesteps import build_timesteps, level_histogram


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
        check_sampler(cfg.diffusion.kind, cfg.train.sample_sampler, "train.sample_sampler")
        runs.check_run_dir(self.run_dir, cfg)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.dist, self.device = dist_utils.init_distributed(pick_device(cfg.train.device))
        try:
            self._setup(model)
        except BaseException:
            self.close()
            raise

    def _setup(self, model: nn.Module | None) -> None:
        cfg, t, world = self.cfg, self.cfg.train, self.dist.world_size
        check_global_batch(t.batch_size, world, t.grad_accum)
        with dist_utils.local_main_first(self.dist):  # a first run may download the data: once per node
            self.dataset = load_dataset(cfg.data)
        self.sampler = InfiniteSampler(len(self.dataset), seed=t.seed)
        self.loader = Prefetcher(self._read_batch, cfg.data.workers)
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
        if t.channels_last:  # conv weights NHWC; batches are made NHWC in _batch
            self.model = self.model.to(memory_format=torch.channels_last)
        self.lr_schedule = build_lr_schedule(t)
        self.momentum = build_momentum(cfg)  # beta1 and LR factor per step (MDLRC and its controls)
        self.timesteps = build_timesteps(cfg, self.diffusion)  # noise-level sampler (base or CLTS)
        self.optimizer = build_optimizer(self.model.parameters(), t, self.device)
        # Every rank keeps the EMA (identical everywhere), so any rank could sample; only rank 0's is saved.
        self.ema = EMA(self.model, t.ema_decay, t.ema_warmup)
        # EDM2 power-function EMAs (post-hoc EMA): parameter averages only. Only rank 0 writes their
        # snapshots, so only rank 0 holds them (they cost a model copy per sigma_rel).
        self.power_ema = None
        if t.ema_sigma_rels and self.dist.is_main:
            self.power_ema = PowerEMA(self.model, t.ema_sigma_rels, snapshot_dir=self.run_dir / "phema",
                                      snapshot_every=t.phema_snapshot_every or t.ckpt_every)
        self.averagers = [a for a in (self.ema, self.power_ema) if a is not None]
        self.nonfinite = build_nonfinite_policy(t, self.ckpt_dir)
        self.step = 0
        self._last_saved: int | None = None  # the step of the newest checkpoint on disk
        self.log_window: list[StepResult] = []  # steps since the last metrics.jsonl record (saved in checkpoints)
        self._resume()
        if not dist_utils.same_on_all_ranks(self.step, self.dist, self.device):  # the run directory must be shared
            raise runs.RunDirError(f"the processes found different checkpoints in {self.run_dir} (this one: step "
                              f"{self.step}); put --out on a file system that every node sees")
        self.monitors: list[Monitor] | None = None  # built in fit(): the probe batch lives in the run dir
        self._flops: dict[str, float] | None = None
        self._step_forward, self._ddp = wrap_loss_module(TrainLoss(self.model, self.diffusion), self.dist,
                                                         self.device, t.compile)
        self._forward_backward = with_faults(self._forward_backward, self.model, t)
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if t.bf16 else nullcontext

    def close(self) -> None:
        """Stop the loader threads; leave the process group if this trainer created it (`steadydiff train`
        does this at the end)."""
        if hasattr(self, "loader"):  # also called when __init__ failed before building it
            self.loader.close()
        dist_utils.shutdown_distributed(self.dist)

    def _build_monitors(self) -> list[Monitor]:
        return build_monitors(self.cfg.diagnostics, self, self.run_dir)

    @property
    def ckpt_dir(self) -> Path:
        return runs.checkpoint_dir(self.run_dir)

    @property
    def skipped_steps(self) -> int:
        return self.nonfinite.skipped_steps

    def _resume(self) -> None:
        ckpt_path = runs.latest_checkpoint(self.ckpt_dir)
        if ckpt_path is None:
            return
        ckpt = runs.read_checkpoint(ckpt_path)
        runs.check_sample_shape(self.run_dir, ckpt.state.get("sample_shape"), self.dataset.sample_shape)
        self.model.load_state_dict(ckpt.model)
        if ckpt.ema is not None:
            self.ema.model.load_state_dict(ckpt.ema)
        if "optimizer" in ckpt.state:  # absent in converted checkpoints: fine-tuning starts a fresh optimiser
            self.optimizer.load_state_dict(ckpt.state["optimizer"])
        if self.power_ema is not None and "power_ema" in ckpt.state:
            self.power_ema.load_state_dict(ckpt.state["power_ema"])
        self.nonfinite.load_state_dict(ckpt.state.get("nonfinite", {}))
        # The steps since the last log record, so a record averaged across the checkpoint matches an
        # uninterrupted run's.
        self.log_window = [StepResult(r["loss"], r["grad_norm"], levels=r["levels"], skipped=r["skipped"])
                           for r in ckpt.state.get("log_window", [])]
        self.step = self._last_saved = ckpt.step

    # ---------------------------------------------------------------------------------------------
    # one optimiser step

    def _batch(self, k: int):
        """Step k's batch: this rank's slice of (x, labels, levels, noise, loss weights), and the global
        batch's levels. The whole global batch is drawn on every rank, in the single-process order (levels,
        then noise), so the step does not depend on the number of processes."""
        t = self.cfg.train
        gen = step_generator(t.seed, k, stream=0, device=self.device)
        x, labels = self.loader.get(k)  # this rank's rows, read ahead by the loader threads
        levels = self.timesteps.sample(t.batch_size, k, gen, self.device)
        weights = self.timesteps.weights(levels, k)
        noise = draw_normal((t.batch_size, *x.shape[1:]), gen, self.device, dtype=x.dtype)
        sl = self._rank_slice()
        x = x.to(self.device, non_blocking=True)
        labels = labels.to(self.device) if (labels is not None and self.cfg.model.num_classes) else None
        p_drop = self.cfg.model.label_dropout
        if labels is not None and p_drop > 0:  # drawn for the whole batch after the noise: p = 0 changes nothing
            drop = draw_uniform((t.batch_size,), gen, self.device)[sl] < p_drop
            labels = torch.where(drop, torch.full_like(labels, NULL_LABEL), labels)
        noise = noise[sl]
        if t.channels_last and x.dim() == 4:
            x, noise = (v.contiguous(memory_format=torch.channels_last) for v in (x, noise))
        return x, labels, levels[sl], noise, None if weights is None else weights[sl], levels

    def _rank_slice(self) -> slice:
        return rank_slice(self.cfg.train.batch_size, self.dist.rank, self.dist.world_size)

    def _read_batch(self, k: int):
        """This rank's rows of step k's global batch (a pure function of (seed, k): safe to read ahead)."""
        t = self.cfg.train
        idx = self.sampler.indices(k * t.batch_size, t.batch_size)
        x, labels = get_batch(self.dataset, idx, self.cfg.data.hflip, step_generator(t.seed, k, stream=1),
                              keep=self._rank_slice())
        if self.device.type == "cuda":
            x = x.pin_memory()  # so that the copy to the GPU can overlap the step
        return x, labels

    def _forward_backward(self, k: int, x, labels, levels, noise, weights) -> torch.Tensor:
        """Accumulate the gradient of the batch-mean (weighted) loss over train.grad_accum micro-batches;
        returns the mean loss (detached). Under DDP the all-reduce runs in the last micro-batch's backward."""
        accum = self.cfg.train.grad_accum
        total = torch.zeros((), device=self.device)
        micro = x.shape[0] // accum
        for m in range(accum):
            sl = slice(m * micro, (m + 1) * micro)
            sync = self._ddp is None or m == accum - 1
            with nullcontext() if sync else self._ddp.no_sync():
                with self._autocast():
                    loss = self._step_forward(x[sl], None if labels is None else labels[sl], levels[sl],
                                              noise[sl]).float()
                    loss = (loss if weights is None else loss * weights[sl]).mean()
                # Shards are equal in size, so DDP's gradient average over ranks of these micro-batch means
                # is the gradient of the global-batch mean.
                (loss / accum).backward()
            total += loss.detach() / accum
        return total

    def train_step(self) -> StepResult:
        t, k = self.cfg.train, self.step
        self.model.train()
        lr = t.lr * self.lr_schedule(k) * self.momentum.lr_factor(k)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["betas"] = (self.momentum.beta1(k), t.betas[1])
        # Dropout and any other global-RNG draw. Rank 0 keeps the single-process seed; other ranks get their
        # own stream (the same stream on every rank would repeat one dropout pattern across the shards).
        torch.manual_seed(t.seed * 1_000_003 + k + (self.dist.rank << 40))
        x, labels, levels, noise, weights, all_levels = self._batch(k)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(k, x, labels, levels, noise, weights)
        loss_value = float(dist_utils.all_reduce_mean(loss, self.dist))  # every rank sees a NaN and stops together
        if not math.isfinite(loss_value):
            return self._bad_step(k, f"loss is {loss_value}", loss_value, all_levels)
        diag: dict[str, float] = {}
        due = [m for m in self.monitors or [] if m.due(k + 1)]
        for m in due:  # gradient norms before clipping: the oscillation the papers talk about
            diag.update(m.after_backward(self, k + 1))
        max_norm = t.grad_clip if t.grad_clip is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not math.isfinite(grad_norm):  # e.g. an overflow in one parameter's gradient, with a finite loss
            return self._bad_step(k, f"gradient norm is {grad_norm}", loss_value, all_levels)
        self.nonfinite.good_step()
        for m in due:
            m.before_step(self, k + 1)
        self.optimizer.step()
        self.step = k + 1
        for averager in self.averagers:
            averager.update(self.model, self.step)
        for m in due:
            diag.update(m.after_step(self, self.step))
        return StepResult(loss_value, grad_norm, diag, all_levels)

    def _bad_step(self, k: int, what: str, loss_value: float, levels: torch.Tensor) -> StepResult:
        """A non-finite loss or gradient at step k: the policy stops the run or skips the update. A skipped
        step still advances the step counter; weights, averagers and optimiser state are left untouched."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.bad_step(k, what)
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
                     "nonfinite": self.nonfinite.state_dict(),
                     "log_window": [{"loss": r.loss, "grad_norm": r.grad_norm, "skipped": r.skipped,
                                     "levels": None if r.levels is None else r.levels.cpu()}
                                    for r in self.log_window]}
            if self.power_ema is not None:
                state["power_ema"] = self.power_ema.state_dict()
            path = runs.save_checkpoint(self.ckpt_dir, self.step, self.model.state_dict(),
                                   self.ema.model.state_dict(), state, keep=self.cfg.train.keep_ckpts)
        dist_utils.check_replicas_in_sync(self.model, self.dist, self.device)
        self._last_saved = self.step
        return path

    def flop_report(self) -> dict[str, float]:
        """FLOPs per step and the peak FLOP/s of all processes (see `train.flops.flop_report`); once."""
        if self._flops is None:
            self._flops = flop_report(self.model, self.diffusion, self.cfg, self.dataset.sample_shape, self.dist,
                                      self.device)
        return self._flops

    @torch.no_grad()
    def sample(self, n: int, sampler: str, steps: int, seed: int, use_ema: bool = True) -> torch.Tensor:
        model = self.ema.model if use_ema else self.model
        return generate(model, self.diffusion, self.dataset.sample_shape, n, sampler, steps, seed, self.device,
                        self.cfg.model.num_classes, clip=self.cfg.train.sample_clip, decode=self.decoder)

    @functools.cached_property
    def decoder(self):
        """Latent stores: latents -> images with the store's VAE (loaded on first use); None for image data."""
        from ..diffusion.latent import latent_decoder

        return latent_decoder(self.cfg.data, device=self.device)

    def evaluate(self) -> dict[str, float]:
        """Quick eval of the EMA weights (train.eval_metrics on train.eval_n samples), keys `eval/<metric>`.
        Collective under DDP: every rank draws its share of the samples; rank 0 gets the metrics, others {}."""
        from ..metrics.evaluate import evaluate

        t = self.cfg.train
        res = evaluate(self.ema.model, self.diffusion, self.cfg, self.dataset, t.eval_metrics, t.eval_n,
                       t.sample_sampler, t.sample_steps, seed=t.seed, device=self.device, clip=t.sample_clip,
                       batch=t.eval_batch, dist_info=self.dist, decode=self.decoder)
        return {f"eval/{k}": v for k, v in res.items()}

    def _write_samples(self) -> None:
        t = self.cfg.train
        x = self.sample(t.sample_n, t.sample_sampler, t.sample_steps, seed=t.seed)
        ref = self.dataset.items_range(0, len(self.dataset)) if x.ndim == 2 else None  # toy points
        save_samples(x, self.run_dir / "samples" / f"step-{self.step:07d}.png", reference=ref)

    def _log_record(self, n_img: int, dt: float) -> dict[str, Any]:
        """The metrics.jsonl record averaging the steps of the log window."""
        fl, good = self.flop_report(), [r for r in self.log_window if not r.skipped]  # skipped: no finite loss
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
            rec["mfu"] = fl["flops_per_step"] * (n_img // self.cfg.train.batch_size) / dt / fl["peak_flops"]
        rec.update(self.nonfinite.log_fields())
        scaling = getattr(self.model, "skip_scaling", None)
        if scaling is not None:
            rec["skip_coeffs"] = [round(c, 6) for c in scaling.coefficients()]
        return rec

    def fit(self) -> dict[str, Any]:
        """Train to train.steps. Under DDP every rank calls it; rank 0 writes the outputs."""
        t, main = self.cfg.train, self.dist.is_main
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            runs.write_config(self.run_dir, self.cfg)
            runs.truncate_after(self.run_dir, self.step)  # a resumed run writes later records again
        fl = self.flop_report()
        bar = tqdm(total=t.steps, initial=self.step, desc="train", disable=not (self.show_progress and main),
                   dynamic_ncols=True)
        # Monitors only on rank 0: after DDP's all-reduce its gradients and weights are everyone's.
        self.monitors = self._build_monitors() if main else []
        with runs.MetricsLog(self.run_dir, enabled=main, tensorboard=self.cfg.diagnostics.tensorboard) as log:
            if fl["flops_per_step"] and self.step == 0:  # once per run: a resumed run keeps its record
                log.write({"step": self.step, "flops_per_step": fl["flops_per_step"],
                           "peak_flops": fl["peak_flops"], "world_size": self.dist.world_size})
            t0, n_img = time.perf_counter(), 0
            while self.step < t.steps:
                res = self.train_step()
                self.log_window.append(res)
                if res.diagnostics:
                    log.write({"step": self.step, **res.diagnostics}, scalars=res.diagnostics)
                n_img += t.batch_size
                bar.update(1)
                if self.step % t.log_every == 0 or self.step == t.steps:
                    rec = self._log_record(n_img, time.perf_counter() - t0)
                    log.write(rec, scalars={f"train/{key}": rec[key] for key in
                                            ("loss", "grad_norm", "lr", "images_per_sec") if rec[key] is not None})
                    log.flush()
                    bar.set_postfix(loss="skipped" if rec["loss"] is None else f"{rec['loss']:.4f}")
                    self.log_window.clear()
                    t0, n_img = time.perf_counter(), 0
                if self.step % t.ckpt_every == 0 or self.step == t.steps:
                    # Log lines up to this step must be on disk before the checkpoint that makes them final:
                    # a resume from it never rewrites them.
                    log.sync()
                    self.save()  # every rank: it ends with a barrier
                    if main:
                        runs.plot_curves(self.run_dir)
                if main and t.sample_every and self.step % t.sample_every == 0 and self.step != t.steps:
                    self._write_samples()
                # Periodic eval, shared by all ranks (each samples its chunks; rank 0 gathers the features and
                # scores them): its samples are those of a single-process run, whatever the number of processes.
                if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                    log.write({"step": self.step, **self.evaluate()})
                    log.flush()
        bar.close()
        self.loader.close()  # nothing more to read ahead
        if self._last_saved != self.step:  # decided from state every rank shares: save is collective
            self.save()
        if main:
            self._write_samples()
            runs.plot_curves(self.run_dir)
        dist_utils.barrier(self.dist)  # nobody leaves (and tears the group down) while rank 0 still writes
        return {"step": self.step, "run_dir": str(self.run_dir)}
