"""Datasets (in memory, or memory-mapped stores of any size), a resumable infinite index stream, and batch
assembly.

    ds = load_dataset(cfg.data)                      # ArrayDataset or StoreDataset: items, labels, num_classes
    build_store("photos/", "stores/photos", resolution=64)   # `steadydiff dataset build`
    sampler = InfiniteSampler(len(ds), seed=cfg.train.seed)
    x, y = get_batch(ds, sampler.indices(step * batch, batch), cfg.data.hflip, generator)

Every failure is a `DataError` whose message is one line naming the fix.
"""

from .base import ArrayDataset, DataError, to_unit_range
from .build import build_store, store_info
from .datasets import DATASET_NAMES, load_dataset
from .fashion_mnist import load_fashion_mnist
from .folder import load_folder
from .loader import Prefetcher
from .sampler import InfiniteSampler, fixed_subset, get_batch, model_labels
from .sources import open_source
from .store import StoreDataset, open_store, read_index, verify_store
from .toy2d import TOY_KINDS, load_toy2d, make_toy2d

__all__ = [
    "DATASET_NAMES",
    "TOY_KINDS",
    "ArrayDataset",
    "DataError",
    "InfiniteSampler",
    "Prefetcher",
    "StoreDataset",
    "build_store",
    "fixed_subset",
    "get_batch",
    "load_dataset",
    "load_fashion_mnist",
    "load_folder",
    "load_toy2d",
    "make_toy2d",
    "model_labels",
    "open_source",
    "open_store",
    "read_index",
    "store_info",
    "to_unit_range",
    "verify_store",
]
