"""Official U-ViT / ScaleLong checkpoints <-> steadydiff U-ViT.

The official training code (baofff/U-ViT, sail-sg/ScaleLong) saves `nnet.pth` / `nnet_ema.pth` as plain
state dicts. steadydiff's `UViT` uses the same parameter names for every layer, so conversion is:

- infer the hyper-parameters from tensor shapes (all but the head count, which no tensor records, and the
  constant skip scaling, which has no parameters: both are arguments);
- rename the LS gates: official `se.*` (shared) -> `skip_scaling.gates.c{L}.*`; official `se.{j}.*`
  (non-shared, j = 0 is the innermost skip) -> `skip_scaling.gates.{N-1-j}.*` (our index 0 = outermost).

Files are read with `torch.load(weights_only=True)`: a checkpoint can never run code while loading.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import ModelConfig
from ..utils.errors import SteadydiffError

_SE_SHARED = re.compile(r"^se\.(layer[12]\.(?:weight|bias))$")
_SE_SPLIT = re.compile(r"^se\.(\d+)\.(layer[12]\.(?:weight|bias))$")
_GATE_SHARED = re.compile(r"^skip_scaling\.gates\.c\d+\.(layer[12]\.(?:weight|bias))$")
_GATE_SPLIT = re.compile(r"^skip_scaling\.gates\.(\d+)\.(layer[12]\.(?:weight|bias))$")


class ConversionError(SteadydiffError, ValueError):
    """The state dict is not an official U-ViT one; the message says what is missing."""


def _strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # DataParallel/accelerate wrappers save keys under "module."
    if sd and all(k.startswith("module.") for k in sd):
        return {k[len("module."):]: v for k, v in sd.items()}
    return sd


def infer_uvit_config(sd: dict[str, torch.Tensor], num_heads: int, skip_scaling: str = "org",
                      kappa: float = 0.5) -> tuple[ModelConfig, tuple[int, int, int]]:
    """ModelConfig and sample shape (C, H, W) of an official U-ViT state dict."""
    sd = _strip_prefix(sd)
    for key in ("patch_embed.proj.weight", "pos_embed", "decoder_pred.weight", "mid_block.attn.qkv.weight"):
        if key not in sd:
            raise ConversionError(f"not an official U-ViT state dict: {key} is missing")
    d, c, p, _ = sd["patch_embed.proj.weight"].shape
    n_in = len({k.split(".")[1] for k in sd if k.startswith("in_blocks.")})
    n_out = len({k.split(".")[1] for k in sd if k.startswith("out_blocks.")})
    if n_in != n_out or n_in == 0:
        raise ConversionError(f"expected as many in- as out-blocks, found {n_in} and {n_out}")
    num_classes = int(sd["label_emb.weight"].shape[0]) if "label_emb.weight" in sd else 0
    extras = 2 if num_classes else 1
    tokens = int(sd["pos_embed"].shape[1])
    side = round((tokens - extras) ** 0.5)
    if side * side != tokens - extras:
        raise ConversionError(f"pos_embed has {tokens} tokens, not {extras} extra + a square number of patches")
    if d % num_heads:
        raise ConversionError(f"embed dim {d} is not divisible by --num-heads {num_heads}")
    if any(_SE_SPLIT.match(k) for k in sd):
        skip_scaling = "ls_ns"
    elif any(_SE_SHARED.match(k) for k in sd):
        skip_scaling = "ls"
    reduction = 16
    gate_hidden = next((int(v.shape[0]) for k, v in sd.items() if k.endswith("layer1.weight")), None)
    if gate_hidden is not None and tokens // reduction != gate_hidden:
        reduction = next(r for r in range(1, tokens + 1) if tokens // r == gate_hidden)
    cfg = ModelConfig(
        backbone="uvit", skip_scaling=skip_scaling, kappa=kappa, ls_reduction=reduction,
        embed_dim=int(d), patch_size=int(p), depth=2 * n_in, num_heads=num_heads,
        mlp_ratio=sd["mid_block.mlp.fc1.weight"].shape[0] / d,
        qkv_bias="mid_block.attn.qkv.bias" in sd, mlp_time_embed="time_embed.0.weight" in sd,
        num_classes=num_classes, final_conv="final_layer.weight" in sd,
    )
    return cfg, (int(c), side * p, side * p)


def official_to_steadydiff(sd: dict[str, torch.Tensor], tokens: int, num_skips: int) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in _strip_prefix(sd).items():
        if m := _SE_SPLIT.match(k):
            k = f"skip_scaling.gates.{num_skips - 1 - int(m.group(1))}.{m.group(2)}"
        elif m := _SE_SHARED.match(k):
            k = f"skip_scaling.gates.c{tokens}.{m.group(1)}"
        out[k] = v
    return out


def steadydiff_to_official(sd: dict[str, torch.Tensor], num_skips: int) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if m := _GATE_SPLIT.match(k):
            k = f"se.{num_skips - 1 - int(m.group(1))}.{m.group(2)}"
        elif m := _GATE_SHARED.match(k):
            k = f"se.{m.group(1)}"
        out[k] = v
    return out


def load_official_uvit(path_or_sd, num_heads: int, skip_scaling: str = "org", kappa: float = 0.5):
    """Build a steadydiff UViT holding an official checkpoint's weights.

    Returns (model, ModelConfig, sample_shape). `skip_scaling`/`kappa` matter only for parameter-free
    methods (org, inv_sqrt2, cs: the official `--config.nnet.scalelong` 0/1/2); LS variants are detected.
    """
    from . import build_model

    if isinstance(path_or_sd, str | Path):
        try:
            sd = torch.load(path_or_sd, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError for anything but plain tensors/containers
            raise ConversionError(
                f"{path_or_sd} is not a plain state dict ({type(e).__name__}); steadydiff never unpickles code: "
                "re-save it with torch.save(model.state_dict(), path)"
            ) from e
    else:
        sd = path_or_sd
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConversionError("expected a state dict of tensors (the official nnet.pth / nnet_ema.pth)")
    cfg, shape = infer_uvit_config(sd, num_heads, skip_scaling, kappa)
    model = build_model(cfg, shape)
    model.load_state_dict(official_to_steadydiff(sd, model.skip_channels[0], model.num_skips))
    return model, cfg, shape
