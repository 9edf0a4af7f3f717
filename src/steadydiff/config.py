"""Run configuration: dataclasses loaded from YAML, with `--set a.b=c` overrides.

One `Config` describes a run completely; `RUN_DIR/config.yaml` holds the resolved copy. Unknown keys and
values outside a field's choices are errors that list what is valid (`ConfigError`, one line).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from .utils.errors import ConfigError
from .utils.registry import registries_for


def resumable(default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A field that may change when a run is resumed: it does not alter the training trajectory (output,
    monitoring and speed settings). Every other field must match the run directory's config."""
    return field(default=default, metadata={"resumable": True}, **kw)


def registered(default: Any = dataclasses.MISSING, *, resumable: bool = False, **kw: Any) -> Any:
    """A field whose value names an entry of a registry (`utils/registry.py`; a list field: each item does)
    that a higher layer owns and fills, e.g. model.backbone -> `nn.BACKBONES`. No list of names is typed
    here: the loaded registries check the value (`check_registered`)."""
    return field(default=default, metadata={"registry": True, "resumable": resumable}, **kw)


def _positive(section: str, **values: float | None) -> None:
    for key, v in values.items():
        if v is not None and v <= 0:
            raise ConfigError(f"{section}.{key}: must be > 0, got {v}")


@dataclass
class DataConfig:
    name: Literal["fashion_mnist", "toy2d", "folder", "store"] = "fashion_mnist"
    split: Literal["train", "test"] = "train"
    resolution: int = 28  # images: side length; must match the dataset (folder data is resized to it)
    root: str | None = None  # folder root, store directory, or a directory holding the Fashion-MNIST idx files
    labels: bool = False  # folder: class labels from sub-folder names
    hflip: bool = False  # random horizontal flip
    toy: Literal["8gaussians", "swissroll", "checkerboard"] = "8gaussians"
    toy_size: int = 20000  # number of toy2d points
    max_items: int | None = None  # use only the first N items (quick runs, tests)
    cache: Literal["none", "ram"] = "none"  # store: read batches from the shards on disk, or load it to RAM
    workers: int = resumable(2)  # threads assembling the next batches ahead of the step (0: in the loop)

    def check(self) -> None:
        _positive("data", resolution=self.resolution, toy_size=self.toy_size)
        if self.max_items is not None and self.max_items < 1:
            raise ConfigError(f"data.max_items: must be >= 1 or null (all items), got {self.max_items}")
        if self.workers < 0:
            raise ConfigError(f"data.workers: must be >= 0 (0 reads batches in the training loop), got {self.workers}")
        if self.name == "folder" and not self.root:
            raise ConfigError("data.root: the folder dataset needs data.root=PATH/TO/IMAGES")
        if self.name == "store" and not self.root:
            raise ConfigError("data.root: the store dataset needs data.root=PATH/TO/STORE (built by "
                              "`steadydiff dataset build`)")


