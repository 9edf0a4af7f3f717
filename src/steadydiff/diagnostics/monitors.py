"""Training monitors: what ScaleLong and EDM2 claim, measured live.

The trainer calls every monitor around each optimiser step; a monitor returns a dict of namespaced
metrics (`grad/...`, `probe/...`, `update/...`, `mag/...`) that the trainer writes to `metrics.jsonl`
(and TensorBoard when enabled). Monitors never draw from the training RNG streams and run the model in
eval mode without gradients, so training results are unchanged with or without them.

- `GradNormMonitor` (cheap, default every step): global and per-block gradient L2 norms.
- `UpdateRatioMonitor`: per-block ||theta_after - theta_before|| / ||theta_before||.
- `ProbeMonitor`: on a fixed probe batch (x0, t, noise drawn once per run from their own seed and stored in
  `RUN_DIR/probe.safetensors`): the probe loss (sampling noise removed from the loss curve), the norm of
  every decoder block output and every long skip (mean over the batch of the per-sample L2 norm, and the
  RMS = norm / sqrt(numel per sample)), and the skip coefficients (LS: mean gate per skip on the probe).
- `MagnitudeMonitor` (EDM2 Fig. 3 style): RMS of each block's output on the probe batch and RMS of each
  block's weights.
- `ValidationMonitor` (`validation.py`): the base-weighted loss of the raw and EMA model on a fixed,
  noise-level-stratified validation set (held out where the dataset has a second split), `val/...`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..data import fixed_subset, model_labels
from ..utils.io import atomic_write
from .base import Monitor, RunContext  # re-exported: the trainer and subclasses import them from here
from .theory import decoder_blocks
from .validation import ValidationMonitor, ValidationSet


def block_groups(model: nn.Module) -> OrderedDict[str, list[nn.Parameter]]:
    """Parameters grouped by block: children of top-level ModuleLists count as blocks (`down.3`,
    `out_blocks.0`), other top-level children are one block each (`embed`, `mid`, `out`)."""
    groups: OrderedDict[str, list[nn.Parameter]] = OrderedDict()
    # Wrappers (EDM preconditioning, the diffusers adapter) name the child that holds the backbone in
    # `backbone_attr`: its blocks are looked up inside it.
    wrapped = {getattr(model, "backbone_attr", None)} - {None}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        base, root = (1, model.get_submodule(parts[0])) if parts[0] in wrapped and len(parts) > 2 else (0, model)
        top = root.get_submodule(parts[base]) if len(parts) > base + 1 else None
        depth = base + (2 if isinstance(top, nn.ModuleList | nn.ModuleDict) else 1)
        groups.setdefault(".".join(parts[:depth]), []).append(p)
    return groups


def _norm(tensors: list[Tensor]) -> float:
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.detach().float()) for t in tensors])))


class GradNormMonitor(Monitor):
    """Per-block gradient norms after backward, before clipping (`grad/total` equals the logged grad_norm)."""

    _groups: OrderedDict[str, list[nn.Parameter]] | None = None

    def after_backward(self, ctx: RunContext, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        if self._groups is None:  # the grouping never changes: compute it once, not every step
            self._groups = block_groups(ctx.model)
        per_block = []
        for params in self._groups.values():
            grads = [p.grad.detach().float() for p in params if p.grad is not None]
            per_block.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                             if grads else torch.zeros((), device=params[0].device))
        norms = torch.stack(per_block).tolist()  # one device-to-host transfer per step
        out = {f"grad/{key}": v for key, v in zip(self._groups, norms)}
        out["grad/total"] = math.sqrt(sum(v * v for v in norms))
        return out


class UpdateRatioMonitor(Monitor):
    def before_step(self, ctx: RunContext, step: int) -> None:
        self._before = {k: [p.detach().clone() for p in ps] for k, ps in block_groups(ctx.model).items()}

    def after_step(self, ctx: RunContext, step: int) -> dict[str, float]:
        out = {}
        for key, params in block_groups(ctx.model).items():
            before = self._before[key]
            norm = _norm(before)
            if norm > 0:  # undefined for all-zero blocks (zero-initialised output layers at step 0)
                out[f"update/{key}"] = _norm([p.detach() - b for p, b in zip(params, before)]) / norm
        self._before = {}
        return out


class ProbeBatch:
    """A fixed (x0, labels, t, noise), drawn once from its own seed and stored with the run."""

    def __init__(self, x0: Tensor, t: Tensor, noise: Tensor, labels: Tensor | None):
        self.x0, self.t, self.noise, self.labels = x0, t, noise, labels

    @classmethod
    def create(cls, ctx: RunContext, size: int, seed: int) -> ProbeBatch:
        g = torch.Generator().manual_seed(seed)
        x0, labels = fixed_subset(ctx.dataset, size, g)
        labels = model_labels(labels, ctx.cfg.model.num_classes)
        t = ctx.formulation.sample_t(len(x0), generator=g, device="cpu")
        noise = torch.randn(x0.shape, generator=g)
        return cls(x0, t, noise, labels)

    @classmethod
    def load_or_create(cls, path: Path, ctx: RunContext, size: int, seed: int) -> ProbeBatch:
        if path.exists():
            d = load_file(str(path))
            return cls(d["x0"], d["t"], d["noise"], d.get("labels"))
        probe = cls.create(ctx, size, seed)
        tensors = {"x0": probe.x0, "t": probe.t, "noise": probe.noise}
        if probe.labels is not None:
            tensors["labels"] = probe.labels
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda p: save_file(tensors, str(p)))
        return probe

    def to(self, device) -> ProbeBatch:
        lab = None if self.labels is None else self.labels.to(device)
        return ProbeBatch(self.x0.to(device), self.t.to(device), self.noise.to(device), lab)


@torch.no_grad()
def probe_forward(model: nn.Module, sde, probe: ProbeBatch) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """Loss per sample, decoder block outputs and (unscaled) skips on the probe batch, eval mode."""
    was_training = model.training
    model.eval()
    feats: dict[str, Tensor] = {}
    skips: dict[str, Tensor] = {}
    handles = []
    for level, blk in enumerate(decoder_blocks(model)):  # level = the skip index it consumes (0 = outermost)
        handles.append(blk.register_forward_hook(lambda m, a, out, lv=level: feats.__setitem__(f"out{lv}", out)))
    scaling = getattr(model, "skip_scaling", None)
    if scaling is not None:
        orig = scaling.forward

        def recording(i, s):
            skips[f"skip{i}"] = s
            return orig(i, s)

        scaling.forward = recording
    try:
        loss = sde.loss(model, probe.x0, probe.labels, t=probe.t, noise=probe.noise)
    finally:
        for h in handles:
            h.remove()
        if scaling is not None:
            del scaling.forward  # back to the class method
        model.train(was_training)
    return loss, feats, skips


def _norm_stats(prefix: str, tensors: dict[str, Tensor]) -> dict[str, float]:
    out = {}
    for key, x in sorted(tensors.items()):
        flat = x.detach().float().flatten(1)
        norms = flat.norm(dim=1)
        out[f"{prefix}/norm/{key}"] = float(norms.mean())
        out[f"{prefix}/rms/{key}"] = float(norms.mean() / math.sqrt(flat.shape[1]))
    return out


class ProbeMonitor(Monitor):
    def __init__(self, every: int, probe: ProbeBatch):
        super().__init__(every)
        self.probe = probe

    def after_step(self, ctx: RunContext, step: int) -> dict[str, float]:
        loss, feats, skips = probe_forward(ctx.model, ctx.formulation, self.probe)
        out = {"probe/loss": float(loss.mean())}
        out.update(_norm_stats("probe/feat", feats))
        out.update(_norm_stats("probe/skip", skips))
        scaling = getattr(ctx.model, "skip_scaling", None)
        if scaling is not None:
            for i, c in enumerate(scaling.coefficients()):
                out[f"probe/kappa/{i}"] = c
        return out


class MagnitudeMonitor(Monitor):
    def __init__(self, every: int, probe: ProbeBatch):
        super().__init__(every)
        self.probe = probe

    @torch.no_grad()
    def after_step(self, ctx: RunContext, step: int) -> dict[str, float]:
        model = ctx.model
        groups = block_groups(model)
        acts: dict[str, Tensor] = {}
        handles = []
        for key in groups:
            mod = model.get_submodule(key)
            handles.append(mod.register_forward_hook(
                lambda m, a, out, k=key: acts.__setitem__(k, out) if isinstance(out, Tensor) else None))
        was_training = model.training
        model.eval()
        try:
            ctx.formulation.loss(model, self.probe.x0, self.probe.labels, t=self.probe.t, noise=self.probe.noise)
        finally:
            for h in handles:
                h.remove()
            model.train(was_training)
        out = {f"mag/act/{k}": float(v.float().pow(2).mean().sqrt()) for k, v in acts.items()}
        for key, params in groups.items():
            weights = [p for p in params if p.ndim > 1]
            if weights:
                total = sum(p.numel() for p in weights)
                sq = sum(float(p.detach().float().pow(2).sum()) for p in weights)
                out[f"mag/weight/{key}"] = math.sqrt(sq / total)
        return out


def build_monitors(d, ctx: RunContext, run_dir: Path) -> list[Monitor]:
    """The monitors a DiagnosticsConfig `d` turns on (interval 0 = off); the probe batch and the validation
    set are stored in `run_dir/probe.safetensors` and `run_dir/val.safetensors` so that a resumed run
    measures the same examples."""
    monitors: list[Monitor] = [GradNormMonitor(d.grad_every), UpdateRatioMonitor(d.update_every)]
    if d.probe_every or d.magnitude_every:
        probe = ProbeBatch.load_or_create(run_dir / "probe.safetensors", ctx, d.probe_size,
                                          d.probe_seed).to(ctx.device)
        monitors += [ProbeMonitor(d.probe_every, probe), MagnitudeMonitor(d.magnitude_every, probe)]
    if d.val_every:
        val = ValidationSet.load_or_create(run_dir / "val.safetensors", ctx, d.val_size, d.val_bins,
                                           d.val_seed).to(ctx.device)
        monitors.append(ValidationMonitor(d.val_every, val, d.val_batch))
    return [m for m in monitors if m.every > 0]
