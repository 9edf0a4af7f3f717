"""Image sources for `steadydiff dataset build`: each opens as a `Source` (count, channels, resolution, labels,
and a `read(start, stop)` that decodes a range to uint8), which `data/build.py` writes into a store.

Sources (`open_source`):
    a directory          image folder, the rules of `data/folder.py` (recursive, sorted, labels from the
                         immediate sub-folders, resize + centre crop, all-grayscale -> 1 channel else RGB)
    a .zip file          the same rules over the images inside it (labels from their first path component)
    a .npz / .npy file   uint8 images (N, H, W) or (N, H, W, C); in a .npz the images are the array named
                         images / x / arr_0 (or the only array) and the labels labels / y, if present
    fashion_mnist[:test] the built-in Fashion-MNIST (train split unless :test)
    cifar-10-python.tar.gz  the CIFAR-10 archive as downloaded from https://www.cs.toronto.edu/~kriz/ (train
                         split: data_batch_1..5; `cifar10-test:PATH` for test_batch), labels and class names
    hf:NAME[:SPLIT]      a Hugging Face `datasets` dataset (an optional extra: pip install datasets), its
                         image column `image` or `img`, labels from `label` / `labels` when asked for; its
                         channels (1 if all grayscale, else 3) are decided from the first 64 images, since
                         reading every image's mode would decode the whole dataset twice
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .base import DataError
from .folder import GRAY_MODES, class_folders, image_extensions, is_hidden, list_images, load_image, resize_crop

RESIZE_RULE = "short side to {r} (Pillow bicubic, antialiased), then the centre {r}x{r} crop"


@dataclass
class Source:
    """What a build reads: `count` items of shape (channels, resolution, resolution); `read(items, pool)`
    returns the uint8 images of those item numbers that could be read, their positions, and error texts."""

    description: str
    count: int
    channels: int
    resolution: int
    labels: np.ndarray | None
    class_names: list[str] | None
    resize: str
    read: Callable[[Sequence[int], Any], tuple[np.ndarray, list[int], list[str]]]
    # Other stores than uint8 images (a latent store, `data/latent.py`): the rows' dtype and shape, and what
    # goes into dataset.json besides the usual fields, computed from the finished shards.
    dtype: str = "uint8"
    row_shape: tuple[int, ...] | None = None
    finalize: Callable[[Path, list[dict[str, Any]]], dict[str, Any]] | None = None


# ------------------------------------------------------------------------------------------------------------
# Image files (a folder or a zip): decoded one by one, in worker processes

_ZIPS: dict[str, zipfile.ZipFile] = {}  # per worker process: open zip files by path


def _open_member(ref: tuple[str, str | None]):
    path, member = ref
    if member is None:
        return path
    if path not in _ZIPS:
        _ZIPS[path] = zipfile.ZipFile(path)
    return io.BytesIO(_ZIPS[path].read(member))


def _mode_of(ref: tuple[str, str | None]) -> str | None:
    from PIL import Image

    try:
        with Image.open(_open_member(ref)) as img:
            return img.mode
    except Exception:  # unreadable: decided (skipped or fatal) when it is decoded
        return None


def _decode(job: tuple[tuple[str, str | None], int, int]) -> tuple[np.ndarray | None, str]:
    ref, resolution, channels = job
    name = ref[0] if ref[1] is None else f"{ref[0]}:{ref[1]}"
    try:
        arr, gray = load_image(_open_member(ref), resolution, name=name)
    except DataError as e:
        return None, str(e)
    if gray:
        arr = arr[None] if channels == 1 else np.repeat(arr[None], 3, axis=0)
    else:
        arr = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr), ""


def _map(pool, fn, jobs: list) -> list:
    if pool is None:
        return [fn(j) for j in jobs]
    return list(pool.map(fn, jobs, chunksize=max(1, len(jobs) // 64)))


def _image_source(refs: list[tuple[str, str | None]], labels: list[int] | None, class_names: list[str] | None,
                  resolution: int | None, description: str, pool) -> Source:
    if not refs:
        raise DataError(f"{description} holds no images ({', '.join(image_extensions())}); add images or fix SRC")
    if resolution is None:
        raise DataError("an image folder or zip is resized on build: give --resolution R (e.g. 64)")
    modes = _map(pool, _mode_of, refs)
    channels = 1 if all(m in GRAY_MODES for m in modes if m is not None) else 3

    def read(items: Sequence[int], pool) -> tuple[np.ndarray, list[int], list[str]]:
        results = _map(pool, _decode, [(refs[i], resolution, channels) for i in items])
        kept = [k for k, (a, _) in enumerate(results) if a is not None]
        errors = [err for a, err in results if a is None]
        imgs = np.stack([results[k][0] for k in kept]) if kept else np.empty((0, channels, resolution, resolution),
                                                                             np.uint8)
        return imgs, kept, errors

    y = np.asarray(labels, dtype=np.int64) if labels is not None else None
    return Source(description, len(refs), channels, resolution, y, class_names, RESIZE_RULE.format(r=resolution),
                  read)


def _folder_source(root: Path, resolution: int | None, labels: bool, pool) -> Source:
    exts = image_extensions()
    if labels:
        names, files, ys = class_folders(root, exts)
    else:
        names, files, ys = None, list_images(root, exts), None
    return _image_source([(str(f), None) for f in files], ys, names, resolution, f"folder {root}", pool)


def _zip_source(path: Path, resolution: int | None, labels: bool, pool) -> Source:
    exts = image_extensions()
    try:
        with zipfile.ZipFile(path) as z:
            members = sorted(n for n in z.namelist() if not n.endswith("/") and n.lower().endswith(exts)
                             and not any(is_hidden(p) or p == "__MACOSX" for p in n.split("/")))
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{path} is not a readable zip file ({e}); check the file or unpack it to a folder") from e
    names, ys = None, None
    if labels:
        loose = [m for m in members if "/" not in m]
        if loose:
            raise DataError(f"--labels, but {len(loose)} image(s) lie at the top of {path} (e.g. {loose[0]}); put "
                            "each image in a <class_name>/ folder inside the zip, or drop --labels")
        names = sorted({m.split("/", 1)[0] for m in members})
        ys = [names.index(m.split("/", 1)[0]) for m in members]
    return _image_source([(str(path), m) for m in members], ys, names, resolution, f"zip {path}", pool)


# ------------------------------------------------------------------------------------------------------------
# Arrays: already pixels; resized only when a different resolution is asked for

def _array_source(images: np.ndarray, labels: np.ndarray | None, class_names: list[str] | None,
                  resolution: int | None, description: str) -> Source:
    if images.dtype != np.uint8:
        raise DataError(f"{description}: images are {images.dtype}; store uint8 pixels 0-255 "
                        "(e.g. (x * 255).round().astype(np.uint8) for floats in [0, 1])")
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3):
        images = images.transpose(0, 3, 1, 2)
    else:
        raise DataError(f"{description}: images have shape {images.shape}; expected (N, H, W) or (N, H, W, C) "
                        "with C = 1 or 3")
    n, c, h, w = images.shape
    if n == 0:
        raise DataError(f"{description} holds no images; check SRC")
    if labels is not None and labels.shape != (n,):
        raise DataError(f"{description}: {n} images but labels of shape {labels.shape}; give one label per image")
    if labels is not None and labels.size and labels.min() < 0:
        raise DataError(f"{description}: labels must be class indices >= 0, got {int(labels.min())}")
    resize = resolution is not None and (resolution, resolution) != (h, w)
    if not resize and h != w:
        raise DataError(f"{description}: images are {h}x{w}, not square; give --resolution R to resize and "
                        "centre-crop them")
    res = resolution if resolution is not None else h

    def read(items: Sequence[int], pool) -> tuple[np.ndarray, list[int], list[str]]:
        block = np.ascontiguousarray(images[list(items)])
        if resize:
            from PIL import Image

            out = np.empty((len(block), c, res, res), np.uint8)
            for k, img in enumerate(block):
                pil = Image.fromarray(img[0] if c == 1 else img.transpose(1, 2, 0))
                arr = np.asarray(resize_crop(pil, res), dtype=np.uint8)
                out[k] = arr[None] if c == 1 else arr.transpose(2, 0, 1)
            block = out
        return block, list(range(len(items))), []

    y = None if labels is None else labels.astype(np.int64)
    return Source(description, n, c, res, y, class_names, RESIZE_RULE.format(r=res) if resize else "none", read)


def _npz_source(path: Path, resolution: int | None, labels: bool) -> Source:
    try:  # a .npy is memory-mapped: arrays larger than RAM build too
        loaded = np.load(path, allow_pickle=False, mmap_mode="r" if path.suffix.lower() == ".npy" else None)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable .npy/.npz file ({e}); check the file") from e
    if isinstance(loaded, np.ndarray):
        images, y = loaded, None
    else:
        keys = list(loaded.keys())
        image_key = next((k for k in ("images", "x", "arr_0") if k in keys), keys[0] if len(keys) == 1 else None)
        if image_key is None:
            raise DataError(f"{path} holds arrays {keys}; name the images 'images' (and the labels 'labels')")
        images = loaded[image_key]
        label_key = next((k for k in ("labels", "y") if k in keys), None)
        y = loaded[label_key] if label_key else None
    if labels and y is None:
        raise DataError(f"--labels, but {path} has no array named 'labels' or 'y'; add one or drop --labels")
    names = None
    if y is not None:
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: labels are {y.dtype}; store integer class indices")
        names = [str(i) for i in range(int(y.max()) + 1)] if y.size else []
    return _array_source(images, y if labels else None, names if labels else None, resolution, f"array {path}")


def _fashion_source(spec: str, resolution: int | None, labels: bool) -> Source:
    from .fashion_mnist import load_fashion_mnist

    split = spec.split(":", 1)[1] if ":" in spec else "train"
    ds = load_fashion_mnist(split)
    imgs = ds.data.numpy()[:, 0]
    y = ds.labels.numpy() if labels else None
    return _array_source(imgs, y, ds.class_names if labels else None, resolution, f"fashion_mnist/{split}")


CIFAR10_MEMBERS = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}


class _ArchiveUnpickler(pickle.Unpickler):
    """CIFAR's batches are Python pickles of a dict of bytes, lists and NumPy arrays; unpickle them allowing
    only those types (an archive is data, not code)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a dataset archive")
        return super().find_class(module, name)

    @classmethod
    def load_bytes(cls, data: bytes) -> Any:
        return cls(io.BytesIO(data), encoding="bytes").load()


