"""U-ViT: shapes, skip scaling, LS token gates, official-checkpoint conversion."""

import os
import sys
from pathlib import Path

import pytest
import torch

from steadydiff.config import ModelConfig
from steadydiff.nn import UViT, build_model
from steadydiff.nn.convert import infer_uvit_config, load_official_uvit, steadydiff_to_official

TINY = dict(embed_dim=32, depth=6, num_heads=4, mlp_ratio=2.0)


def tiny_cfg(**kw):
    return ModelConfig(backbone="uvit", **{**TINY, **kw})


@pytest.mark.parametrize("patch, res, channels", [(2, 16, 3), (4, 28, 1), (4, 32, 1)])
@pytest.mark.parametrize("num_classes", [0, 10])
def test_shapes(patch, res, channels, num_classes):
    model = build_model(tiny_cfg(patch_size=patch, num_classes=num_classes), (channels, res, res))
    x = torch.randn(2, channels, res, res)
    labels = torch.tensor([1, 7]) if num_classes else None
    assert model(x, torch.tensor([3.0, 900.0]), labels).shape == x.shape
    assert model.num_skips == 3
    assert model.skip_channels == [model.extras + (res // patch) ** 2] * 3


def test_org_is_bit_identical_to_plain_uvit():
    torch.manual_seed(0)
    scaled = build_model(tiny_cfg(skip_scaling="org"), (1, 16, 16))
    plain = UViT(img_size=16, patch_size=2, in_chans=1, **TINY)
    plain.load_state_dict(scaled.state_dict())
    x, t = torch.randn(3, 1, 16, 16), torch.tensor([1.0, 400.0, 999.0])
    assert torch.equal(plain(x, t), scaled(x, t))


def test_cs_scales_the_skips_in_official_order():
    torch.manual_seed(0)
    model = build_model(tiny_cfg(skip_scaling="cs", kappa=0.5, depth=8), (1, 16, 16))
    got = []
    for blk in model.out_blocks:  # execution order: first out-block first
        blk.register_forward_pre_hook(lambda m, args: got.append(args[1].detach().clone()))
    raw = []
    for blk in model.in_blocks:
        blk.register_forward_hook(lambda m, args, out: raw.append(out.detach().clone()))
    model(torch.randn(2, 1, 16, 16), torch.tensor([5.0, 50.0]))
    n = 4
    for layer_cnt, s in enumerate(got):  # official: kappa ** (outdepth - 1 - layer_cnt) on skips.pop()
        torch.testing.assert_close(s, raw[n - 1 - layer_cnt] * 0.5 ** (n - 1 - layer_cnt), rtol=0, atol=1e-7)


@pytest.mark.parametrize("method", ["ls", "ls_ns"])
def test_ls_token_gates(method):
    torch.manual_seed(0)
    model = build_model(tiny_cfg(skip_scaling=method), (1, 16, 16))
    gates = []
    for gate in model.skip_scaling.gates.values():
        gate.register_forward_hook(lambda m, args, out: gates.append(out.detach()))
    model(torch.randn(4, 1, 16, 16), torch.rand(4) * 999)
    assert len(gates) == 3
    tokens = model.skip_channels[0]
    for g in gates:
        assert g.shape == (4, tokens, 1)  # one gate per token, broadcast over channels
        assert ((g > 0) & (g < 1)).all() and abs(g.mean().item() - 0.5) < 0.1
    assert len(model.skip_scaling.gates) == (1 if method == "ls" else 3)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    a = build_model(tiny_cfg(), (1, 16, 16))
    b = build_model(tiny_cfg(grad_checkpointing=True), (1, 16, 16))
    b.load_state_dict(a.state_dict())
    x, t = torch.randn(2, 1, 16, 16), torch.tensor([10.0, 600.0])
    a(x, t).pow(2).sum().backward()
    b(x, t).pow(2).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


@pytest.mark.parametrize("method, extra", [
    ("ls_ns", dict(num_classes=5, qkv_bias=True, mlp_time_embed=True)),
    ("ls", dict(final_conv=False)),
    ("cs", dict(patch_size=4)),
])
def test_converter_round_trip_and_inference(tmp_path, method, extra):
    torch.manual_seed(0)
    cfg = tiny_cfg(skip_scaling=method, kappa=0.7, **extra)
    ours = build_model(cfg, (3, 16, 16))
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    official = steadydiff_to_official(ours.state_dict(), ours.num_skips)
    assert not any(k.startswith("skip_scaling") for k in official)
    if method == "ls_ns":
        # Official non-shared gates are indexed from the innermost skip.
        torch.testing.assert_close(official["se.0.layer1.weight"], ours.skip_scaling.gates["2"].layer1.weight)
    path = tmp_path / "nnet_ema.pth"
    torch.save({"module." + k: v for k, v in official.items()}, path)
    back, back_cfg, shape = load_official_uvit(path, num_heads=4, skip_scaling=method, kappa=0.7)
    assert shape == (3, 16, 16)
    for field in ("embed_dim", "patch_size", "depth", "mlp_ratio", "qkv_bias", "mlp_time_embed", "num_classes",
                  "final_conv", "skip_scaling", "ls_reduction"):
        assert getattr(back_cfg, field) == getattr(cfg, field), field
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([2.0, 700.0])
    labels = torch.tensor([0, 4]) if cfg.num_classes else None
    assert torch.equal(ours(x, t, labels), back(x, t, labels))


def test_converter_rejects_other_state_dicts():
    from steadydiff.nn.convert import ConversionError

    with pytest.raises(ConversionError, match="patch_embed"):
        infer_uvit_config({"foo": torch.zeros(1)}, num_heads=4)


OFFICIAL = os.environ.get("STEADYDIFF_OFFICIAL_UVIT")


@pytest.mark.skipif(not OFFICIAL, reason="oracle test: set STEADYDIFF_OFFICIAL_UVIT to a checkout of "
                    "sail-sg/ScaleLong (with einops importable) to compare against the official U-ViT")
@pytest.mark.parametrize("scalelong, method", [(0, "org"), (1, "inv_sqrt2"), (2, "cs"), (3, "ls"), (4, "ls_ns")])
def test_matches_the_official_uvit(scalelong, method):
    sys.path.insert(0, str(Path(OFFICIAL)))
    from libs.uvit import UViT as OfficialUViT

    torch.manual_seed(0)
    ref = OfficialUViT(img_size=16, patch_size=2, in_chans=3, embed_dim=64, depth=8, num_heads=4,
                       mlp_ratio=4, qkv_bias=False, mlp_time_embed=True, num_classes=10,
                       scalelong=scalelong, kappa=0.6).eval()
    with torch.no_grad():
        for p in ref.parameters():  # leave the init so every branch (zero biases, LS gates) matters
            p.add_(torch.randn_like(p) * 0.02)
    ours, _, _ = load_official_uvit(ref.state_dict(), num_heads=4, skip_scaling=method, kappa=0.6)
    x, t, y = torch.randn(4, 3, 16, 16), torch.tensor([0.5, 10.0, 500.0, 999.0]), torch.tensor([0, 3, 9, 10 - 1])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x, t, y), ref(x, t, y), rtol=0, atol=1e-5)


