"""Datasets held in memory, a resumable infinite index stream, and batch assembly.

    ds = load_dataset(cfg.data)                      # ArrayDataset: data, labels, num_classes, name
    sampler = InfiniteSampler(len(ds), seed=cfg.train.seed)
    x, y = get_batch(ds, sampler.indices(step * batch, batch), cfg.data.hflip, generator)

Every failure is a `DataError` whose message is one line naming the fix.
"""

from .base import ArrayDataset, DataError
from .datasets import DATASET_NAMES, load_dataset
from .fashion_mnist import load_fashion_mnist
from .folder import load_folder
from .sampler import InfiniteSampler, get_batch
from .toy2d import TOY_KINDS, load_toy2d, make_toy2d

__all__ = [
    "DATASET_NAMES",
    "TOY_KINDS",
    "ArrayDataset",
    "DataError",
    "InfiniteSampler",
    "get_batch",
    "load_dataset",
    "load_fashion_mnist",
    "load_folder",
    "load_toy2d",
    "make_toy2d",
]
