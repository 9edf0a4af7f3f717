"""ScaleLong for third-party UNets: diffusers' `UNet2DModel` (and `UNet2DConditionModel`) in one line.

    from steadydiff.nn.diffusers_compat import apply_skip_scaling
    apply_skip_scaling(unet, "cs", kappa=0.5)

diffusers collects `down_block_res_samples` (conv_in output first, then every resnet and downsampler
output) and each up block consumes the last `len(block.resnets)` of them, innermost first. We register a
forward pre-hook on every up block that scales its `res_hidden_states_tuple` with a steadydiff
`SkipScaling` before the block concatenates them. Skip index 0 is the outermost (the conv_in output),
exactly as in steadydiff's own backbones. The scaling module is attached as `unet.skip_scaling`, so LS
gates train with the model and `save_pretrained` stores them (as extra `skip_scaling.*` keys).

Needs the optional extra `pip install "steadydiff[hf]"` (diffusers); nothing here imports diffusers.
"""

from __future__ import annotations

from torch import Tensor, nn

from .skip_scaling import SkipScaling, make_skip_scaling


def _skip_channels(unet: nn.Module) -> list[int]:
    """Channel count of every down-block residual sample, outermost first."""
    channels = [unet.conv_in.out_channels]
    for block in unet.down_blocks:
        channels += [r.out_channels for r in block.resnets]
        for d in getattr(block, "downsamplers", None) or []:
            channels.append(d.out_channels)
    return channels


def apply_skip_scaling(unet: nn.Module, method: str, kappa: float = 0.5, reduction: int = 16) -> SkipScaling:
    """Scale the long skips of a diffusers UNet in place; returns the scaling module.

    With `org` the model's output is bit-identical to the unwrapped one. Calling it again replaces the
    previous scaling.
    """
    if not hasattr(unet, "down_blocks") or not hasattr(unet, "up_blocks"):
        raise TypeError(f"{type(unet).__name__} is not a diffusers UNet (needs down_blocks and up_blocks)")
    remove_skip_scaling(unet)
    channels = _skip_channels(unet)
    scaling = make_skip_scaling(method, channels, kappa, reduction)
    unet.skip_scaling = scaling
    handles = []
    remaining = len(channels)
    for block in unet.up_blocks:
        n = len(block.resnets)
        start = remaining - n  # this block receives skips [start, start + n)
        remaining = start
        handles.append(block.register_forward_pre_hook(_make_hook(unet, start), with_kwargs=True))
    if remaining != 0:
        for h in handles:
            h.remove()
        raise ValueError(f"up blocks consume {len(channels) - remaining} skips but down blocks make {len(channels)}")
    unet._steadydiff_skip_hooks = handles
    return scaling


def remove_skip_scaling(unet: nn.Module) -> None:
    for h in getattr(unet, "_steadydiff_skip_hooks", []):
        h.remove()
    unet._steadydiff_skip_hooks = []
    if "skip_scaling" in unet._modules:
        del unet._modules["skip_scaling"]


def _make_hook(unet: nn.Module, start: int):
    def hook(module, args, kwargs):
        scaling = unet.skip_scaling

        def scale(res: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            return tuple(scaling(start + p, s) for p, s in enumerate(res))

        if "res_hidden_states_tuple" in kwargs:
            kwargs = {**kwargs, "res_hidden_states_tuple": scale(kwargs["res_hidden_states_tuple"])}
        else:
            args = (args[0], scale(args[1]), *args[2:])
        return args, kwargs

    return hook


class DiffusersUNetAdapter(nn.Module):
    """Give a diffusers UNet steadydiff's backbone interface `model(x, t, labels)` so that the steadydiff
    Trainer, samplers and diagnostics drive it: `Trainer(cfg, run_dir, model=DiffusersUNetAdapter(unet))`."""

    backbone_attr = "unet"  # the child holding the backbone (diagnostics group its blocks inside it)
    time_input = "vp_time"  # diffusers' sinusoidal timestep embedding is designed for DDPM's 0..999

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet

    @property
    def skip_scaling(self) -> SkipScaling | None:
        return getattr(self.unet, "skip_scaling", None)

    def forward(self, x: Tensor, t: Tensor, labels: Tensor | None = None) -> Tensor:
        if labels is None or not bool((labels < 0).any()):
            return self.unet(x, t, class_labels=labels).sample
        # NULL_LABEL rows: diffusers has no null class, so zero their class embedding (steadydiff's null label,
        # nn/layers.py) with a hook on `class_embedding` for this call only.
        keep = (labels >= 0).unsqueeze(-1)
        hook = self.unet.class_embedding.register_forward_hook(lambda _m, _a, out: out * keep.to(out.dtype))
        try:
            return self.unet(x, t, class_labels=labels.clamp(min=0)).sample
        finally:
            hook.remove()