def _cifar10_source(path: Path, split: str, resolution: int | None, labels: bool) -> Source:
    import tarfile

    try:
        with tarfile.open(path, "r:*") as tar:
            by_name = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            missing = [n for n in CIFAR10_MEMBERS[split] + ["batches.meta"] if n not in by_name]
            if missing:
                raise DataError(f"{path} is not the CIFAR-10 python archive (no {missing[0]}); download "
                                "cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html")
            batches = [_ArchiveUnpickler.load_bytes(tar.extractfile(by_name[n]).read()) for n in CIFAR10_MEMBERS[split]]
            meta = _ArchiveUnpickler.load_bytes(tar.extractfile(by_name["batches.meta"]).read())
    except (OSError, tarfile.TarError, pickle.UnpicklingError, EOFError) as e:
        raise DataError(f"{path} is not a readable CIFAR-10 archive ({e}); download it again") from e
    images = np.concatenate([b[b"data"] for b in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    y = np.concatenate([np.asarray(b[b"labels"], dtype=np.int64) for b in batches])
    names = [n.decode() for n in meta[b"label_names"]]
    return _array_source(np.ascontiguousarray(images, dtype=np.uint8), y if labels else None,
                         names if labels else None, resolution, f"cifar10/{split} {path}")


def _hf_source(spec: str, resolution: int | None, labels: bool) -> Source:
    try:
        import datasets  # optional extra
    except ImportError as e:
        raise DataError("hf: sources need the Hugging Face datasets package: pip install datasets") from e
    name, _, split = spec[3:].partition(":")
    hf = datasets.load_dataset(name, split=split or "train")
    column = next((c for c in ("image", "img") if c in hf.column_names), None)
    if column is None:
        raise DataError(f"hf:{name} has no image column (image or img); columns: {hf.column_names}")
    label_col = next((c for c in ("label", "labels") if c in hf.column_names), None)
    if labels and label_col is None:
        raise DataError(f"--labels, but hf:{name} has no label column; drop --labels")
    if resolution is None:
        raise DataError("a Hugging Face dataset is resized on build: give --resolution R")
    modes = [hf[i][column].mode for i in range(min(len(hf), 64))]
    channels = 1 if all(m in GRAY_MODES for m in modes) else 3

    def read(items: Sequence[int], pool) -> tuple[np.ndarray, list[int], list[str]]:
        from .folder import _to_gray_l, _to_rgb

        out = np.empty((len(items), channels, resolution, resolution), np.uint8)
        for k, i in enumerate(items):
            img = hf[int(i)][column]
            img = _to_gray_l(img) if channels == 1 else _to_rgb(img)
            arr = np.asarray(resize_crop(img, resolution), dtype=np.uint8)
            out[k] = arr[None] if channels == 1 else arr.transpose(2, 0, 1)
        return out, list(range(len(items))), []

    y = np.asarray(hf[label_col], dtype=np.int64) if labels else None
    names = None
    if labels:
        feature = hf.features[label_col]
        names = list(getattr(feature, "names", None) or [str(i) for i in range(int(y.max()) + 1)])
    return Source(f"hf:{name}:{split or 'train'}", len(hf), channels, resolution, y, names,
                  RESIZE_RULE.format(r=resolution), read)


def open_source(src: str, resolution: int | None = None, labels: bool = False, pool=None) -> Source:
    """The `Source` SRC names (see the module doc)."""
    if src == "fashion_mnist" or src.startswith("fashion_mnist:"):
        return _fashion_source(src, resolution, labels)
    if src.startswith("hf:"):
        return _hf_source(src, resolution, labels)
    if src.startswith("cifar10-test:"):
        return _cifar10_source(Path(src.split(":", 1)[1]).expanduser(), "test", resolution, labels)
    path = Path(src).expanduser()
    if path.is_dir():
        return _folder_source(path, resolution, labels, pool)
    if not path.exists():
        raise DataError(f"source {src} does not exist; give an image folder, a .zip, a .npz/.npy file, "
                        "fashion_mnist or hf:NAME")
    suffix = path.suffix.lower()
    if path.name.endswith((".tar.gz", ".tgz", ".tar")):
        return _cifar10_source(path, "train", resolution, labels)
    if suffix == ".zip":
        return _zip_source(path, resolution, labels, pool)
    if suffix in (".npz", ".npy"):
        return _npz_source(path, resolution, labels)
    raise DataError(f"source {src}: unknown kind {suffix or '(no suffix)'}; give an image folder, a .zip, a "
                    ".npz/.npy file, cifar-10-python.tar.gz, fashion_mnist or hf:NAME")
