"""Fashion-MNIST from the standard idx files (train 60k / test 10k, 1x28x28 uint8, labels 0-9).

Where the files are looked for, in order (a directory counts when it holds both files of the split, each
either gzipped `NAME.gz` or plain `NAME`; gzip is recognised by its magic bytes):

1. `data.root`, when set; it is then the only place looked in (a wrong explicit path is an error, not a
   silent fall-back to another copy);
2. `$STEADYDIFF_DATA/fashion-mnist`, then `$STEADYDIFF_DATA` itself;
3. Debian's `/usr/share/datasets/fashion-mnist` (package dataset-fashion-mnist);
4. the user cache `$XDG_CACHE_HOME/steadydiff/fashion-mnist` (default `~/.cache/steadydiff/fashion-mnist`).

When none holds them, the split's files are downloaded into the cache from Zalando's canonical URLs. Each
download goes to a temporary file that is renamed into place only after its SHA-256 check passes.

The SHA-256 constants are of the *decompressed* idx payloads, not of the .gz wrappers: Debian ships the
same idx bytes recompressed (its .gz files differ byte-wise from Zalando's, their contents do not), so a
payload hash verifies every faithful copy. The payload hashes below were computed from the Debian files and
agree with the MD5s published for the canonical decompressed files.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import logging
import os
import urllib.request
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from ..utils.io import atomic_write
from .base import ArrayDataset, DataError

log = logging.getLogger(__name__)

BASE_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
ENV_VAR = "STEADYDIFF_DATA"
RESOLUTION = 28
NUM_CLASSES = 10
CLASS_NAMES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]

SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SPLIT_SIZES = {"train": 60000, "test": 10000}

# SHA-256 of the decompressed idx files (see the module docstring).
SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}

DOWNLOAD_TIMEOUT_S = 30.0
_GZIP_MAGIC = b"\x1f\x8b"
_APT = "install Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist)"
_ENV = "set STEADYDIFF_DATA=DIR holding the idx files"
_FIX = f"{_APT}, {_ENV}, or go online so steadydiff can download it"


# ---------------------------------------------------------------------------------------------------------
# Locating the files


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/steadydiff/fashion-mnist`, default `~/.cache/steadydiff/fashion-mnist`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "steadydiff" / "fashion-mnist"


def search_dirs() -> list[Path]:
    """The standard places, in lookup order (without `data.root`)."""
    dirs = []
    env = os.environ.get(ENV_VAR)
    if env:
        d = Path(env).expanduser()
        dirs += [d / "fashion-mnist", d]
    dirs += [DEBIAN_DIR, cache_dir()]
    return dirs


def _find_file(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        p = directory / name
        if p.is_file():
            return p
    return None


def find_split(directory: Path, split: str) -> tuple[Path, Path] | None:
    """(images, labels) paths of `split` in `directory`, or None when either is missing."""
    found = [_find_file(directory, stem) for stem in SPLIT_FILES[split]]
    if found[0] is None or found[1] is None:
        return None
    return found[0], found[1]


# ---------------------------------------------------------------------------------------------------------
# Reading and verifying


def _corrupt(path: Path, why: str) -> DataError:
    return DataError(
        f"Fashion-MNIST file {path} is corrupt ({why}); delete or replace it "
        "(e.g. reinstall dataset-fashion-mnist, or remove it from the cache so it is downloaded again)"
    )


def read_payload(path: Path) -> bytes:
    """The idx bytes of `path`, gunzipped when it is gzip."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read Fashion-MNIST file {path} ({e}); check its permissions") from e
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise _corrupt(path, f"bad gzip data: {e}") from e
    return raw