@dataclass
class ModelConfig:
    backbone: str = registered("unet")  # nn.BACKBONES
    skip_scaling: Literal["org", "inv_sqrt2", "cs", "ls", "ls_ns", "zero"] = "org"  # zero: no long skips
    kappa: float = 0.5  # CS: LSC i (1 = outermost) is scaled by kappa**(i-1)
    ls_reduction: int = 16  # LS gate bottleneck ratio r
    channels: int = 64  # unet, edm2: base channel count (EDM2's model_channels)
    channel_mult: list[int] = field(default_factory=lambda: [1, 2, 2])  # unet, edm2: width multiplier per level
    num_res_blocks: int = 2  # unet, edm2 (EDM2's num_blocks): blocks per level
    attn_resolutions: list[int] = field(default_factory=lambda: [7])  # unet, edm2: self-attention at these sides
    num_heads: int = 4  # unet, uvit
    # unet: one GroupNorm group count for every norm (diffusers' `norm_num_groups`, so the run exports to
    # UNet2DModel exactly); null: the per-layer rule gcd(32, channels // 4) of earlier runs (unchanged weights).
    norm_groups: int | None = None
    channels_per_head: int = 64  # edm2: attention heads = channels // channels_per_head
    dropout: float = 0.0  # dropout in the residual blocks (per rank under DDP: equal in distribution)
    num_classes: int = 0  # > 0: class-conditional (label embedding added to the time embedding)
    # Classifier-free guidance training (Ho & Salimans 2022): each label is replaced by the null label with this
    # probability, so one network learns both the conditional and the unconditional denoiser.
    label_dropout: float = 0.0
    hidden: int = 128  # mlp_unet: width
    depth: int = 12  # uvit, mlp_unet: encoder + decoder blocks; depth // 2 long skips (U-ViT's convention)
    embed_dim: int = 512  # uvit: token width D
    patch_size: int = 2  # uvit
    mlp_ratio: float = 4.0  # uvit
    qkv_bias: bool = False  # uvit
    mlp_time_embed: bool = False  # uvit: MLP on the sinusoidal time token
    final_conv: bool = True  # uvit: 3x3 conv after unpatchify
    # Activation checkpointing (every backbone): recompute each block in backward instead of storing its
    # activations; less memory for ~1/3 more compute, same gradients. Off: it only pays when memory binds.
    grad_checkpointing: bool = resumable(False)

    def check(self) -> None:
        _positive("model", channels=self.channels, hidden=self.hidden, embed_dim=self.embed_dim,
                  patch_size=self.patch_size, ls_reduction=self.ls_reduction, num_heads=self.num_heads)
        if not 0 < self.kappa <= 1:
            raise ConfigError(f"model.kappa: must be in (0, 1], got {self.kappa}")
        if self.depth < 2:
            raise ConfigError(f"model.depth: must be >= 2 (depth // 2 long skips), got {self.depth}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")
        if not 0 <= self.label_dropout < 1:
            raise ConfigError(f"model.label_dropout: must be in [0, 1), got {self.label_dropout}")
        if self.label_dropout and self.num_classes <= 0:
            raise ConfigError("model.label_dropout needs a class-conditional model: set model.num_classes "
                              "(and data with labels)")
        if not self.channel_mult:
            raise ConfigError("model.channel_mult: must list at least one level, e.g. [1, 2, 2]")
        if self.norm_groups is not None and self.norm_groups < 1:
            raise ConfigError(f"model.norm_groups: must be >= 1 or null (the per-layer rule), got {self.norm_groups}")


