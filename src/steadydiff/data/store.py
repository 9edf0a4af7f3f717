"""A dataset store: uint8 image shards on disk, read row by row, so that memory does not grow with the dataset.
(A latent store, written by `steadydiff dataset encode`, holds float32 posterior means and stds instead: see
`data/latent.py`.)

Layout of a store directory (written by `steadydiff dataset build`, see `data/build.py`):

    dataset.json             format, version, count, shape (C, H, W), labels, class names, source, resize rule,
                             and per shard: file names, item count and SHA-256 of each file
    shard-00000.npy          uint8 (n_0, C, H, W), NumPy .npy
    shard-00000.labels.npy   int64 (n_0,), only when the store has labels
    ...

A store is complete exactly when dataset.json exists: the build writes it last, into a staging directory that
is then renamed into place, so an interrupted build never looks complete. Shards are plain .npy files (any
tool can memory-map them). Training reads the rows a batch needs with positional reads (`os.pread`) rather
than through a memory map: the OS page cache still keeps hot data in memory, but none of it is mapped into
the process, so its resident memory stays flat however large the store (a memory map would also count the
pages the kernel maps around each touched row, ~64 KiB per random read). `items(indices)` converts the rows
to float32 in [-1, 1] with `to_unit_range`, bit-identical to the in-memory datasets. Labels (8 bytes per
item) are held in RAM. `verify_store` re-hashes every file against dataset.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .base import ArrayDataset, DataError, to_unit_range
from .latent import normalise, split_posterior

FORMAT = "steadydiff-store"
VERSION = 1
INDEX = "dataset.json"
_READ_FIX = "run `steadydiff dataset verify {root}`, and rebuild the store with `steadydiff dataset build`"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_index(root: str | Path) -> dict[str, Any]:
    """dataset.json of the store at `root`, checked for format and version; errors name the fix."""
    root = Path(root)
    path = root / INDEX
    if root.with_name(root.name + ".partial").exists() and not path.is_file():
        raise DataError(f"the store {root} is an unfinished build ({root.name}.partial); re-run the same "
                        "`steadydiff dataset build` command to complete it")
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise DataError(f"data.root={root} {what}; build a store with `steadydiff dataset build SRC --out {root}`")
    if not path.is_file():
        raise DataError(f"{root} is not a dataset store: it has no {INDEX}; build one with "
                        f"`steadydiff dataset build SRC --out {root}`")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is unreadable ({e}); rebuild the store with `steadydiff dataset build`") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path} is not a steadydiff dataset store index; rebuild it with `steadydiff dataset build`")
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise DataError(f"{root} is a store of format version {meta.get('version')}, newer than this steadydiff "
                        f"reads ({VERSION}); upgrade steadydiff (pip install -U steadydiff)")
    if meta.get("dtype", "uint8") != "uint8" and not isinstance(meta.get("latent"), dict):
        raise DataError(f"{root} holds {meta.get('dtype')} rows but no VAE record (\"latent\" in {INDEX}), so its "
                        "latents cannot be normalised or decoded; re-encode it with `steadydiff dataset encode`")
    return meta


class Shard:
    """One .npy shard read by offset: `rows(local_indices)` -> uint8 (n, *shape). Thread-safe (pread)."""

    def __init__(self, path: Path, count: int, shape: tuple[int, ...], fix: str, dtype: str = "uint8"):
        self.path, self.count, self.shape, self.dtype = path, count, shape, np.dtype(dtype)
        self.row_bytes = int(np.prod(shape)) * self.dtype.itemsize
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                header = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                          np.lib.format.read_array_header_2_0)(f)
                self.offset = f.tell()
        except FileNotFoundError as e:
            raise DataError(f"store shard {path} is missing; {fix}") from e
        except (OSError, ValueError) as e:
            raise DataError(f"store shard {path} is truncated or corrupt ({e}); {fix}") from e
        got_shape, fortran, dtype = header
        if dtype != self.dtype or fortran or got_shape != (count, *shape):
            raise DataError(f"store shard {path} holds {dtype} {got_shape}, not {self.dtype} {(count, *shape)} as "
                            f"{INDEX} says; {fix}")
        size = path.stat().st_size
        if size != self.offset + count * self.row_bytes:
            raise DataError(f"store shard {path} is truncated or corrupt ({size} bytes, expected "
                            f"{self.offset + count * self.row_bytes}); {fix}")
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.count

    def rows(self, local: np.ndarray) -> np.ndarray:
        out = np.empty((len(local), self.row_bytes), np.uint8)
        for k, i in enumerate(local.tolist()):
            out[k] = np.frombuffer(os.pread(self.fd, self.row_bytes, self.offset + i * self.row_bytes), np.uint8)
        return out.view(self.dtype).reshape(len(local), *self.shape)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)


@dataclass
class StoreDataset:
    """A store opened for reading: the `ArrayDataset` reading interface over memory-mapped shards."""

    root: Path
    meta: dict[str, Any]
    shards: list[Shard]
    labels: torch.Tensor | None
    num_classes: int
    name: str
    class_names: list[str] | None = None
    limit: int | None = None
    _starts: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._starts = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self) -> int:
        total = int(self._starts[-1])
        return total if self.limit is None else min(total, self.limit)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.meta["shape"])

    @property
    def is_image(self) -> bool:
        return True

    @property
    def latent(self) -> dict[str, Any] | None:
        """A latent store's record (VAE identity, per-channel statistics; `data/latent.py`), else None."""
        return self.meta.get("latent")

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx), *self.shards[0].shape), dtype=self.shards[0].dtype) if self.shards else \
            np.empty((len(idx), *self.sample_shape), dtype=np.uint8)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        for s in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == s)
            out[rows] = self.shards[s].rows(idx[rows] - self._starts[s])
        return out

    def _rows(self, indices: torch.Tensor) -> np.ndarray:
        idx = indices.to(device="cpu", dtype=torch.int64).numpy()
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"index out of range for a store of {len(self)} items")
        return self._gather(idx)

    def items(self, indices: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1]; for a latent store the normalised posterior means (deterministic: what
        validation sets and reference statistics use; training draws with `draw`)."""
        if self.latent is not None:
            return normalise(split_posterior(torch.from_numpy(self._rows(indices)))[0], self.latent)
        return to_unit_range(torch.from_numpy(self._rows(indices)))

    def draw(self, indices: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """A latent store's training sample: normalise(mean + std * eps), eps ~ N(0, I) drawn by the caller from
        the step's generator (EDM2's fresh latent per step)."""
        mean, std = split_posterior(torch.from_numpy(self._rows(indices)))
        return normalise(mean + std * eps.to(mean.dtype), self.latent)

    def items_range(self, start: int, stop: int) -> torch.Tensor:
        stop = min(stop, len(self))
        return self.items(torch.arange(start, max(start, stop)))

    def digest(self) -> str:
        """A hash of the store's content (its files' SHA-256s) and of the items used."""
        key = json.dumps([[s.get("sha256"), s.get("labels_sha256")] for s in self.meta["shards"]] + [len(self)])
        return hashlib.sha256(key.encode()).hexdigest()

    def truncate(self, max_items: int | None) -> StoreDataset:
        if max_items is None or max_items >= len(self):
            return self
        if max_items < 1:
            raise DataError(f"data.max_items must be >= 1 or null, got {max_items}")
        return StoreDataset(self.root, self.meta, self.shards, None if self.labels is None else
                            self.labels[:max_items].clone(), self.num_classes, self.name, self.class_names, max_items)

    def to_ram(self) -> ArrayDataset:
        """The whole store as an in-memory uint8 `ArrayDataset` (data.cache: ram)."""
        if self.latent is not None:
            raise DataError(f"data.cache=ram applies to image stores; {self.root} is a latent store, read from disk "
                            "(set data.cache=none)")
        data = torch.from_numpy(self._gather(np.arange(len(self))))
        return ArrayDataset(data, self.labels, self.num_classes, self.name, self.class_names)


def open_store(root: str | Path) -> StoreDataset:
    """Open the store at `root` (see the module doc). Shards are checked for shape and size, not re-hashed."""
    root = Path(root)
    meta = read_index(root)
    shape = tuple(meta["shape"])
    fix = _READ_FIX.format(root=root)
    shards, labels = [], []
    for entry in meta["shards"]:
        row_shape = tuple(meta.get("row_shape", shape))  # a latent store's rows: posterior mean | std
        shards.append(Shard(root / entry["file"], entry["count"], row_shape, fix, meta.get("dtype", "uint8")))
        if meta.get("labels"):
            lpath = root / entry["labels_file"]
            try:
                lab = np.load(lpath, allow_pickle=False)
            except (OSError, ValueError) as e:
                raise DataError(f"store labels {lpath} are missing or corrupt ({e}); {fix}") from e
            if lab.shape != (entry["count"],):
                raise DataError(f"store labels {lpath} hold {lab.shape[0] if lab.ndim else 0} labels, not "
                                f"{entry['count']}; {fix}")
            labels.append(lab.astype(np.int64))
    y = torch.from_numpy(np.concatenate(labels)) if meta.get("labels") else None
    names = meta.get("class_names")
    num_classes = int(meta.get("num_classes") or 0) if y is not None else 0
    return StoreDataset(root, meta, shards, y, num_classes, f"store/{root.name}", names)


def verify_store(root: str | Path, progress: bool = False) -> dict[str, Any]:
    """Re-hash every file of the store against dataset.json; raise DataError naming the first bad file."""
    from tqdm import tqdm

    root = Path(root)
    meta = read_index(root)
    files = [(e["file"], e["sha256"]) for e in meta["shards"]]
    files += [(e["labels_file"], e["labels_sha256"]) for e in meta["shards"] if meta.get("labels")]
    # The bar only on a terminal: on a log or a pipe an error must stay the one line it is.
    for name, want in tqdm(files, desc="verify", unit="file", disable=not (progress and sys.stderr.isatty())):
        path = root / name
        if not path.is_file():
            raise DataError(f"store file {path} is missing; rebuild the store with `steadydiff dataset build`")
        if file_sha256(path) != want:
            raise DataError(f"store file {path} fails its checksum (corrupt or changed); rebuild the store with "
                            "`steadydiff dataset build`")
    open_store(root)  # shapes and sizes
    return {"files": len(files), "count": meta["count"]}
