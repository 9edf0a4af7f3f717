"""ScaleLong on diffusers' UNet2DModel: identity for org, documented coefficients for cs, trains, saves."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[hf]')")

from safetensors.torch import load_file  # noqa: E402

from steadydiff.config import load_config  # noqa: E402
from steadydiff.nn import cs_coefficients  # noqa: E402
from steadydiff.nn.diffusers_compat import DiffusersUNetAdapter, apply_skip_scaling  # noqa: E402
from steadydiff.train import Trainer  # noqa: E402


def tiny_unet(seed=0):
    torch.manual_seed(seed)
    unet = diffusers.UNet2DModel(
        sample_size=16, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 16),
        norm_num_groups=4, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=4,
    )
    with torch.no_grad():  # make every branch matter
        for p in unet.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return unet


X, T = torch.randn(2, 1, 16, 16), torch.tensor([3.0, 700.0])


def test_org_is_bit_identical():
    plain, wrapped = tiny_unet(), tiny_unet()
    apply_skip_scaling(wrapped, "org")
    assert torch.equal(plain(X, T).sample, wrapped(X, T).sample)


def test_cs_scales_each_skip_by_its_coefficient():
    unet = tiny_unet()
    raw = [None]

    def grab_conv_in(m, args, out):
        raw[0] = [out.detach().clone()]

    def grab_down(m, args, out):
        raw[0] += [r.detach().clone() for r in out[1]]

    unet.conv_in.register_forward_hook(grab_conv_in)
    for b in unet.down_blocks:
        b.register_forward_hook(grab_down)
    apply_skip_scaling(unet, "cs", kappa=0.6)
    received = []
    for b in unet.up_blocks:  # registered after ours: sees the scaled skips
        b.register_forward_pre_hook(lambda m, args: received.append([r.detach().clone() for r in args[1]]))
    unet(X, T)
    n = len(raw[0])
    assert n == 4  # conv_in, resnet + downsampler, resnet
    assert unet.skip_scaling.coefficients() == cs_coefficients(n, 0.6)
    # Up blocks consume innermost-first; flatten back to outermost-first order.
    flat = [s for block in reversed(received) for s in block]
    assert len(flat) == n
    for i, (r, s) in enumerate(zip(raw[0], flat)):
        torch.testing.assert_close(s, r * 0.6**i, rtol=0, atol=1e-7)


def test_ls_ns_trains_with_the_steadydiff_trainer_and_saves(tmp_path):
    cfg = load_config(None, ["data.max_items=64", "train.steps=3", "train.batch_size=4", "train.threads=1",
                             "train.sample_n=4", "train.sample_steps=2", "train.warmup_steps=0", "train.lr=1e-2",
                             "data.resolution=28"])
    # Fashion-MNIST is 28x28; this UNet has two levels, so 28 works.
    unet28 = diffusers.UNet2DModel(
        sample_size=28, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 16),
        norm_num_groups=4, down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )
    apply_skip_scaling(unet28, "ls_ns")
    before = {k: v.clone() for k, v in unet28.skip_scaling.state_dict().items()}
    tr = Trainer(cfg, tmp_path / "run", show_progress=False, model=DiffusersUNetAdapter(unet28))
    tr.fit()
    after = unet28.skip_scaling.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "LS gates did not train"
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert '"skip_coeffs"' in rows[-1]

    unet28.save_pretrained(tmp_path / "hf")
    saved = load_file(str(tmp_path / "hf" / "diffusion_pytorch_model.safetensors"))
    assert {k for k in saved if k.startswith("skip_scaling.")} == {f"skip_scaling.{k}" for k in after}
    fresh = diffusers.UNet2DModel.from_config(unet28.config)
    apply_skip_scaling(fresh, "ls_ns")
    fresh.load_state_dict(saved)
    x, t = torch.randn(2, 1, 28, 28), torch.tensor([1.0, 500.0])
    assert torch.equal(fresh(x, t).sample, unet28(x, t).sample)


def test_rejects_non_unets():
    with pytest.raises(TypeError, match="not a diffusers UNet"):
        apply_skip_scaling(torch.nn.Linear(2, 2), "cs")


def test_adapter_null_label_zeroes_the_class_embedding():
    """steadydiff's null label (what label dropout trains, what classifier-free guidance queries) on a diffusers
    UNet: the class embedding's contribution is zero, as in steadydiff's own backbones."""
    from steadydiff.nn import NULL_LABEL
    from steadydiff.nn.diffusers_compat import DiffusersUNetAdapter

    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 16),
        norm_num_groups=4, down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
        num_class_embeds=3,
    )
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = DiffusersUNetAdapter(unet).eval()
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([10.0, 300.0, 900.0])
    with torch.no_grad():
        mixed = model(x, t, torch.tensor([NULL_LABEL, 2, NULL_LABEL]))
        with_class = model(x, t, torch.tensor([1, 2, 1]))
        unet.class_embedding.weight[1].zero_()  # the reference: class 1 with its embedding removed by hand
        ref = model(x, t, torch.tensor([1, 2, 1]))
    assert not torch.equal(mixed, with_class)
    torch.testing.assert_close(mixed, ref, rtol=0, atol=0)
