"""Which backbones a skip coefficient actually reaches: the effective-scale measurement against cases with
a known answer, and the UNet's GroupNorm layout against a behavioural check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from steadydiff.diagnostics.skip_effect import effective_skip_scales
from steadydiff.nn import UNet, cs_coefficients
from steadydiff.nn.skip_scaling import LongSkips


class OneSkip(LongSkips, nn.Module):
    """x -> encoder h -> one long skip, fused by `fuse` over cat([h, skip])."""

    def __init__(self, fuse: nn.Module):
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.fuse = fuse
        self.skip_channels = [4]
        self.skip_scaling = None

    def decoder_blocks(self):
        return [self.fuse]

    def forward(self, x, t, labels=None):
        h = self.enc(x)
        s = x if self.skip_scaling is None else self.skip_scaling(0, x)
        return self.fuse(torch.cat([h, s], dim=1))


def test_a_linear_fusion_passes_kappa_on_exactly():
    torch.manual_seed(0)
    model = OneSkip(nn.Linear(8, 4))
    for kappa in (0.5, 0.125):
        assert effective_skip_scales(model, torch.randn(32, 4), torch.zeros(32), [kappa]) == pytest.approx([kappa])


def test_a_norm_over_skip_only_groups_cancels_kappa():
    torch.manual_seed(0)
    model = OneSkip(nn.GroupNorm(2, 8))  # group 0: the 4 main-path channels, group 1: the 4 skip channels
    e = effective_skip_scales(model.eval(), torch.randn(32, 4), torch.zeros(32), [0.25])
    assert e[0] == pytest.approx(1.0, abs=1e-3)  # the coefficient is divided out (up to GroupNorm's eps)
    assert model.skip_scaling is None  # restored


def test_unet_isolation_matches_what_the_norm_does():
    torch.manual_seed(0)
    unet = UNet(in_channels=1, resolution=8, channels=12, channel_mult=[1, 2], num_res_blocks=1,
                attn_resolutions=[], num_heads=1)
    fractions = unet.skip_groupnorm_isolation()
    assert len(fractions) == unet.num_skips and all(0 <= f <= 1 for f in fractions)
    for stage, n_skip, frac in zip(unet.decoder_blocks(), unet.skip_channels, fractions):
        norm = stage[0].norm1
        main = norm.num_channels - n_skip
        a, b = torch.randn(2, norm.num_channels, 4, 4), torch.randn(2, norm.num_channels, 4, 4)
        b[:, main:] = a[:, main:]  # the same skip, another main path
        unaffected = (norm(a)[:, main:] - norm(b)[:, main:]).abs().amax(dim=(0, 2, 3)) < 1e-6
        assert unaffected.float().mean().item() == pytest.approx(frac)  # isolated skip channels ignore h


def test_unet_at_init_passes_kappa_through_its_shortcut_only():
    # conv2 is zero-initialised, so at init a decoder block's output is its 1x1 shortcut of cat([h, s]): linear.
    torch.manual_seed(0)
    unet = UNet(in_channels=1, resolution=8, channels=8, channel_mult=[1, 2], num_res_blocks=1,
                attn_resolutions=[], num_heads=1)
    kappas = cs_coefficients(unet.num_skips, 0.5)
    x, t = torch.randn(4, 1, 8, 8), torch.full((4,), 100.0)
    assert effective_skip_scales(unet, x, t, kappas) == pytest.approx(kappas, rel=1e-6)
    for stage in unet.up:  # once the residual branch is on (as after training), the norm path carries the skip
        nn.init.normal_(stage[0].conv2.weight, std=0.3)
    e = effective_skip_scales(unet, x, t, kappas)
    isolation = unet.skip_groupnorm_isolation()
    assert 0.0 in isolation and 1.0 in isolation[1:]
    for k, v, iso in zip(kappas[1:], e[1:], isolation[1:]):
        if iso == 1.0:  # only skip channels in its norm groups: kappa is divided out
            assert v > 0.9
        elif iso == 0.0:  # every group mixes in main-path channels: kappa mostly survives
            assert v == pytest.approx(k, rel=0.1)
