"""ScaleLong skip scaling: coefficients, order, identity of `org`, LS gates."""

import math

import pytest
import torch

from steadydiff.config import ModelConfig
from steadydiff.nn import MLPUNet, UNet, build_model, cs_coefficients, make_skip_scaling

SMALL_UNET = dict(channels=16, channel_mult=[1, 2], num_res_blocks=1, attn_resolutions=[4], num_heads=2)


def small_unet(**kw):
    return UNet(in_channels=1, resolution=8, **{**SMALL_UNET, **kw})


@pytest.mark.parametrize("n", [3, 4, 6])
@pytest.mark.parametrize("kappa", [0.5, 0.7, 0.9])
def test_cs_coefficients_exact_and_ordered(n, kappa):
    coeffs = make_skip_scaling("cs", [8] * n, kappa=kappa).coefficients()
    # LSC i = 1..N (outermost first) gets kappa^(i-1): outermost 1, innermost kappa^(N-1).
    assert coeffs == [kappa ** (i - 1) for i in range(1, n + 1)]
    assert coeffs[0] == 1.0 and coeffs[-1] == kappa ** (n - 1)
    assert all(a > b for a, b in zip(coeffs, coeffs[1:]))
    # The bound the theory relies on: sum kappa_i^2 <= 1 / (1 - kappa^2) whatever N.
    assert sum(c * c for c in coeffs) <= 1 / (1 - kappa**2)


def test_cs_matches_official_uvit_indexing():
    # Official U-ViT: out-block layer_cnt = 0 (first after the middle block, innermost skip) gets
    # kappa ** (outdepth - 1 - layer_cnt). Map layer_cnt -> our outermost-first index N - 1 - layer_cnt.
    n, kappa = 6, 0.5
    ours = cs_coefficients(n, kappa)
    for layer_cnt in range(n):
        assert ours[n - 1 - layer_cnt] == kappa ** (n - 1 - layer_cnt)


def _record_skip_inputs(model):
    """Hook the scaling object: returns {skip index: (unscaled, scaled)} after a forward."""
    seen = {}
    scaling = model.skip_scaling
    orig = scaling.forward

    def wrapped(i, skip):
        out = orig(i, skip)
        seen[i] = (skip.detach().clone(), out.detach().clone())
        return out

    scaling.forward = wrapped
    return seen


@pytest.mark.parametrize("backbone", ["unet", "mlp_unet"])
def test_cs_applied_to_the_right_skip_in_the_backbone(backbone):
    torch.manual_seed(0)
    if backbone == "unet":
        model = build_model(ModelConfig(skip_scaling="cs", kappa=0.7, **SMALL_UNET), (1, 8, 8))
        x = torch.randn(2, 1, 8, 8)
    else:
        model = build_model(ModelConfig(backbone="mlp_unet", skip_scaling="cs", kappa=0.7, hidden=16, depth=8), (2,))
        x = torch.randn(2, 2)
    seen = _record_skip_inputs(model)
    model(x, torch.tensor([10.0, 500.0]))
    n = model.num_skips
    assert sorted(seen) == list(range(n))
    for i, (raw, scaled) in seen.items():
        torch.testing.assert_close(scaled, raw * 0.7**i, rtol=0, atol=1e-7)
    # Skip 0 is the outermost: the encoder's first output (conv_in / first block), full resolution.
    if backbone == "unet":
        assert seen[0][0].shape[-1] == 8 and seen[n - 1][0].shape[-1] == 4


def test_org_is_bit_identical_to_no_scaling():
    torch.manual_seed(0)
    plain = small_unet()
    scaled = small_unet()
    scaled.load_state_dict(plain.state_dict())
    scaled.skip_scaling = make_skip_scaling("org", scaled.skip_channels)
    # Make the zero-initialised output layers non-zero so the skips actually matter.
    with torch.no_grad():
        for a, b in zip(plain.parameters(), scaled.parameters()):
            noise = torch.randn_like(a) * 0.1
            a.add_(noise)
            b.add_(noise)
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([1.0, 300.0, 999.0])
    assert torch.equal(plain(x, t), scaled(x, t))


def test_inv_sqrt2_scales_every_skip():
    scaling = make_skip_scaling("inv_sqrt2", [4, 4, 8])
    assert scaling.coefficients() == [2**-0.5] * 3
    s = torch.randn(2, 8, 3, 3)
    torch.testing.assert_close(scaling(2, s), s / math.sqrt(2))


def test_scaling_changes_the_output_only_through_skips():
    # With all output layers non-zero, cs and org must differ; at kappa = 1 cs equals org.
    torch.manual_seed(1)
    base = small_unet()
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([5.0, 700.0])
    outs = {}
    for name, kappa in [("org", 0.5), ("cs", 0.5), ("cs", 1.0)]:
        base.skip_scaling = make_skip_scaling(name, base.skip_channels, kappa=kappa)
        outs[(name, kappa)] = base(x, t)
    assert not torch.allclose(outs[("org", 0.5)], outs[("cs", 0.5)])
    assert torch.equal(outs[("org", 0.5)], outs[("cs", 1.0)])


