"""Feature extractors for sample-quality metrics (FID-style Frechet distances, precision/recall, ...): the
registry of extractors by name, and every extractor name in one import.

    ext = get_extractor("inception")              # or "fmnist", "mnist"
    f = ext.features(images, batch_size=64)      # images (N, C, H, W) in [-1, 1] -> (N, ext.dim) float32, CPU

The interface and conversions: `extractor.py`; the FID network: `inception.py`; steadydiff's classifiers:
`classifier.py`. A new extractor is a `FeatureExtractor` subclass and one line in EXTRACTORS.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..utils.registry import Registry
from .classifier import (
    CLASSIFIER_RECIPES,
    FMNIST_RECIPE,
    MNIST_RECIPE,
    ClassifierExtractor,
    ClassifierRecipe,
    SmallCNN,
    evaluate_classifier,
    load_classifier_data,
    recipe_key,
    train_classifier,
)
from .extractor import ExtractorError, FeatureExtractor, extractor_cache_dir, tensor_digest
from .inception import INCEPTION_CONVENTIONS, INCEPTION_SHA1, InceptionExtractor, find_inception_weights

__all__ = [
    "CLASSIFIER_RECIPES",
    "EXTRACTORS",
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

# A metric's `needs` names one of these (metrics/evaluate.py).
EXTRACTORS: Registry[Callable[[torch.device], FeatureExtractor]] = Registry("feature extractor")
EXTRACTORS.add("inception", lambda device: InceptionExtractor(device=device))
EXTRACTORS.add("fmnist", lambda device: ClassifierExtractor(FMNIST_RECIPE, device=device, name="fmnist"))
EXTRACTORS.add("mnist", lambda device: ClassifierExtractor(MNIST_RECIPE, device=device, name="mnist"))
EXTRACTOR_NAMES = EXTRACTORS.names


def get_extractor(name: str, device: str | torch.device = "cpu") -> FeatureExtractor:
    """The extractor registered as `name` (see EXTRACTOR_NAMES) on `device`."""
    if name not in EXTRACTORS:
        raise ExtractorError(f"unknown feature extractor {name!r}; valid names: {', '.join(EXTRACTORS)}")
    return EXTRACTORS[name](torch.device(device))
