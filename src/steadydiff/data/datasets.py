"""`load_dataset`: a `DataConfig` to an in-memory `ArrayDataset`."""

from __future__ import annotations

from ..config import DataConfig
from .base import ArrayDataset, DataError
from .fashion_mnist import load_fashion_mnist
from .folder import load_folder
from .store import StoreDataset, open_store
from .toy2d import load_toy2d

DATASET_NAMES = ("fashion_mnist", "toy2d", "folder", "store")


def load_dataset(cfg: DataConfig) -> ArrayDataset | StoreDataset:
    """The dataset `cfg` names: in memory, or a memory-mapped store (`data.cache: ram` loads a store to RAM);
    `cfg.max_items` keeps the first N items."""
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
    elif cfg.name == "store":
        store = open_store(cfg.root)
        # data.resolution is the image resolution, for a latent store that of the images it encodes
        shape = store.sample_shape if store.latent is None else store.latent["image_store"]["shape"]
        what = "images" if store.latent is None else "latents of images"
        if tuple(shape[1:]) != (cfg.resolution, cfg.resolution):
            raise DataError(f"the store {cfg.root} holds {what} of {shape[1]}x{shape[2]} but data.resolution="
                            f"{cfg.resolution}; set data.resolution={shape[1]} (or build a store at this resolution)")
        if store.latent is not None and cfg.hflip:
            raise DataError(f"{cfg.root} is a latent store: mirrored latents are not latents of mirrored images; "
                            "set data.hflip=false")
        if cfg.labels and store.labels is None:
            raise DataError(f"data.labels=true but the store {cfg.root} has no labels; rebuild it with --labels or "
                            "set data.labels=false")
        store = store.truncate(cfg.max_items)
        return store.to_ram() if cfg.cache == "ram" else store
    else:
        valid = ", ".join(DATASET_NAMES)
        raise DataError(f"unknown dataset data.name={cfg.name!r}; set data.name to one of {valid}")
    return ds.truncate(cfg.max_items)
