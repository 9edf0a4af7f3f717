"""ScaleLong: scaling of the long skip connections (LSCs) of a UNet (Huang et al., NeurIPS 2023).

A backbone with N long skips calls its scaling object as `scaling(i, skip)` right before it fuses the skip
into the decoder (concatenation or addition). The scale multiplies the *skip only*, never the main path,
exactly as in the official code (`blk(x, skip * coeff)`).

Indexing: `i = 0` is the OUTERMOST skip (first encoder output -> last decoder input), `i = N - 1` the
innermost. This is the paper's LSC index minus one: paper Fig. 1 numbers LSCs i = 1..N from the outside
in and CS gives LSC i the coefficient kappa^(i-1). The official U-ViT code pops skips in reverse
(first out-block gets the innermost skip, `kappa ** (outdepth - 1 - layer_cnt)`), which is the same
assignment: outermost 1, innermost kappa^(N-1).

Methods (README names of the official `--config.nnet.scalelong` values 0..4):
  org        kappa_i = 1                         (0, "orgin")
  inv_sqrt2  kappa_i = 2^-1/2                    (1, "1/sqrt(2)-CS")
  cs         kappa_i = kappa^(i-1)               (2, "CS"); bounds sum_i kappa_i^2 <= 1/(1-kappa^2)
  ls         kappa_i = zeta(skip_i), one gate    (3, "LS")
  ls_ns      kappa_i = zeta_i(skip_i), per skip  (4, "LS non-share")
  zero       kappa_i = 0                         (not in the paper: the control with no long skips at all; the
                                                  fusion layers stay and receive zeros, so the parameter count
                                                  and the main path are Org's)

Which backbones the coefficient reaches (reports/skip-effect, `diagnostics.skip_effect`): a coefficient only
matters if the block that fuses the skip does not divide it out again.
  uvit       Linear(2D -> D) on cat([x, kappa_i s]): kappa_i passes on (effective scale ~kappa_i, trained).
  edm2       MP-Cat, then convolutions without a norm in front: kappa_i passes on (~kappa_i at init).
  mlp_unet   Linear fusion: kappa_i passes on.
  unet       ADM-style ResBlock starting with GroupNorm(cat([h, kappa_i s])): in every group made only of skip
             channels kappa_i cancels exactly (`UNet.skip_groupnorm_isolation`); it survives only through the
             mixed groups and the 1x1 shortcut convolution. At init (zero-initialised residual convs) the
             shortcut carries everything and kappa_i passes on; after training most of it is undone (a trained
             width-16 UNet turns kappa 0.0625 into an effective 0.70-0.85).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn


class SkipScaling(nn.Module):
    """Base class: `forward(i, skip)` returns the scaled skip; `coefficients()` reports kappa_i."""

    def __init__(self, num_skips: int):
        super().__init__()
        if num_skips < 1:
            raise ValueError(f"num_skips must be >= 1, got {num_skips}")
        self.num_skips = num_skips

    def forward(self, i: int, skip: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def coefficients(self) -> list[float]:
        """Current effective coefficient per skip, outermost first (for logging)."""
        raise NotImplementedError


class ConstantScaling(SkipScaling):
    """Fixed coefficients kappa_i (org, inv_sqrt2, cs)."""

    def __init__(self, coeffs: Sequence[float]):
        super().__init__(len(coeffs))
        # Python floats, not buffers: they carry no gradient and no state-dict entry (as in the official code).
        self.coeffs = [float(c) for c in coeffs]

    def forward(self, i: int, skip: Tensor) -> Tensor:
        c = self.coeffs[i]
        # Org must be bit-identical to an unscaled backbone, so skip the multiply when c == 1.
        return skip if c == 1.0 else skip * c

    def coefficients(self) -> list[float]:
        return list(self.coeffs)

    def extra_repr(self) -> str:
        return "coeffs=[" + ", ".join(f"{c:.4g}" for c in self.coeffs) + "]"


class LongSkips:
    """Mixin for backbones with long skips: they set `skip_channels` (gate width of each skip, outermost
    first) and call `attach_skip_scaling`; the forward pass calls `self.skip_scaling(i, skip)` if set.

    A backbone describes itself to the diagnostics (and to the EDM preconditioner) through
    `decoder_blocks()`: its skip-consuming decoder blocks, outermost first, block i consuming skip i; to
    reports through `describe()`; and to the EDM preconditioner and flow's `FlowModel` through `time_input`, the
    convention of its noise-level input (`diffusion/edm.py` TIME_INPUT_SCALES, `diffusion/flow.py` TIME_INPUTS):
    "vp_time" for an embedding designed for VP's model time 999 t (sinusoidal), "c_noise" for EDM's
    c_noise = ln(sigma) / 4 itself. Adding a backbone
    therefore never means editing the diagnostics, the formulations or the reports.
    """

    skip_channels: list[int]
    time_input: str

    def decoder_blocks(self) -> list[nn.Module]:
        raise NotImplementedError(f"{type(self).__name__} must list its skip-consuming decoder blocks, outermost "
                                  "first, in decoder_blocks()")

    def describe(self) -> dict[str, Any]:
        """{"width": ..., "depth": ...} in the terms a paper states its model's size in (the regime table of
        experiment reports)."""
        raise NotImplementedError(f"{type(self).__name__} must give its width and depth in describe()")

    @property
    def num_skips(self) -> int:
        return len(self.skip_channels)

    def attach_skip_scaling(self, scaling: SkipScaling | None) -> None:
        if scaling is not None and scaling.num_skips != self.num_skips:
            raise ValueError(f"skip scaling built for {scaling.num_skips} skips, {type(self).__name__} has "
                             f"{self.num_skips}")
        self.skip_scaling = scaling


def cs_coefficients(num_skips: int, kappa: float) -> list[float]:
    """CS (ScaleLong Sec. 4): LSC i = 1..N (outermost first) gets kappa^(i-1)."""
    return [kappa**i for i in range(num_skips)]


class ChannelGate(nn.Module):
    """LS calibration gate for a feature map (B, C, *spatial) or vector (B, C).

    Squeeze-and-excitation over channels: mean over the spatial dims, Linear(C, C/r), ReLU, Linear(C/r, C),
    sigmoid. PyTorch's default Linear init (uniform +-1/sqrt(fan_in)) is kept on purpose, as in the official
    code where the gate is built after the model's own init pass: the gate then starts near 0.5 on every
    skip. Returns a gate of shape (B, C, 1, ..., 1).
    """

    def __init__(self, channels: int, reduction: int = 16):
        super().__init__()
        hidden = max(1, channels // reduction)
        self.fc1 = nn.Linear(channels, hidden)
        self.fc2 = nn.Linear(hidden, channels)

    def forward(self, skip: Tensor) -> Tensor:
        pooled = skip.mean(dim=tuple(range(2, skip.ndim))) if skip.ndim > 2 else skip
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(pooled.float())))).to(skip.dtype)
        return gate.view(*gate.shape, *([1] * (skip.ndim - 2)))


class TokenGate(nn.Module):
    """LS calibration gate for token sequences (B, L, D), as in the official U-ViT/ScaleLong code.

    Mean over the embedding dim D (one value per token), Linear(L, L/r), ReLU, Linear(L/r, L), sigmoid:
    one gate per token, broadcast over channels; time and label tokens are gated too. Default init.
    Parameter names `layer1`/`layer2` match the official module so its checkpoints load directly.
    """

    def __init__(self, tokens: int, reduction: int = 16):
        super().__init__()
        self.layer1 = nn.Linear(tokens, max(1, tokens // reduction))
        self.layer2 = nn.Linear(max(1, tokens // reduction), tokens)

    def forward(self, skip: Tensor) -> Tensor:
        gate = torch.sigmoid(self.layer2(torch.relu(self.layer1(skip.float().mean(dim=-1)))))
        return gate.to(skip.dtype).unsqueeze(-1)


class LearnedScaling(SkipScaling):
    """LS: kappa_i = zeta(skip_i) with a tiny learned gate per skip (ls_ns) or shared (ls).

    `gate_keys[i]` names the gate that skip i uses; skips with equal keys share one gate. For `ls` on a
    conv UNet, skips differ in channel count, so one gate is shared per *channel count* (a single gate
    cannot read tensors of different widths); on backbones whose skips all have one shape (U-ViT, the
    MLP-UNet) this is exactly one shared gate as in the paper.
    """

    def __init__(self, gate_keys: Sequence[str], gates: dict[str, nn.Module]):
        super().__init__(len(gate_keys))
        self.gate_keys = list(gate_keys)
        self.gates = nn.ModuleDict(gates)
        self._last_mean: list[Tensor | None] = [None] * self.num_skips

    def forward(self, i: int, skip: Tensor) -> Tensor:
        gate = self.gates[self.gate_keys[i]](skip)
        self._last_mean[i] = gate.detach().mean()
        return skip * gate

    def coefficients(self) -> list[float]:
        """Mean gate per skip on the last batch seen (nan before the first forward)."""
        return [float("nan") if m is None else float(m) for m in self._last_mean]


def make_skip_scaling(
    method: str,
    channels: Sequence[int],
    kappa: float = 0.5,
    reduction: int = 16,
    gate: type[nn.Module] = ChannelGate,
) -> SkipScaling:
    """Build a scaling object for skips with the given gate widths (outermost first).

    `channels[i]` is the width the LS gate of skip i reads: the channel count for `ChannelGate` (conv and
    MLP backbones), the token count for `TokenGate` (U-ViT).
    """
    n = len(channels)
    if method == "org":
        return ConstantScaling([1.0] * n)
    if method == "inv_sqrt2":
        return ConstantScaling([2**-0.5] * n)  # as the official code writes it
    if method == "cs":
        return ConstantScaling(cs_coefficients(n, kappa))
    if method == "zero":
        return ConstantScaling([0.0] * n)
    if method == "ls":
        gates = {f"c{c}": gate(c, reduction) for c in dict.fromkeys(channels)}
        return LearnedScaling([f"c{c}" for c in channels], gates)
    if method == "ls_ns":
        keys = [str(i) for i in range(n)]
        return LearnedScaling(keys, {k: gate(c, reduction) for k, c in zip(keys, channels)})
    raise ValueError(f"unknown skip scaling {method!r}; choose one of {', '.join(SKIP_SCALING_METHODS)}")


SKIP_SCALING_METHODS = ("org", "inv_sqrt2", "cs", "ls", "ls_ns", "zero")
