"""How much of a skip coefficient reaches the network: the effective scale of a long skip's contribution.

ScaleLong multiplies long skip i by kappa_i before the decoder block that consumes it fuses it. Whether that
changes anything depends on the block: a linear fusion (U-ViT's Linear(2D -> D), the MLP-UNet) passes kappa_i
on, but a normalisation over the concatenated features undoes it for every normalisation group made only of
skip channels (the ADM-style UNet's decoder blocks start with GroupNorm(cat[h, kappa_i s])).

`effective_skip_scales` measures this on any backbone that calls `self.skip_scaling(i, s)`: with every other
skip left as it is, skip i is multiplied by 0, kappa_i and 1 in three forward passes, and the output y of the
block that consumes it is captured (the block's other input is the same in all three, since it comes from the
inner decoder blocks, which do not see skip i). The effective scale is

    e_i(kappa_i) = ||y(kappa_i s) - y(0)|| / ||y(s) - y(0)||,

the fraction of the skip's contribution at the block output that survives the scaling: kappa_i for a linear
fusion, ~1 when a normalisation cancels the coefficient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .theory import decoder_blocks


class _ScaleOneSkip(nn.Module):
    """A stand-in skip scaling: skip `index` times `factor`, every other skip unchanged."""

    def __init__(self, index: int, factor: float):
        super().__init__()
        self.index, self.factor = index, factor

    def forward(self, i: int, skip: Tensor) -> Tensor:
        return skip * self.factor if i == self.index else skip


@torch.no_grad()
def effective_skip_scales(model: nn.Module, x: Tensor, t_model: Tensor, coeffs: Sequence[float],
                          labels: Tensor | None = None) -> list[float]:
    """[e_i(coeffs[i]) for each long skip i], outermost first (see the module docstring). `model` is a backbone
    with `decoder_blocks()` and a `skip_scaling` attribute; its own scaling is restored afterwards."""
    blocks = decoder_blocks(model)
    if len(coeffs) != len(blocks):
        raise ValueError(f"{len(coeffs)} coefficients for {len(blocks)} long skips")
    own, was_training = model.skip_scaling, model.training
    model.eval()
    out: list[float] = []
    try:
        for i, (block, c) in enumerate(zip(blocks, coeffs)):
            captured: dict[float, Tensor] = {}
            for factor in (0.0, float(c), 1.0):
                model.skip_scaling = _ScaleOneSkip(i, factor)
                handle = block.register_forward_hook(
                    lambda _m, _a, y, f=factor, c=captured: c.__setitem__(f, (y[0] if isinstance(y, tuple) else y)
                                                                         .double()))
                try:
                    model(x, t_model, labels)
                finally:
                    handle.remove()
            full = (captured[1.0] - captured[0.0]).norm()
            out.append(float((captured[float(c)] - captured[0.0]).norm() / full) if full > 0 else float("nan"))
    finally:
        model.skip_scaling = own
        model.train(was_training)
    return out
