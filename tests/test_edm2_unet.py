"""EDM2 magnitude-preserving primitives and the config-G U-Net: unit magnitudes, weight normalisation, init."""

import math

import pytest
import torch

from steadydiff.diagnostics.theory import decoder_blocks
from steadydiff.diffusion.edm import EDMPrecond
from steadydiff.nn import edm2_unet, make_skip_scaling
from steadydiff.nn.edm2_unet import EDM2Block, EDM2UNet
from steadydiff.nn.mp import (
    MPAttention,
    MPConv,
    MPFourier,
    mp_cat,
    mp_silu,
    mp_sum,
    normalize,
    pixel_norm,
)

TINY = dict(img_resolution=16, img_channels=3, model_channels=16, channel_mult=(1, 2), num_blocks=1,
            attn_resolutions=(8,), channels_per_head=8)
N_ELEM = 2**20


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(prev)


def rms(x: torch.Tensor) -> float:
    return x.double().square().mean().sqrt().item()


def tiny(**kw) -> EDM2UNet:
    return EDM2UNet(**{**TINY, **kw})


def tiny_inputs(b: int = 4, label_dim: int = 0):
    x = torch.randn(b, 3, 16, 16)
    c_noise = torch.randn(b)
    labels = torch.randint(0, label_dim, (b,)) if label_dim else None
    return x, c_noise, labels


def set_gains(model: EDM2UNet, out_gain: float = 1.0, emb_gain: float | None = None) -> None:
    with torch.no_grad():
        model.out_gain.fill_(out_gain)
        if emb_gain is not None:
            for m in model.modules():
                if isinstance(m, EDM2Block):
                    m.emb_gain.fill_(emb_gain)


# -- MP primitives -------------------------------------------------------------------------------------


