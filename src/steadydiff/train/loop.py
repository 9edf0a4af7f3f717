"""The training loop.

The loop knows no method by name: the backbone carries its skip-scaling object, the formulation (VP-SDE or
EDM) computes the loss, the LR schedule, momentum schedule, noise-level sampler, weight averagers and the
non-finite policy are objects. Swapping any of them is a config change, not an edit here.

Reproducibility: every random draw of step k (data order, flips, t, noise, dropout) comes from generators
seeded by (seed, k) and from the data sampler's global position k * batch. The trajectory is therefore a
pure function of (config, weights, optimiser state, k), and resuming from a checkpoint at step k gives
exactly the losses of a run that never stopped.

Distributed data parallel (under torchrun, see `utils/distributed.py`): every rank assembles the whole global
batch and keeps its slice (`train/batch.py`), so the trajectory does not depend on the number of processes.
The checkpoint schema is `train/state.py`'s; what the loop writes besides checkpoints, `train/outputs.py`'s.
"""

from __future__ import annotations

import functools
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from .. import runs
from ..config import Config
from ..data import load_dataset
from ..diagnostics.monitors import Monitor, RunContext, build_monitors
from ..diffusion import build_formulation, check_sampler, steps_for_nfe
from ..nn import build_model
from ..utils import distributed as dist_utils
from ..utils.device import pick_device
from .batch import BatchAssembler, check_global_batch, check_num_classes
from .faults import with_faults
from .flops import flop_report
from .momentum import build_momentum
from .nonfinite import build_nonfinite_policy
from .outputs import log_record, periodic_eval, sample_run, write_sample_grid
from .preemption import StopSignals
from .schedules import build_lr_schedule
from .state import StepResult, TrainState, build_averagers
from .step import TrainLoss, build_optimizer, wrap_loss_module
from .timesteps import build_timesteps


