"""`load_dataset`: a `DataConfig` to an in-memory `ArrayDataset`."""

from __future__ import annotations

from ..config import DataConfig
from .base import ArrayDataset, DataError
from .fashion_mnist import load_fashion_mnist
from .folder import load_folder
from .toy2d import load_toy2d

DATASET_NAMES = ("fashion_mnist", "toy2d", "folder")


def load_dataset(cfg: DataConfig) -> ArrayDataset:
    """Load the dataset `cfg` names, whole, into memory; `cfg.max_items` keeps the first N items."""
    if cfg.max_items is not None and cfg.max_items < 1:
        raise DataError(f"data.max_items must be >= 1 or null, got {cfg.max_items}")
    if cfg.name == "fashion_mnist":
        ds = load_fashion_mnist(cfg.split, cfg.root, cfg.resolution)
    elif cfg.name == "toy2d":
        if cfg.hflip:
            raise DataError("data.hflip applies to images only; set data.hflip=false for toy2d")
        ds = load_toy2d(cfg.toy, cfg.split, cfg.toy_size)
    elif cfg.name == "folder":
        ds = load_folder(cfg.root, cfg.resolution, cfg.labels, cfg.max_items)
    else:
        valid = ", ".join(DATASET_NAMES)
        raise DataError(f"unknown dataset data.name={cfg.name!r}; set data.name to one of {valid}")
    return ds.truncate(cfg.max_items)