def test_normalize_and_pixel_norm_unit_rms():
    x = 3.0 * torch.randn(64, N_ELEM // 64) + 0.5
    per_row = normalize(x).square().mean(dim=1).sqrt()
    assert torch.allclose(per_row, torch.ones(64), rtol=2e-4)  # exact up to eps = 1e-4
    y = pixel_norm(2.5 * torch.randn(16, 64, 32, 32))
    per_pixel = y.square().mean(dim=1).sqrt()
    assert torch.allclose(per_pixel, torch.ones_like(per_pixel), rtol=2e-3)
    # the norm is taken in float32 even for half inputs
    h = normalize((100 * torch.randn(4, 4096)).half())
    assert h.dtype == torch.float16 and abs(rms(h) - 1) < 1e-2


@pytest.mark.parametrize("op", ["silu", "sum0.3", "sum0.5", "cat0.5", "cat0.3"])
def test_fixed_function_ops_unit_rms(op):
    a = torch.randn(N_ELEM)
    if op == "silu":
        out = mp_silu(a)
    elif op.startswith("sum"):
        out = mp_sum(a, torch.randn(N_ELEM), float(op[3:]))
    else:
        t = float(op[3:])
        na, nb = 48, 16  # unequal widths
        a, b = torch.randn(256, na, 8, 8), torch.randn(256, nb, 8, 8)
        out = mp_cat(a, b, dim=1, t=t)
        assert out.shape == (256, na + nb, 8, 8)
        share = out[:, :na].square().sum() / out.square().sum()
        assert abs(share.item() - (1 - t) ** 2 / ((1 - t) ** 2 + t**2)) < 0.01
    assert abs(rms(out) - 1) < 0.01


def test_mp_fourier_unit_rms():
    f = MPFourier(2**14)
    out = f(torch.randn(64))
    assert out.shape == (64, 2**14)
    assert abs(rms(out) - 1) < 0.01
    assert not any(p.requires_grad for p in f.parameters()) and len(list(f.buffers())) == 2


def test_mpconv_unit_rms():
    lin = MPConv(256, 256, ()).eval()
    assert abs(rms(lin(torch.randn(N_ELEM // 256, 256))) - 1) < 0.01
    conv = MPConv(64, 64, (3, 3)).eval()
    y = conv(torch.randn(16, 64, 34, 34))[:, :, 1:-1, 1:-1]  # interior: zero padding shrinks the border
    assert abs(rms(y) - 1) < 0.01
    # any stored weight magnitude gives the same layer (normalisation on use)
    with torch.no_grad():
        conv2 = MPConv(64, 64, (3, 3)).eval()
        conv2.weight.copy_(7.0 * conv.weight)
        x = torch.randn(2, 64, 8, 8)
        assert torch.allclose(conv(x), conv2(x), rtol=2e-4, atol=1e-4)  # equal up to eps = 1e-4


def test_forced_weight_normalisation_train_only():
    eps = 1e-4
    for kernel in [(), (3, 3)]:
        m = MPConv(32, 48, kernel)
        fan_in = 32 * math.prod(kernel)
        x = torch.randn(2, 32) if not kernel else torch.randn(2, 32, 6, 6)
        m.eval()
        w0 = m.weight.detach().clone()
        m(x)
        assert torch.equal(m.weight, w0)  # eval: stored weight untouched
        m.train()
        m(x)
        norms = m.weight.detach().double().flatten(1).norm(dim=1)
        # Eq. 66: row norm sqrt(fan_in). normalize() adds eps = 1e-4 to the RMS, leaving r0 / (r0 + eps).
        r0 = w0.double().flatten(1).norm(dim=1) / math.sqrt(fan_in)
        assert torch.allclose(norms, math.sqrt(fan_in) * r0 / (r0 + eps), rtol=1e-6)
        assert (norms / math.sqrt(fan_in) - 1).abs().max() < 1.5e-4
        # two train-mode forwards before one backward must work (the reset never touches a saved tensor)
        (m(x).sum() + m(x).sum()).backward()
        assert m.weight.grad is not None and torch.isfinite(m.weight.grad).all()


def test_gradient_orthogonal_to_weight():
    m = MPConv(32, 32, (3, 3)).double()
    x = torch.randn(4, 32, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        m.train()(x)  # forced WN: stored weight now has row norm ~ sqrt(fan_in)
    m.eval()
    r = torch.randn(4, 32, 8, 8, dtype=torch.float64)
    (m(x) * r).sum().backward()
    g, w = m.weight.grad, m.weight.detach()
    assert g.norm() > 0
    assert abs((g * w).sum().item()) / (g.norm() * w.norm()).item() < 1e-5  # Eq. 59: tangent-plane gradient


def test_mp_attention_shapes_and_magnitude():
    att = MPAttention(32, channels_per_head=8).eval()
    assert att.num_heads == 4
    x = torch.randn(2, 32, 8, 8)
    y = att(x)
    assert y.shape == x.shape and 0.1 < rms(y) < 2
    with pytest.raises(ValueError):
        MPAttention(30, channels_per_head=8)


# -- EDM2UNet ------------------------------------------------------------------------------------------


def test_edm2_unet_structure():
    model = tiny()
    # skips: input conv, 1 block at 16x16, the down block (keeps 16 channels) and 1 block at 8x8
    assert model.num_skips == 4 and model.skip_channels == [16, 16, 16, 32]
    blocks = decoder_blocks(model)
    assert len(blocks) == 4 and all(b.consumes_skip for b in blocks)
    assert blocks == model.decoder_blocks()
    # block i consumes skip i: its input width is (main path) + skip_channels[i]
    assert [b.in_channels for b in blocks] == [16 + 16, 32 + 16, 32 + 16, 32 + 32]
    assert not any(isinstance(m, (torch.nn.GroupNorm, torch.nn.Linear, torch.nn.Conv2d)) for m in model.modules())
    with pytest.raises(ValueError):
        tiny(skip_scaling=make_skip_scaling("cs", [16, 16, 16], 0.5))


@pytest.mark.parametrize("label_dim", [0, 10])
def test_edm2_unet_output_shape_and_zero_at_init(label_dim):
    model = tiny(label_dim=label_dim)
    x, c_noise, labels = tiny_inputs(label_dim=label_dim)
    for mode in (True, False):
        out = model.train(mode)(x, c_noise, labels)
        assert out.shape == x.shape
        assert torch.equal(out, torch.zeros_like(out))  # out_gain = 0
    if label_dim:
        with pytest.raises(ValueError):
            model(x, c_noise)
        onehot = torch.nn.functional.one_hot(labels, label_dim).float()
        set_gains(model, 1.0, 0.5)
        model.eval()
        assert torch.allclose(model(x, c_noise, labels), model(x, c_noise, onehot))
    # with EDMPrecond: D(x; sigma) = c_skip x exactly at init
    model = tiny(label_dim=label_dim)
    pre = EDMPrecond(model)
    sigma = torch.exp(torch.randn(4))
    d = pre(x, sigma, labels)
    assert torch.equal(d, 0.25 / (sigma**2 + 0.25)[:, None, None, None] * x)


def _record_blocks(model):
    rec: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, inp, out, name=name: rec.__setitem__(name, out.detach()))
               for name, m in model.named_modules() if isinstance(m, EDM2Block)]
    return rec, handles


def test_conditioning_off_at_init():
    model = tiny(label_dim=10).eval()
    x = torch.randn(4, 3, 16, 16)
    rec, handles = _record_blocks(model)
    model(x, torch.full((4,), -1.0), torch.tensor([0, 1, 2, 3]))
    first = dict(rec)
    model(x, torch.full((4,), 0.7), torch.tensor([9, 8, 7, 6]))
    assert len(first) == len(model.enc) + len(model.dec)
    assert all(torch.equal(first[k], rec[k]) for k in first)  # emb_gain = 0: blocks ignore c_noise and labels
    set_gains(model, 0.0, 0.5)
    model(x, torch.full((4,), -1.0), torch.tensor([0, 1, 2, 3]))
    first = dict(rec)
    model(x, torch.full((4,), 0.7), torch.tensor([9, 8, 7, 6]))
    assert not any(torch.equal(first[k], rec[k]) for k in first)
    for h in handles:
        h.remove()


def test_skip_scaling_cs_scales_each_skip(monkeypatch):
    model = tiny().eval()
    model.skip_scaling = make_skip_scaling("cs", model.skip_channels, 0.5)
    raw = []  # encoder outputs = skips, outermost first
    handles = [model.conv_in.register_forward_hook(lambda m, i, o: raw.append(o.detach()))]
    handles += [b.register_forward_hook(lambda m, i, o: raw.append(o.detach())) for b in model.enc]
    seen = []  # skips as they reach MP-Cat, in decoder order (innermost first)

    def recording_cat(a, b, dim=1, t=0.5):
        seen.append(b.detach())
        return mp_cat(a, b, dim=dim, t=t)

    monkeypatch.setattr(edm2_unet, "mp_cat", recording_cat)
    model(*tiny_inputs())
    n = model.num_skips
    assert len(raw) == n and len(seen) == n
    for k, s in enumerate(seen):
        i = n - 1 - k
        assert s.shape[1] == model.skip_channels[i]
        assert torch.equal(s, raw[i] * 0.5**i)
    for h in handles:
        h.remove()


def test_skip_scaling_org_bit_identical():
    model = tiny(label_dim=10).eval()
    set_gains(model, 1.0, 0.3)
    x, c_noise, labels = tiny_inputs(label_dim=10)
    ref = model(x, c_noise, labels)
    assert ref.abs().max() > 0
    model.skip_scaling = make_skip_scaling("org", model.skip_channels)
    assert torch.equal(model(x, c_noise, labels), ref)
    model.skip_scaling = make_skip_scaling("cs", model.skip_channels, 0.5)
    assert not torch.equal(model(x, c_noise, labels), ref)


def test_activation_magnitudes_at_init():
    model = tiny(label_dim=10).eval()
    rec, handles = _record_blocks(model)
    x, c_noise, labels = tiny_inputs(b=8, label_dim=10)
    model(x, c_noise, labels)
    mags = {k: rms(v) for k, v in rec.items()}
    assert len(mags) == len(model.enc) + len(model.dec)
    assert all(0.5 <= m <= 2 for m in mags.values()), mags
    for h in handles:
        h.remove()


def test_backward_reaches_every_parameter():
    model = tiny(label_dim=10).train()
    set_gains(model, 1.0, 0.5)
    x, c_noise, labels = tiny_inputs(label_dim=10)
    model(x, c_noise, labels).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_parameter_counts():
    def count(**kw) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in EDM2UNet(**kw).parameters())

    assert count(**TINY) == sum(p.numel() for p in tiny().parameters())
    # img64-S-like (EDM2 Table 6 lists 280.2 M for img64-s / img512-s)
    n = count(img_resolution=64, img_channels=3, label_dim=1000)
    assert abs(n / 1e6 - 280.2) < 0.5, n