class Trainer:
    """Train `cfg` into `run_dir`, resuming from its latest checkpoint when there is one.

    `model`: train your own backbone instead of `cfg.model` (any module called as `model(x, t, labels)`
    that predicts the formulation's target, e.g. the noise for VP; see
    `steadydiff.nn.diffusers_compat.DiffusersUNetAdapter`). `steadydiff sample` rebuilds models from
    `cfg.model`, so for such runs sample from Python with `generate`.

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
        for nfe in cfg.train.eval_nfe:  # a budget below the sampler's cost of one step fails now, not at the eval
            steps_for_nfe(cfg.diffusion.kind, cfg.train.sample_sampler, nfe)
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
        cfg, t = self.cfg, self.cfg.train
        check_global_batch(t.batch_size, self.dist.world_size, t.grad_accum)
        with dist_utils.local_main_first(self.dist):  # a first run may download the data: once per node
            self.dataset = load_dataset(cfg.data)
        check_num_classes(cfg.model.num_classes, self.dataset)
        torch.manual_seed(t.seed)
        self.diffusion = build_formulation(cfg.diffusion)
        net = model if model is not None else build_model(cfg.model, self.dataset.sample_shape)
        # The trained module: the backbone (VP) or the EDM preconditioner holding it and u(sigma).
        self.model = self.diffusion.wrap(net).to(self.device)
        if t.channels_last:  # conv weights NHWC; batches are made NHWC by the assembler
            self.model = self.model.to(memory_format=torch.channels_last)
        self.lr_schedule = build_lr_schedule(t)
        self.momentum = build_momentum(cfg)  # beta1 and LR factor per step (MDLRC and its controls)
        self.timesteps = build_timesteps(cfg, self.diffusion)  # noise-level sampler (base or CLTS)
        self.batches = BatchAssembler(cfg, self.dataset, self.timesteps, self.dist, self.device)
        self.nonfinite = build_nonfinite_policy(t, self.ckpt_dir)
        self.state = TrainState(self.model, build_optimizer(self.model.parameters(), t, self.device),
                                *build_averagers(self.model, t, self.dist.is_main, self.run_dir), self.nonfinite)
        self.ema, self.power_ema = self.state.ema, self.state.extra_averagers.get("power_ema")
        # The step of the newest checkpoint on disk (None: none yet); the state resumes from it.
        self._last_saved = self.state.resume(self.ckpt_dir, self.run_dir, self.dataset.sample_shape)
        if not dist_utils.same_on_all_ranks(self.step, self.dist, self.device):  # the run directory must be shared
            raise runs.RunDirError(f"the processes found different checkpoints in {self.run_dir} (this one: step "
                                   f"{self.step}); put --out on a file system that every node sees")
        self.monitors: list[Monitor] | None = None  # built in fit(): the probe batch lives in the run dir
        self._flops: dict[str, float] | None = None
        self._step_forward, self._ddp = wrap_loss_module(TrainLoss(self.model, self.diffusion), self.dist,
                                                         self.device, t.compile)
        self._forward_backward = with_faults(self._forward_backward, self.model, cfg.debug)
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if t.bf16 else nullcontext

    # The state a checkpoint holds (train/state.py), read through the trainer for convenience.
    optimizer = property(lambda self: self.state.optimizer)
    log_window = property(lambda self: self.state.log_window)
    step = property(lambda self: self.state.step)

    def close(self) -> None:
        """Stop the loader threads; leave the process group if this trainer created it (`steadydiff train`
        does this at the end)."""
        if hasattr(self, "batches"):  # also called when __init__ failed before building it
            self.batches.close()
        dist_utils.shutdown_distributed(self.dist)

    @property
    def context(self) -> RunContext:
        """What monitors and fixed-set builders see of this run."""
        return RunContext(self.cfg, self.dataset, self.diffusion, self.model, self.ema.model, self.device)

    ckpt_dir = property(lambda self: runs.checkpoint_dir(self.run_dir))
    skipped_steps = property(lambda self: self.nonfinite.skipped_steps)

    # ---------------------------------------------------------------------------------------------
    # one optimiser step

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
        b = self.batches(k)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(k, b.x, b.labels, b.levels, b.noise, b.weights)
        loss_value = float(dist_utils.all_reduce_mean(loss, self.dist))  # every rank sees a NaN and stops together
        if not math.isfinite(loss_value):
            return self._bad_step(k, f"loss is {loss_value}", loss_value, b.all_levels)
        diag: dict[str, float] = {}
        due = [m for m in self.monitors or [] if m.due(k + 1)]
        ctx = self.context if due else None
        for m in due:  # gradient norms before clipping: the oscillation the papers talk about
            diag.update(m.after_backward(ctx, k + 1))
        max_norm = t.grad_clip if t.grad_clip is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not math.isfinite(grad_norm):  # e.g. an overflow in one parameter's gradient, with a finite loss
            return self._bad_step(k, f"gradient norm is {grad_norm}", loss_value, b.all_levels)
        self.nonfinite.good_step()
        for m in due:
            m.before_step(ctx, k + 1)
        self.optimizer.step()
        self.state.step = k + 1
        for averager in self.state.averagers:
            averager.update(self.model, self.step)
        for m in due:
            diag.update(m.after_step(ctx, self.step))
        return StepResult(loss_value, grad_norm, diag, b.all_levels)

    def _bad_step(self, k: int, what: str, loss_value: float, levels: torch.Tensor) -> StepResult:
        """A non-finite loss or gradient at step k: the policy stops the run or skips the update. A skipped
        step still advances the step counter; weights, averagers and optimiser state are left untouched."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.bad_step(k, what)
        self.state.step = k + 1
        return StepResult(loss_value, float("nan"), {}, levels, skipped=True)

    # ---------------------------------------------------------------------------------------------
    # outputs

    def save(self) -> Path | None:
        """Write a checkpoint (rank 0; returns its path, None on other ranks). Collective under DDP: it also
        checks that every rank holds rank 0's weights, which makes it the barrier after the write."""
        path = None
        if self.dist.is_main:
            path = self.state.save(self.ckpt_dir, self.cfg, self.dataset.sample_shape, self.dist.world_size)
        dist_utils.check_replicas_in_sync(self.model, self.dist, self.device)
        self._last_saved = self.step
        return path

    def flop_report(self) -> dict[str, float]:
        """FLOPs per step and the peak FLOP/s of all processes (see `train.flops.flop_report`); once."""
        if self._flops is None:
            self._flops = flop_report(self.model, self.diffusion, self.cfg, self.dataset.sample_shape, self.dist,
                                      self.device)
        return self._flops

    def sample(self, n: int, sampler: str, steps: int, seed: int, use_ema: bool = True) -> torch.Tensor:
        return sample_run(self.context, n, sampler, steps, seed, use_ema, decode=self.decoder)

    @functools.cached_property
    def decoder(self):
        """Latent stores: latents -> images with the store's VAE (loaded on first use); None for image data."""
        from ..diffusion.latent import latent_decoder

        return latent_decoder(self.cfg.data, device=self.device)

    def evaluate(self) -> dict[str, float]:
        """`train.eval_metrics` of the EMA weights (see `outputs.periodic_eval`); collective under DDP."""
        return periodic_eval(self.context, self.dist, self.decoder)

    def _write_samples(self) -> Path:
        t = self.cfg.train
        return write_sample_grid(self.sample(t.sample_n, t.sample_sampler, t.sample_steps, seed=t.seed),
                                 self.run_dir, self.step, self.dataset)

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
        self.monitors = build_monitors(self.cfg.diagnostics, self.context, self.run_dir) if main else []
        # The log (and the run's trackers, `runs/trackers.py`) stays open to the end: the last checkpoint's curves
        # and the final samples go to the trackers too.
        with runs.MetricsLog.for_run(self.run_dir, self.cfg, enabled=main) as log:
            with StopSignals(t.stop_signals) as stops:
                if fl["flops_per_step"] and self.step == 0:  # once per run: a resumed run keeps its record
                    log.write({"step": self.step, "flops_per_step": fl["flops_per_step"],
                               "peak_flops": fl["peak_flops"], "world_size": self.dist.world_size})
                t0, n_img = time.perf_counter(), 0
                while self.step < t.steps:
                    res = self.train_step()
                    self.log_window.append(res)
                    if res.diagnostics:
                        log.write({"step": self.step, **res.diagnostics})
                    n_img += t.batch_size
                    bar.update(1)
                    if self.step % t.log_every == 0 or self.step == t.steps:
                        rec = log_record(self.step, self.log_window, self.optimizer, self.flop_report(), n_img,
                                         time.perf_counter() - t0, t.batch_size, self.nonfinite, self.model)
                        log.write(rec)
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
                            log.log_image(self.step, "curves", self.run_dir / "curves.png")
                    if main and t.sample_every and self.step % t.sample_every == 0 and self.step != t.steps:
                        log.log_image(self.step, "samples", self._write_samples())
                    # Periodic eval, shared by all ranks (each samples its chunks; rank 0 gathers the features and
                    # scores them): its samples are those of a single-process run, whatever the number of processes.
                    if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                        log.write({"step": self.step, **self.evaluate()})
                        log.flush()
                    if self.step < t.steps and stops.requested(self.dist, self.device):  # train/preemption.py
                        log.sync()
                        self.save()  # every rank; the window of unlogged steps goes into it
                        log.interrupted()
                        raise stops.interrupted(self.step)
            bar.close()
            self.batches.close()  # nothing more to read ahead
            if self._last_saved != self.step:  # decided from state every rank shares: save is collective
                self.save()
            if main:
                log.log_image(self.step, "samples", self._write_samples())
                runs.plot_curves(self.run_dir)
                log.log_image(self.step, "curves", self.run_dir / "curves.png")
        dist_utils.barrier(self.dist)  # nobody leaves (and tears the group down) while rank 0 still writes
        return {"step": self.step, "run_dir": str(self.run_dir)}