def test_convert_cli_round_trip_and_sample(tmp_path, capsys):
    from steadydiff.cli import main

    torch.manual_seed(0)
    ours = build_model(tiny_cfg(skip_scaling="ls_ns", num_classes=3), (1, 16, 16))
    official = steadydiff_to_official(ours.state_dict(), ours.num_skips)
    torch.save(official, tmp_path / "nnet_ema.pth")
    run = tmp_path / "run"
    assert main(["convert", "uvit-official", str(tmp_path / "nnet_ema.pth"), "--num-heads", "4",
                 "--out", str(run)]) == 0
    assert main(["sample", str(run), "--n", "4", "--steps", "2", "--out", str(tmp_path / "s.png")]) == 0
    assert main(["convert", "to-uvit-official", str(run), "--out", str(tmp_path / "back.pth")]) == 0
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert back.keys() == official.keys() and all(torch.equal(back[k], official[k]) for k in back)
    capsys.readouterr()
    # Refused: converting over an existing run, a missing head count, and a pickle that runs code.
    assert main(["convert", "uvit-official", str(tmp_path / "nnet_ema.pth"), "--num-heads", "4",
                 "--out", str(run)]) == 2
    assert main(["convert", "uvit-official", str(tmp_path / "nnet_ema.pth"), "--out", str(tmp_path / "r2")]) == 2
    assert "--num-heads" in capsys.readouterr().err


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/steadydiff-pwned",))


def test_converter_refuses_pickles_that_run_code(tmp_path):
    from steadydiff.nn.convert import ConversionError

    path = tmp_path / "evil.pth"
    torch.save({"pos_embed": _Evil()}, path)
    with pytest.raises(ConversionError, match="never unpickles code"):
        load_official_uvit(path, num_heads=4)
    assert not Path("/tmp/steadydiff-pwned").exists()