def parse_idx(raw: bytes, path: Path, ndim: int) -> np.ndarray:
    """A uint8 idx array with `ndim` dimensions; DataError naming `path` when the bytes are not one."""
    if len(raw) < 4 + 4 * ndim:
        raise _corrupt(path, f"only {len(raw)} bytes, too short for an idx header")
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] != ndim:
        raise _corrupt(path, f"magic number {raw[:4].hex()} is not 000008{ndim:02x} (uint8 idx, {ndim}-d)")
    dims = [int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4)]
    header = 4 + 4 * ndim
    expected = header + int(np.prod(dims, dtype=np.int64))
    if len(raw) != expected:
        raise _corrupt(path, f"{len(raw)} bytes but its header {dims} needs {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def payload_sha256(path: Path) -> str | None:
    """SHA-256 of the decompressed content of `path` (of the file itself if not gzip); None if unreadable."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == _GZIP_MAGIC
        opener = gzip.open if gz else open
        with opener(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except (OSError, EOFError, zlib.error):
        return None
    return h.hexdigest()


def download_verified(url: str, dest: Path, sha256: str, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download `url` to `dest` if its (decompressed) content has SHA-256 `sha256`.

    The bytes go to a temporary file next to `dest`, renamed into place only after the check passes; on any
    failure the temporary file is removed. Network and file-system failures propagate as OSError or
    http.client.HTTPException; a hash mismatch raises DataError.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)

    def fetch_and_check(tmp: Path) -> None:
        with open(tmp, "wb") as f, urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(1 << 20):
                f.write(chunk)
        got = payload_sha256(tmp)
        if got != sha256:
            raise DataError(
                f"download of {url} failed its SHA-256 check (got {got or 'unreadable gzip'}, "
                f"expected {sha256}); "
                f"retry later, {_APT}, or {_ENV}"
            )

    atomic_write(dest, fetch_and_check)
    return dest


def _download_split(split: str) -> tuple[Path, Path]:
    """Fetch the split's missing files into the cache (files already there were verified when fetched)."""
    cache = cache_dir()
    paths = []
    for stem in SPLIT_FILES[split]:
        existing = _find_file(cache, stem)
        if existing is None:
            log.info("downloading %s%s.gz into %s", BASE_URL, stem, cache)
            existing = download_verified(BASE_URL + stem + ".gz", cache / (stem + ".gz"), SHA256[stem])
        paths.append(existing)
    return paths[0], paths[1]


# ---------------------------------------------------------------------------------------------------------
# Loading


def _locate(split: str, root: str | None) -> tuple[Path, Path]:
    if root:
        d = Path(root).expanduser()
        found = find_split(d, split)
        if found is None:
            need = " and ".join(f"{s}[.gz]" for s in SPLIT_FILES[split])
            raise DataError(
                f"data.root={root} holds no Fashion-MNIST {split} files (need {need}); point data.root at "
                "the folder holding them, or set data.root=null to search the standard places"
            )
        return found
    dirs = search_dirs()
    for d in dirs:
        found = find_split(d, split)
        if found is not None:
            return found
    try:
        return _download_split(split)
    except (OSError, http.client.HTTPException) as e:
        looked = ", ".join(str(d) for d in dirs)
        raise DataError(
            f"Fashion-MNIST not found (looked in {looked}) and downloading it failed ({e}); {_FIX}"
        ) from e


def load_fashion_mnist(
    split: str = "train", root: str | None = None, resolution: int = RESOLUTION
) -> ArrayDataset:
    """Fashion-MNIST `split` as (N, 1, 28, 28) uint8 pixels (read as x / 127.5 - 1) with int64 labels 0-9."""
    if resolution != RESOLUTION:
        raise DataError(
            f"Fashion-MNIST images are {RESOLUTION}x{RESOLUTION} and are not resized; "
            f"set data.resolution={RESOLUTION} (got {resolution})"
        )
    if split not in SPLIT_FILES:
        raise DataError(f"unknown Fashion-MNIST split {split!r}; set data.split to train or test")
    img_path, lbl_path = _locate(split, root)
    images = parse_idx(read_payload(img_path), img_path, 3)
    labels = parse_idx(read_payload(lbl_path), lbl_path, 1)
    if images.shape[1:] != (RESOLUTION, RESOLUTION):
        raise _corrupt(img_path, f"images are {images.shape[1]}x{images.shape[2]}, not 28x28")
    if labels.shape[0] != images.shape[0]:
        raise DataError(
            f"Fashion-MNIST {img_path} has {images.shape[0]} images but {lbl_path} has "
            f"{labels.shape[0]} labels; replace them with a matching pair of idx files"
        )
    if labels.size and int(labels.max()) >= NUM_CLASSES:
        raise _corrupt(lbl_path, f"label {int(labels.max())} is outside 0-{NUM_CLASSES - 1}")
    n = images.shape[0]
    with warnings.catch_warnings():  # the array views read-only bytes; it is only read, never written
        warnings.simplefilter("ignore", UserWarning)
        u8 = torch.from_numpy(images)
    x = u8.clone().view(n, 1, RESOLUTION, RESOLUTION)  # a writable copy owned by torch
    y = torch.from_numpy(labels.astype(np.int64))
    return ArrayDataset(x, y, NUM_CLASSES, f"fashion_mnist/{split}", list(CLASS_NAMES))