@pytest.mark.parametrize("method", ["ls", "ls_ns"])
def test_ls_gates_shape_range_and_init(method):
    torch.manual_seed(0)
    model = build_model(ModelConfig(skip_scaling=method, **SMALL_UNET), (1, 8, 8))
    seen = _record_skip_inputs(model)
    model(torch.randn(4, 1, 8, 8), torch.rand(4) * 999)
    for raw, scaled in seen.values():
        gate = scaled / raw
        c = raw.shape[1]
        # One gate per (sample, channel), broadcast over H, W.
        per_channel = gate[:, :, :1, :1]
        torch.testing.assert_close(gate, per_channel.expand_as(gate), rtol=1e-5, atol=1e-6)
        assert per_channel.shape == (4, c, 1, 1)
        assert ((gate > 0) & (gate < 1)).all()
        # Default Linear init: second layer weights/bias within +-1/sqrt(hidden) keep sigmoid near 0.5.
        assert abs(gate.mean().item() - 0.5) < 0.1
    coeffs = model.skip_scaling.coefficients()
    assert len(coeffs) == model.num_skips and all(0.4 < c < 0.6 for c in coeffs)


def test_ls_shares_parameters_and_ls_ns_does_not():
    hidden, n = 32, 4
    ls = MLPUNet(hidden=hidden, depth=2 * n)
    ls.skip_scaling = make_skip_scaling("ls", ls.skip_channels)
    ls_ns = MLPUNet(hidden=hidden, depth=2 * n)
    ls_ns.skip_scaling = make_skip_scaling("ls_ns", ls_ns.skip_channels)
    gate_params = hidden * (hidden // 16) + hidden // 16 + (hidden // 16) * hidden + hidden
    assert sum(p.numel() for p in ls.skip_scaling.parameters()) == gate_params
    assert sum(p.numel() for p in ls_ns.skip_scaling.parameters()) == n * gate_params
    assert len({id(ls.skip_scaling.gates[k]) for k in ls.skip_scaling.gate_keys}) == 1
    assert len({id(ls_ns.skip_scaling.gates[k]) for k in ls_ns.skip_scaling.gate_keys}) == n
    # Every skip's gradient reaches the one shared gate: its output bias collects all n contributions.
    x, t = torch.randn(5, 2), torch.rand(5) * 999
    with torch.no_grad():
        ls.out.weight.normal_()
    ls(x, t).sum().backward()
    assert ls.skip_scaling.gates["c32"].fc2.bias.grad.abs().sum() > 0


def test_ls_on_conv_unet_shares_one_gate_per_channel_count():
    unet = small_unet()
    scaling = make_skip_scaling("ls", unet.skip_channels)
    assert set(scaling.gates) == {f"c{c}" for c in unet.skip_channels}
    assert len(scaling.gates) == len(set(unet.skip_channels)) < unet.num_skips


def test_unknown_method_lists_choices():
    with pytest.raises(ValueError, match="org, inv_sqrt2, cs, ls, ls_ns"):
        make_skip_scaling("magic", [4])


def _study(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cs_on_a_uvit_is_org_with_a_per_path_adamw_group():
    """Issue 18 item 4: CS training equals Org training with the skip half of each fusion weight initialised
    kappa_i x smaller and given lr kappa_i lr, wd wd / kappa_i, eps eps / kappa_i (float64: rounding only).
    The control folds the init alone: that is a different trajectory, so the match is not trivial."""
    study = _study("cs_reparam_study")
    kw = dict(steps=6, depth=6, width=32, kappa=0.25, lr=3e-3, batch=8, max_items=64)
    same = study.twin_runs(**kw)
    assert same["coefficients"] == [1.0, 0.25, 0.0625]
    assert same["max_rel_param_diff"] < 1e-10 and same["max_rel_probe_loss_diff"] < 1e-10
    control = study.twin_runs(**kw, fold_lr=False)
    assert control["max_rel_param_diff"] > 1e-3


def test_zero_scaling_removes_every_long_skip_and_nothing_else():
    """The no-long-skip control: every skip reaches its fusion layer as zeros, so the output does not depend on
    what the encoder sends through the skips, while the same parameters and main path remain."""
    torch.manual_seed(2)
    cfg = ModelConfig(backbone="uvit", skip_scaling="zero", embed_dim=32, depth=6, num_heads=2, patch_size=4)
    model = build_model(cfg, (1, 8, 8))
    org = build_model(ModelConfig(**{**cfg.__dict__, "skip_scaling": "org"}), (1, 8, 8))
    assert model.skip_scaling.coefficients() == [0.0] * model.num_skips
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in org.parameters())
    seen = _record_skip_inputs(model)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([10.0, 800.0])
    model(x, t)
    assert all(raw.abs().sum() > 0 and torch.equal(scaled, torch.zeros_like(raw)) for raw, scaled in seen.values())
    # Org with every skip replaced by zeros by hand is the same network.
    org.load_state_dict(model.state_dict())
    org.skip_scaling.forward = lambda i, s: torch.zeros_like(s)
    torch.testing.assert_close(model(x, t), org(x, t), rtol=0, atol=0)
