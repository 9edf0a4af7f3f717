"""Reference statistics of a real dataset: the Gaussian (mu, sigma) of its features, computed once and cached.

    ref = reference_stats("fashion_mnist", "test", get_extractor("fmnist"), n=10000)
    fd = frechet_distance(ref["mu"], ref["sigma"], *gaussian_stats(ext.features(samples)))

The cache is `$XDG_CACHE_HOME/steadydiff/reference-stats/` (default `~/.cache/...`), one npz per (dataset,
split, n, extractor id, data hash): `NAME-SPLIT-nN-EXTRACTORID-DIGEST.npz` holding mu (D,) and sigma (D, D)
float64 (unbiased covariance), n, extractor_id, data_hash, dataset and split. The data hash is of the image
tensor actually used, so editing a folder dataset or changing its resolution never reuses stale statistics;
the extractor id changes with its weights and input convention. Files are written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from ..config import DataConfig
from ..data import load_dataset
from ..utils.errors import ConfigError
from ..utils.io import atomic_write
from .distances import gaussian_stats
from .features import FeatureExtractor, get_extractor

log = logging.getLogger(__name__)

__all__ = ["reference_cache_dir", "reference_stats"]

_KEYS = ("mu", "sigma", "n", "extractor_id", "data_hash", "dataset", "split")


def reference_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/steadydiff/reference-stats`, default `~/.cache/steadydiff/reference-stats`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "steadydiff" / "reference-stats"


def _read(path: Path, extractor_id: str, data_hash: str, n: int) -> dict | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            out = {k: z[k] for k in _KEYS}
        out = {
            "mu": np.asarray(out["mu"], dtype=np.float64),
            "sigma": np.asarray(out["sigma"], dtype=np.float64),
            "n": int(out["n"]),
            "extractor_id": str(out["extractor_id"]),
            "data_hash": str(out["data_hash"]),
            "dataset": str(out["dataset"]),
            "split": str(out["split"]),
        }
        if (out["extractor_id"], out["data_hash"], out["n"]) != (extractor_id, data_hash, n):
            raise ValueError("its extractor id, data hash or n differ from the file name's")
        d = out["mu"].shape[0]
        if out["mu"].shape != (d,) or out["sigma"].shape != (d, d):
            raise ValueError(f"mu {out['mu'].shape} and sigma {out['sigma'].shape} do not fit")
    except Exception as e:  # a damaged cache file is recomputed, never trusted
        log.warning("ignoring unreadable reference statistics %s (%s); recomputing them", path, e)
        return None
    return out


def _write(path: Path, stats: dict) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                mu=stats["mu"],
                sigma=stats["sigma"],
                n=np.int64(stats["n"]),
                extractor_id=np.str_(stats["extractor_id"]),
                data_hash=np.str_(stats["data_hash"]),
                dataset=np.str_(stats["dataset"]),
                split=np.str_(stats["split"]),
            )

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, write)


def reference_stats(
    dataset: str | DataConfig,
    split: str = "train",
    extractor: FeatureExtractor | str = "inception",
    n: int | None = None,
    *,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
) -> dict:
    """Feature statistics of the first `n` images (all when None) of `dataset`'s `split`.

    `dataset` is a dataset name (`fashion_mnist`) or a `DataConfig` (its split is replaced by `split`; its
    `max_items` applies before `n`). `extractor` is a `FeatureExtractor` or a registry name (built on
    `device`). Returns a dict: mu (D,) and sigma (D, D) float64 numpy, n (images used), extractor_id,
    data_hash, dataset, split and path (the cache file). Loaded from the cache when present, else computed
    and saved there.
    """
    if n is not None and n < 2:
        raise ConfigError(f"reference statistics: n must be >= 2 images (a covariance needs two; --ref-n), got {n}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    cfg = DataConfig(name=dataset) if isinstance(dataset, str) else dataset
    cfg = dataclasses.replace(cfg, split=split)
    ds = load_dataset(cfg).truncate(n)
    if len(ds.sample_shape) != 3:
        raise ValueError(f"dataset {cfg.name} holds {ds.sample_shape} samples, not images")
    if isinstance(extractor, str):
        extractor = get_extractor(extractor, device)
    count = len(ds)
    data_hash = ds.digest()
    key = {"dataset": cfg.name, "split": split, "n": count, "extractor_id": extractor.id, "data_hash": data_hash}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else reference_cache_dir()
    path = cache / f"{cfg.name}-{split}-n{count}-{extractor.id}-{digest}.npz"

    if path.is_file():
        stats = _read(path, extractor.id, data_hash, count)
        if stats is not None:
            log.info("loaded reference statistics %s", path)
            return {**stats, "path": str(path)}

    log.info("computing %s features of %d %s/%s images", extractor.id, count, cfg.name, split)
    chunk = max(batch_size, 1024)
    feats = []
    for i in range(0, count, chunk):
        feats.append(extractor.features(ds.items_range(i, i + chunk), batch_size=batch_size))
        log.info("reference features: %d/%d", min(i + chunk, count), count)
    mu, sigma = gaussian_stats(torch.cat(feats))
    stats = {"mu": mu, "sigma": sigma, **{k: key[k] for k in ("n", "extractor_id", "data_hash", "dataset", "split")}}
    _write(path, stats)
    log.info("saved reference statistics %s", path)
    return {**stats, "path": str(path)}