@dataclass
class DiffusionConfig:
    kind: str = registered("vp")  # diffusion.FORMULATIONS
    # vp: continuous VP-SDE (U-ViT/ScaleLong)
    beta_min: float = 0.1
    beta_max: float = 20.0
    t_eps: float = 1e-5  # vp: t ~ U(t_eps, 1); edm, flow: the normalised level s ~ U(t_eps, 1 - t_eps)
    # edm: EDM preconditioning and EDM2 loss (defaults: EDM2's ImageNet-64 RGB setting)
    sigma_data: float = 0.5
    p_mean: float = -0.8  # ln sigma ~ N(p_mean, p_std^2) in training
    p_std: float = 1.6
    sigma_min: float = 0.002  # sampling
    sigma_max: float = 80.0
    rho: float = 7.0
    learn_uncertainty: bool = True  # EDM2's learned u(sigma) loss weighting
    # vp, flow: what the network predicts. null: the formulation's default (vp: eps; flow: velocity). vp: eps | v
    # (v = alpha eps - sigma x0); flow: velocity | eps | x0 (velocity = eps - x0). edm: none (its preconditioner
    # fixes the parameterisation). docs/guides/formulations.md states the conversions.
    prediction: Literal["eps", "v", "velocity", "x0"] | None = None
    # vp: the training loss weighting: none (the plain MSE of the prediction) or min_snr (Hang et al. 2023):
    # per sample min(SNR, min_snr_gamma) / SNR (eps) or / (SNR + 1) (v). The validation loss stays the eps-MSE.
    weighting: Literal["none", "min_snr"] = "none"
    min_snr_gamma: float = 5.0
    # flow: the training time draw, uniform t or logit-normal (SD3: logit t ~ N(t_mean, t_std^2), 0 and 1), then
    # SD3's resolution shift t -> shift t / (1 + (shift - 1) t), which also shifts the sampling grid (1: none).
    t_sampling: Literal["uniform", "logit_normal"] = "uniform"
    t_mean: float = 0.0
    t_std: float = 1.0
    shift: float = 1.0

    def check(self) -> None:
        if (self.sigma_data <= 0 or self.p_std <= 0 or not 0 < self.sigma_min < self.sigma_max
                or self.rho <= 0):
            raise ConfigError("diffusion: need sigma_data > 0, p_std > 0, 0 < sigma_min < sigma_max and rho > 0")
        top = 1 if self.kind == "vp" else 0.5  # edm and flow draw s ~ U(t_eps, 1 - t_eps)
        if not 0 < self.t_eps < top:
            raise ConfigError(f"diffusion.t_eps: must be in (0, {top}) for diffusion.kind={self.kind}, got "
                              f"{self.t_eps}")
        if self.min_snr_gamma <= 0:
            raise ConfigError(f"diffusion.min_snr_gamma: must be > 0 (Hang et al. 2023 use 5), got "
                              f"{self.min_snr_gamma}")
        _positive("diffusion", t_std=self.t_std, shift=self.shift)
        # Options of one formulation set under another are errors, not silently ignored.
        for key, (kinds, default) in KIND_OPTIONS.items():
            if getattr(self, key) != default and self.kind not in kinds:
                raise ConfigError(f"diffusion.{key} applies to diffusion.kind={' or '.join(kinds)}; remove it, or set "
                                  f"diffusion.kind={kinds[0]}")
        choices = PREDICTIONS.get(self.kind, ())
        if self.prediction is not None and self.prediction not in choices:
            fix = (f"choose one of {', '.join(choices)}" if choices else
                   "remove it (the EDM preconditioner fixes what the network predicts)")
            raise ConfigError(f"diffusion.prediction={self.prediction} does not apply to diffusion.kind={self.kind}; "
                              f"{fix}")
        if self.t_sampling != "logit_normal" and (self.t_mean, self.t_std) != (0.0, 1.0):
            raise ConfigError("diffusion.t_mean and diffusion.t_std apply to diffusion.t_sampling=logit_normal; set "
                              "it, or remove them")
        if self.weighting != "min_snr" and self.min_snr_gamma != 5.0:
            raise ConfigError("diffusion.min_snr_gamma applies to diffusion.weighting=min_snr; set it, or remove "
                              "min_snr_gamma")


# The predictions each diffusion.kind offers (null: the first), and the options that apply to some kinds only:
# key -> (the kinds it applies to, its default, which every other kind must keep).
PREDICTIONS = {"vp": ("eps", "v"), "flow": ("velocity", "eps", "x0"), "edm": ()}
KIND_OPTIONS = {"weighting": (("vp",), "none"), "min_snr_gamma": (("vp",), 5.0),
                "t_sampling": (("flow",), "uniform"), "t_mean": (("flow",), 0.0), "t_std": (("flow",), 1.0),
                "shift": (("flow",), 1.0)}


# The supremum of a power-function EMA's relative width sigma_rel = sqrt((g+1) / ((g+2)^2 (g+3))) over
# exponents g >= 0 (EDM2 Eq. 123, attained at g = 0): 1/sqrt(12). `train/phema.py` solves Eq. 126 below it.
SIGMA_REL_MAX = 1.0 / math.sqrt(12.0)


