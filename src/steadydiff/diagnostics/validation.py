"""Validation loss: the base-weighted loss of the raw and the EMA model on a fixed, stratified set of examples.

The validation set (`ValidationSet`, stored in `RUN_DIR/val.safetensors` so that a resumed run evaluates the
same examples) is drawn once from its own seed (`diagnostics.val_seed`), never from the training streams:

- x0: the first `val_size` examples of a seeded permutation of the *held-out* split where the dataset has
  one: Fashion-MNIST and toy2d train on one split and validate on the other (`test` for a run that trains
  on `train`, `train` for one that trains on `test`), taken whole (`data.max_items` does not apply).
  `folder` data has no second split: its validation set is a fixed seeded subset of the *training* images,
  so it is NOT held out and its validation loss measures fit, not generalisation.
- s: the normalised noise level in (0, 1) that every formulation takes as `t` (VP: t itself; EDM: the
  quantile of sigma under the training log-normal; flow: the quantile of its time t under its training
  draw), stratified over K = `val_bins` equal bins: example j is in bin k = j % K and has s ~ U[k/K, (k+1)/K),
  clipped into the formulation's range of levels ([t_eps, 1] for VP, [t_eps, 1 - t_eps] for EDM and flow).
- noise ~ N(0, I) and, when the model is class-conditional (`model.num_classes > 0`), the dataset labels.

The loss is the formulation's base weighting (`base_loss`): VP's eps-MSE (whatever its prediction and
weighting), for EDM lambda(sigma) mean((D(x0 + sigma n; sigma) - x0)^2) with lambda(sigma) = (sigma^2 +
sd^2) / (sigma sd)^2 (EDM2 Eq. 21 with u = 0), and flow's velocity MSE (whatever its prediction). Neither a
timestep sampler's weights (CLTS) nor min-SNR weights nor the learned u(sigma) enter it, so runs that train
with different weightings are measured with one yardstick; the three formulations' yardsticks differ, so
validation losses compare runs of one formulation only. Its mean over the bins' examples
is a stratified estimate of E_s[L_base(s)] over s ~ U(0, 1), i.e. of the base training loss under the base
noise-level distribution.

`ValidationMonitor` evaluates it every `diagnostics.val_every` steps on the run's model and its EMA copy
(`RunContext.model`, `RunContext.ema_model`), in eval mode (no dropout) without gradients, in float32 and in chunks of
`diagnostics.val_batch`, and logs `val/loss`, `val/ema_loss` (means over the whole set, accumulated in
float64) and per stratum `val/loss/bin{k}`, `val/ema_loss/bin{k}`. It draws no random numbers and changes
no state the training step uses, so a run's trajectory is bit-identical with and without it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..data import ArrayDataset, fixed_subset, load_dataset, model_labels
from ..utils.errors import ConfigError
from ..utils.io import atomic_write
from .base import Monitor, RunContext

# Datasets with a second split to hold out (the others validate on a subset of the training data).
HELD_OUT_DATASETS = ("fashion_mnist", "toy2d")


def validation_source(cfg, train_dataset: ArrayDataset) -> tuple[ArrayDataset, bool]:
    """(the dataset the validation examples come from, whether it is held out from training).

    Fashion-MNIST and toy2d: the other split, whole. Other data (`folder`): the training dataset itself.
    """
    if cfg.data.name in HELD_OUT_DATASETS:
        other = "test" if cfg.data.split == "train" else "train"
        return load_dataset(dataclasses.replace(cfg.data, split=other, max_items=None)), True
    return train_dataset, False


def level_range(formulation) -> tuple[float, float]:
    """The closed range the formulation's normalised noise levels lie in, as it states it (`level_range()`):
    [t_eps, 1] (VP), [t_eps, 1 - t_eps] (EDM, where Phi^{-1}(s) must stay finite; flow)."""
    lo, hi = formulation.level_range()
    return float(lo), float(hi)


def stratified_levels(bins: Tensor, u: Tensor, num_bins: int, lo: float, hi: float) -> Tensor:
    """s = (bin + u) / K for u in [0, 1), float32, kept below its bin's upper edge after rounding to float32,
    then clipped into [lo, hi]."""
    s64 = (bins.to(torch.float64) + u.to(torch.float64)) / num_bins
    s = s64.to(torch.float32)
    upper = ((bins + 1).to(torch.float64) / num_bins).to(torch.float32)
    s = torch.where(s >= upper, torch.nextafter(upper, torch.zeros_like(upper)), s)
    return s.clamp(lo, hi)


class ValidationSet:
    """A fixed (x0, s, noise, bin, labels) drawn once from its own seed and stored with the run (see the
    module docstring for what it holds and where x0 comes from)."""

    def __init__(self, x0: Tensor, s: Tensor, noise: Tensor, bin: Tensor, labels: Tensor | None, num_bins: int,
                 source: str = "", held_out: bool = True):
        self.x0, self.s, self.noise, self.bin, self.labels = x0, s, noise, bin, labels
        self.num_bins, self.source, self.held_out = num_bins, source, held_out

    def __len__(self) -> int:
        return int(self.x0.shape[0])

    @classmethod
    def create(cls, ctx: RunContext, size: int, num_bins: int, seed: int) -> ValidationSet:
        """Draw the set: permutation of the source, then the in-bin uniforms, then the noise, all from one
        generator seeded with `seed` (never the training RNG)."""
        if not 1 <= num_bins <= size:
            raise ConfigError(f"diagnostics.val_size ({size}) must be >= diagnostics.val_bins ({num_bins}) >= 1")
        ds, held_out = validation_source(ctx.cfg, ctx.dataset)
        if size > len(ds):
            raise ConfigError(f"diagnostics.val_size={size} exceeds the {len(ds)} examples of {ds.name} (the "
                              f"validation source); set diagnostics.val_size <= {len(ds)}")
        g = torch.Generator().manual_seed(seed)
        x0, labels = fixed_subset(ds, size, g)
        labels = model_labels(labels, ctx.cfg.model.num_classes)
        bins = torch.arange(size, dtype=torch.int64) % num_bins
        u = torch.rand(size, generator=g, dtype=torch.float64)
        s = stratified_levels(bins, u, num_bins, *level_range(ctx.formulation))
        noise = torch.randn(x0.shape, generator=g)
        return cls(x0, s, noise, bins, labels, num_bins, ds.name, held_out)

    @classmethod
    def load_or_create(cls, path: Path, ctx: RunContext, size: int, num_bins: int, seed: int) -> ValidationSet:
        """The set stored at `path`, or a new one written there (atomically). A stored set drawn with another
        size, number of bins or seed is an error: a run's validation curve is over one set."""
        path = Path(path)
        if path.exists():
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            want = {"size": str(size), "bins": str(num_bins), "seed": str(seed)}
            have = {k: meta.get(k) for k in want}
            if have != want:
                stored = ", ".join(f"diagnostics.val_{k}={v}" for k, v in have.items())
                raise ConfigError(f"{path} holds a validation set drawn with {stored}; set those values again, "
                                  "or delete the file to draw a new set (earlier val/ records then refer to "
                                  "the old one)")
            d = load_file(str(path))
            return cls(d["x0"], d["s"], d["noise"], d["bin"], d.get("labels"), num_bins, meta.get("source", ""),
                       meta.get("held_out", "true") == "true")
        val = cls.create(ctx, size, num_bins, seed)
        tensors = {"x0": val.x0, "s": val.s, "noise": val.noise, "bin": val.bin}
        if val.labels is not None:
            tensors["labels"] = val.labels
        meta = {"size": str(size), "bins": str(num_bins), "seed": str(seed), "source": val.source,
                "held_out": "true" if val.held_out else "false"}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda p: save_file(tensors, str(p), metadata=meta))
        return val

    def to(self, device) -> ValidationSet:
        """x0, s, noise and labels on `device` (the bin index stays on the CPU, where the means are taken)."""
        lab = None if self.labels is None else self.labels.to(device)
        return ValidationSet(self.x0.to(device), self.s.to(device), self.noise.to(device), self.bin, lab,
                             self.num_bins, self.source, self.held_out)