@dataclass
class TrainConfig:
    steps: int = resumable(1000)
    batch_size: int = 64  # the global batch: split across processes under torchrun (and then across grad_accum)
    lr: float = 2e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    warmup_steps: int = 100
    lr_schedule: str = registered("constant")  # train/schedules.py LR_SCHEDULES
    lr_ref_steps: int = 35000  # inv_sqrt: t_ref, the step where the 1/sqrt decay starts (EDM2)
    lr_ramp_end: float = 1.0  # exp_ramp: the LR at the last step (Smith's range test, from train.lr)
    timesteps: str = registered("base")  # train/timesteps.py; base: the formulation's own draw of the level
    clts_mu: float = 0.3  # CLTS Gaussian centre on the normalised noise level (paper's best)
    clts_sigma: float = 0.2  # CLTS Gaussian width: not known from the paper, sweep it
    clts_steps: int | None = None  # CLTS curriculum length K_c (null: train.steps)
    clts_importance: bool = False  # weight losses by base/p_k (keeps the expected loss unchanged)
    momentum: str = registered("constant")  # train/momentum.py MOMENTUM_PRESETS
    momentum_steps: int | None = None  # MDLRC horizon K_m (null: train.steps)
    momentum_beta_end: float = 0.0  # floor of the decayed beta1
    ema_sigma_rels: list[float] = field(default_factory=list)  # power-function EMAs to track, e.g. [0.05, 0.10]
    phema_snapshot_every: int = resumable(0)  # steps between post-hoc EMA snapshots (0: with checkpoints)
    grad_clip: float | None = 1.0  # max global grad norm; null disables
    grad_accum: int = 1  # micro-batches per optimiser step (batch_size is split across them)
    ema_decay: float = 0.999
    ema_warmup: bool = True  # decay_k = min(ema_decay, (1 + k) / (10 + k))
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = resumable("auto")
    bf16: bool = False  # bf16 autocast (CPU AMX or CUDA); parameters and optimiser stay fp32
    log_every: int = resumable(50)
    ckpt_every: int = resumable(500)
    keep_ckpts: int = resumable(2)
    sample_every: int = resumable(0)  # 0: only at the end
    sample_n: int = resumable(64)
    # One of diffusion.kind's samplers (each formulation's SAMPLERS: diffusion/samplers.py, edm.py, flow.py).
    sample_sampler: str = registered("dpmpp2m", resumable=True)
    sample_steps: int = resumable(30)
    sample_clip: bool = resumable(True)  # images: keep the denoised estimate in [-1, 1] while sampling
    eval_every: int = resumable(0)  # steps between quick evals written as eval/<metric> to metrics.jsonl (0: off)
    eval_metrics: list[str] = registered(default_factory=list, resumable=True)  # metrics.METRICS, e.g. [sw]
    eval_n: int = resumable(256)  # samples per periodic eval
    # Samples per sampling chunk (each chunk has its own seed); under torchrun the chunks are shared out.
    eval_batch: int = resumable(256)
    # Network-evaluation budgets: each eval also samples at the most steps of sample_sampler within N evaluations
    # (heun counts 2 per step), written as eval/<metric>@nfe<N>; same seed for every budget. e.g. [10, 20, 50]
    eval_nfe: list[int] = resumable(default_factory=list)  # NFE budgets, e.g. [10, 20, 50]; []: none
    threads: int | None = resumable(None)  # torch intra-op threads; null keeps torch's default
    # Speed switches. All off by default: none has been timed on a GPU yet (benchmarks/gpu_check.py measures
    # them); each leaves the losses equal to the plain step within fp32 round-off (tests/test_perf.py).
    # channels_last: NHWC layout for image batches and conv weights (faster convs on tensor cores).
    channels_last: bool = resumable(False)
    optimizer_impl: Literal["auto", "foreach", "fused", "plain"] = resumable("auto")  # AdamW kernels
    compile: bool = resumable(False)  # torch.compile the training loss; the first steps compile
    peak_flops: float | None = resumable(None)  # per-device peak FLOP/s for the logged MFU; null or 0: measure
    # A NaN/Inf loss or gradient norm: stop (exit 3, last good checkpoint kept) or skip that step's update
    # (no weight, EMA or optimiser change; the step still counts), counted as skipped_steps in metrics.jsonl.
    nonfinite: str = registered("stop", resumable=True)  # train/nonfinite.py NONFINITE_POLICIES
    max_consecutive_skips: int = resumable(10)  # nonfinite=skip: stop when one more step in a row would skip
    # Signals that end training at the next step boundary with a checkpoint of that step, exit status 75
    # (train/preemption.py): what Slurm, submitit and Ctrl-C send. [] leaves the signals' default actions.
    stop_signals: list[str] = resumable(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR2"])

    def check(self) -> None:
        _positive("train", steps=self.steps, batch_size=self.batch_size, grad_accum=self.grad_accum,
                  log_every=self.log_every, ckpt_every=self.ckpt_every, keep_ckpts=self.keep_ckpts,
                  sample_n=self.sample_n, sample_steps=self.sample_steps, lr_ref_steps=self.lr_ref_steps)
        if self.lr <= 0:
            raise ConfigError(f"train.lr: must be > 0, got {self.lr}")
        if not self.lr_ramp_end > 0:
            raise ConfigError(f"train.lr_ramp_end: must be > 0 (the LR at the last step of exp_ramp), got "
                              f"{self.lr_ramp_end}")
        if any(not 0 < s < SIGMA_REL_MAX for s in self.ema_sigma_rels):
            raise ConfigError(f"train.ema_sigma_rels: each must be in (0, {SIGMA_REL_MAX:.4f}) (1/sqrt(12), EDM2 "
                              f"Eq. 123), got {self.ema_sigma_rels}")
        if not 0 < self.clts_sigma or not 0 <= self.clts_mu <= 1:
            raise ConfigError(f"train.clts_mu must be in [0, 1] and train.clts_sigma > 0, got {self.clts_mu}, "
                              f"{self.clts_sigma}")
        for key, v in {"train.clts_steps": self.clts_steps, "train.momentum_steps": self.momentum_steps}.items():
            if v is not None and v <= 0:
                raise ConfigError(f"{key}: must be > 0 or null, got {v}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas: expected two numbers in [0, 1), got {self.betas}")
        if not 0 <= self.momentum_beta_end <= self.betas[0]:
            raise ConfigError(f"train.momentum_beta_end must be in [0, betas[0]], got {self.momentum_beta_end}")
        if self.eval_every < 0 or self.eval_n <= 0 or self.eval_batch <= 0:
            raise ConfigError(f"train.eval_every must be >= 0 and train.eval_n, train.eval_batch > 0, got "
                              f"{self.eval_every}, {self.eval_n}, {self.eval_batch}")
        if self.eval_every and not self.eval_metrics:
            raise ConfigError("train.eval_every > 0 needs train.eval_metrics, e.g. [fd_fmnist] or [sw]")
        if self.eval_nfe:
            if any(n <= 0 for n in self.eval_nfe):
                raise ConfigError(f"train.eval_nfe: expected a list of positive integers (network evaluations per "
                                  f"sample), e.g. [10, 20, 50], got {self.eval_nfe}")
            if not self.eval_every:
                raise ConfigError("train.eval_nfe needs train.eval_every > 0 and train.eval_metrics (it adds budgets "
                                  "to the periodic eval); set them or use eval_nfe: []")
        if self.peak_flops is not None and self.peak_flops < 0:
            raise ConfigError(f"train.peak_flops: must be > 0 (FLOP/s per device) or 0/null to measure, got "
                              f"{self.peak_flops}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"train.grad_clip: must be > 0 or null (no clipping), got {self.grad_clip}")
        for key, v in {"train.weight_decay": self.weight_decay, "train.warmup_steps": self.warmup_steps}.items():
            if v < 0:
                raise ConfigError(f"{key}: must be >= 0, got {v}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"train.threads: must be >= 1 or null (torch's default), got {self.threads}")
        import signal

        bad = [n for n in self.stop_signals if not (n.startswith("SIG") and hasattr(signal.Signals, n))]
        if bad:
            raise ConfigError(f"train.stop_signals: {bad[0]!r} is not a signal of this system; use names like "
                              "SIGTERM, SIGINT, SIGUSR2 (or [] to keep the default actions)")
        if self.max_consecutive_skips < 1:
            raise ConfigError(f"train.max_consecutive_skips: must be >= 1, got {self.max_consecutive_skips}")
        if self.phema_snapshot_every < 0:
            raise ConfigError(f"train.phema_snapshot_every: must be >= 0, got {self.phema_snapshot_every}")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"train.ema_decay: must be in [0, 1), got {self.ema_decay}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"train.batch_size ({self.batch_size}) must be divisible by train.grad_accum "
                              f"({self.grad_accum})")


@dataclass
class DiagnosticsConfig:
    """Monitors the trainer runs (0 = off). Only the cheap per-block gradient norms are on by default."""

    grad_every: int = 1  # per-block gradient norms (grad/...)
    probe_every: int = 0  # probe loss, decoder-feature and skip norms on a fixed batch (probe/...)
    update_every: int = 0  # update-to-weight ratio per block (update/...)
    magnitude_every: int = 0  # activation and weight RMS per block, EDM2 Fig. 3 style (mag/...)
    probe_size: int = 32  # probe batch size
    probe_seed: int = 1234  # the probe batch is drawn from this seed, independent of training
    tensorboard: bool = False  # kept for old configs: the same as `tensorboard` in trackers
    # Experiment trackers mirroring metrics.jsonl on rank 0 (runs/trackers.py TRACKERS: tensorboard, wandb,
    # mlflow), each an optional extra; metrics.jsonl stays the record, a tracker that fails never stops training.
    trackers: list[str] = registered(default_factory=list)
    # How a tracker names the run: W&B project (MLflow experiment when there is no group), group (W&B group,
    # MLflow experiment: `compare` sets the experiment's name), job (W&B job type, MLflow tag `arm`: the arm),
    # name (default: the run directory's name; `compare` sets arm/seed-S).
    tracker_project: str = "steadydiff"
    tracker_group: str | None = None
    tracker_job: str | None = None
    tracker_name: str | None = None
    # Validation loss (val/...): the base-weighted loss of the raw and EMA model on a fixed set of examples
    # (held-out split where the dataset has one), stratified over val_bins equal bins of the noise level.
    val_every: int = 0  # steps between validation evaluations
    val_size: int = 1024  # examples in the fixed validation set (RUN_DIR/val.safetensors)
    val_bins: int = 8  # strata of the normalised noise level s in (0, 1): example j is in bin j % val_bins
    val_seed: int = 4321  # the validation set is drawn from this seed, independent of training
    val_batch: int = 256  # examples per forward pass of the evaluation

    def check(self) -> None:
        for key in ("grad_every", "probe_every", "update_every", "magnitude_every", "val_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"diagnostics.{key}: must be >= 0 (0 disables), got {getattr(self, key)}")
        _positive("diagnostics", probe_size=self.probe_size)
        if self.val_bins < 1:
            raise ConfigError(f"diagnostics.val_bins: must be >= 1, got {self.val_bins}")
        if self.val_size < self.val_bins:
            raise ConfigError(f"diagnostics.val_size: must be >= diagnostics.val_bins ({self.val_bins}) so that "
                              f"every noise-level bin has an example, got {self.val_size}; raise val_size or "
                              "lower val_bins")
        if self.val_batch < 1:
            raise ConfigError(f"diagnostics.val_batch: must be >= 1, got {self.val_batch}")
        twice = sorted({k for k in self.trackers if self.trackers.count(k) > 1})
        if twice:
            raise ConfigError(f"diagnostics.trackers: {twice[0]} is listed twice; list each tracker once")

    def tracker_kinds(self) -> list[str]:
        """The trackers to feed: `trackers`, plus tensorboard when the old `tensorboard: true` asks for it."""
        extra = ["tensorboard"] if self.tensorboard and "tensorboard" not in self.trackers else []
        return [*self.trackers, *extra]


@dataclass
class DebugConfig:
    """Fault injection for tests and soak runs (`train/faults.py`): never needed to train a model."""

    fault_nan_at_step: int | None = None  # make the loss NaN at this (0-based) step
    fault_steps: list[int] = field(default_factory=list)  # inject a fault at these (0-based) steps
    fault_kind: Literal["nan", "inf"] = "nan"  # the value injected at fault_steps
    fault_where: Literal["loss", "grad"] = "loss"  # into the loss, or into one gradient entry

    def check(self) -> None:
        faults = self.fault_steps + ([] if self.fault_nan_at_step is None else [self.fault_nan_at_step])
        if any(k < 0 for k in faults):
            raise ConfigError(f"debug.fault_steps / debug.fault_nan_at_step: steps must be >= 0, got {faults}")


# Keys that moved; a config that still uses the old name works, with one deprecation line.
MOVED_KEYS = {f"train.{k}": f"debug.{k}" for k in ("fault_nan_at_step", "fault_steps", "fault_kind", "fault_where")}


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diagnostics: DiagnosticsConfig = resumable(default_factory=DiagnosticsConfig)  # monitors only
    debug: DebugConfig = resumable(default_factory=DebugConfig)  # fault injection (tests, soak runs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self) -> None:
        """Rules that span sections (each section checks its own fields)."""
        if self.train.channels_last and self.data.name == "toy2d":
            raise ConfigError("train.channels_last applies to image data (4-D batches); set it false for toy2d")


# ---------------------------------------------------------------------------------------------------------
# Validation and coercion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` (after `from __future__` strings are resolved)."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not a valid value; choose one of {', '.join(map(str, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: null is not allowed")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is list:
        (inner,) = get_args(tp)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list like [1, 2], got {value!r}")
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}; valid keys here: {', '.join(where + n for n in names)}"
        )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], key)
        else:
            kwargs[name] = _coerce(data[name], tp, key)
    obj = cls(**kwargs)
    return obj


_warned_moves: set[str] = set()


def _move_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` with every key of MOVED_KEYS under its new name, saying so once per key on stderr."""
    if not isinstance(data, dict):
        return data  # `_build` names what is wrong with it
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for old, new in MOVED_KEYS.items():
        (sec, key), (new_sec, new_key) = old.split("."), new.split(".")
        if not (isinstance(data.get(sec), dict) and key in data[sec]):
            continue
        target = data.setdefault(new_sec, {})
        if not isinstance(target, dict):
            continue  # `_build` names the malformed section
        if new_key in target:
            raise ConfigError(f"{old} and {new} are both set; keep {new} only")
        target[new_key] = data[sec].pop(key)
        if old not in _warned_moves:
            _warned_moves.add(old)
            print(f"steadydiff: warning: config key {old} is deprecated; use {new}", file=sys.stderr)
    return data


def registered_keys() -> list[str]:
    """Dotted keys of the fields whose value names a registry entry (`registered`)."""
    hints = typing.get_type_hints(Config)
    return [f"{sec.name}.{f.name}" for sec in dataclasses.fields(Config) for f in dataclasses.fields(hints[sec.name])
            if f.metadata.get("registry")]


def config_value(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def check_registered(cfg: Config) -> None:
    """Every registered field's value against the registries loaded now (those in scope for this config);
    a key whose registry is not loaded yet is left to its builder, which raises the same error."""
    for key in registered_keys():
        value = config_value(cfg, key)
        for registry in registries_for(key):
            if registry.scope is None or config_value(cfg, registry.scope[0]) == registry.scope[1]:
                for name in value if isinstance(value, list) else [value]:
                    registry.choose(name, key)


def config_from_dict(data: dict[str, Any] | None) -> Config:
    """A validated Config: moved keys renamed, types and choices per field, the names of registry entries, then
    each section's `check()`, then the rules that span sections (`Config.check`)."""
    cfg = _build(Config, _move_keys(data or {}), "")
    check_registered(cfg)
    for section in (cfg.data, cfg.model, cfg.diffusion, cfg.train, cfg.diagnostics, cfg.debug, cfg):
        section.check()
    return cfg


def flatten_dict(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (config keys as `--set` spells them)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resumable_keys() -> set[str]:
    """Dotted keys that may change when a run is resumed: fields marked `resumable`, and every field of a
    section marked so."""
    hints = typing.get_type_hints(Config)
    return {f"{sec.name}.{f.name}" for sec in dataclasses.fields(Config) for f in dataclasses.fields(hints[sec.name])
            if sec.metadata.get("resumable") or f.metadata.get("resumable")}


def config_differences(a: Config, b: Config) -> list[str]:
    """`key: old -> new` for every difference that would change the training trajectory (fields marked
    `resumable` may differ: outputs, monitors, speed switches)."""
    free = resumable_keys()
    fa, fb = flatten_dict(a.to_dict()), flatten_dict(b.to_dict())
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in fa if fa.get(k) != fb.get(k) and k not in free]


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` with a YAML-parsed value (so `1e-4`, `[1,2]`, `true`, `null` work)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.lr=1e-4")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    # YAML reads 1e-4 as a string (no dot); numbers are what people mean.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text}: {part} is not a section")
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path, what: str, example: str) -> Any:
    """A YAML file's contents ({} when empty); a missing or malformed file is a one-line ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} not found; pass an existing YAML file, e.g. {example}")
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p} is not valid YAML ({str(e).splitlines()[0]})") from e


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    data: dict[str, Any] = {} if path is None else read_yaml(path, "config file", "configs/demo.yaml")
    return config_from_dict(apply_overrides(data, overrides or []))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