@torch.no_grad()
def validation_losses(model: nn.Module, formulation, val: ValidationSet, batch: int) -> Tensor:
    """Per-example base loss (float64, CPU, shape (N,)) of `model` on `val`, in eval mode and chunks of `batch`;
    the model's train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        out = []
        for i in range(0, len(val), batch):
            sl = slice(i, i + batch)
            labels = None if val.labels is None else val.labels[sl]
            loss = formulation.base_loss(model, val.x0[sl], labels, val.s[sl], val.noise[sl])
            out.append(loss.detach().to("cpu", torch.float64))
    finally:
        model.train(was_training)
    return torch.cat(out)


def summarize(prefix: str, losses: Tensor, bins: Tensor, num_bins: int) -> dict[str, float]:
    """{prefix: mean over all examples, prefix/bin{k}: mean over bin k's examples}, accumulated in float64."""
    losses = losses.to(torch.float64)
    bins = bins.to(losses.device)
    sums = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, losses)
    counts = torch.bincount(bins, minlength=num_bins).to(torch.float64)
    out = {prefix: float(losses.sum() / losses.numel())}
    for k, v in enumerate((sums / counts).tolist()):
        out[f"{prefix}/bin{k}"] = v
    return out


class ValidationMonitor(Monitor):
    """`val/loss`, `val/ema_loss` and their per-bin means on a `ValidationSet` every `every` steps."""

    def __init__(self, every: int, val: ValidationSet, batch: int = 256):
        super().__init__(every)
        self.val = val
        self.batch = batch

    def after_step(self, ctx: RunContext, step: int) -> dict[str, float]:
        out = {}
        for prefix, model in (("val/loss", ctx.model), ("val/ema_loss", ctx.ema_model)):
            losses = validation_losses(model, ctx.formulation, self.val, self.batch)
            out.update(summarize(prefix, losses, self.val.bin, self.val.num_bins))
        return out
