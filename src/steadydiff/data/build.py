"""`steadydiff dataset build SRC --out STORE`: any image source into a store (see `data/store.py`).

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

Images are decoded in `workers` processes, `shard_size` at a time. Every finished shard is recorded in
STORE.partial/progress.json, so that a killed build, re-run with the same arguments, continues from the next
shard; dataset.json is written last and the staging directory then renamed to STORE, so a store that looks
complete is complete. Unreadable images are skipped and counted (or fatal with `strict`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.io import atomic_write_text
from .base import DataError
from .folder import _GRAY_MODES, _class_folders, _hidden, _list_images, _load_one, _resize_crop, image_extensions
from .store import FORMAT, INDEX, VERSION, file_sha256

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
        arr, gray = _load_one(_open_member(ref), resolution, name=name)
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
    channels = 1 if all(m in _GRAY_MODES for m in modes if m is not None) else 3

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
        names, files, ys = _class_folders(root, exts)
    else:
        names, files, ys = None, _list_images(root, exts), None
    return _image_source([(str(f), None) for f in files], ys, names, resolution, f"folder {root}", pool)


def _zip_source(path: Path, resolution: int | None, labels: bool, pool) -> Source:
    exts = image_extensions()
    try:
        with zipfile.ZipFile(path) as z:
            members = sorted(n for n in z.namelist() if not n.endswith("/") and n.lower().endswith(exts)
                             and not any(_hidden(p) or p == "__MACOSX" for p in n.split("/")))
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
                arr = np.asarray(_resize_crop(pil, res), dtype=np.uint8)
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
    channels = 1 if all(m in _GRAY_MODES for m in modes) else 3

    def read(items: Sequence[int], pool) -> tuple[np.ndarray, list[int], list[str]]:
        from .folder import _to_gray_l, _to_rgb

        out = np.empty((len(items), channels, resolution, resolution), np.uint8)
        for k, i in enumerate(items):
            img = hf[int(i)][column]
            img = _to_gray_l(img) if channels == 1 else _to_rgb(img)
            arr = np.asarray(_resize_crop(img, resolution), dtype=np.uint8)
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


# ------------------------------------------------------------------------------------------------------------
# The build

def _save_npy(path: Path, arr: np.ndarray) -> str:
    """Write `arr` to `path` through a temporary file and a rename; return its SHA-256."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return file_sha256(path)


def build_store(src: str | Source, out: str | Path, resolution: int | None = None, labels: bool = False,
                shard_size: int = 10_000, workers: int | None = None, strict: bool = False,
                progress: bool = True) -> dict[str, Any]:
    """Build the store `out` from `src` (see the module doc; or a ready `Source`) and return its dataset.json
    content."""
    from tqdm import tqdm

    out = Path(out)
    if (out / INDEX).exists():
        raise DataError(f"{out} is already a complete store; choose another --out, or delete it to rebuild")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists and is not an empty directory; choose a new path")
    if shard_size < 1:
        raise DataError(f"--shard-size must be >= 1, got {shard_size}")
    workers = min(8, os.cpu_count() or 1) if workers is None else workers
    stage = out.with_name(out.name + ".partial")
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 0 else None
    try:
        source = src if isinstance(src, Source) else open_source(src, resolution, labels, pool)
        plan = {"source": source.description, "count": source.count, "resolution": source.resolution,
                "channels": source.channels, "labels": source.labels is not None, "shard_size": shard_size,
                "resize": source.resize}
        record: dict[str, Any] = {"plan": plan, "shards": [], "skipped": 0, "errors": []}
        progress_file = stage / "progress.json"
        if progress_file.is_file():
            previous = json.loads(progress_file.read_text())
            if previous.get("plan") != plan:
                raise DataError(f"{stage} is an unfinished build of other arguments ({previous.get('plan')}); "
                                f"re-run those, or delete {stage} to start over")
            record = previous
        stage.mkdir(parents=True, exist_ok=True)
        n_shards = -(-source.count // shard_size)
        bar = tqdm(total=source.count, desc="build" if source.finalize is None else "encode", unit="img",
                   disable=not progress,
                   initial=min(source.count, len(record["shards"]) * shard_size))
        for j in range(len(record["shards"]), n_shards):
            items = list(range(j * shard_size, min((j + 1) * shard_size, source.count)))
            imgs, kept, errors = source.read(items, pool)
            if errors and strict:
                if not record["shards"]:  # nothing to continue from: leave no trace
                    shutil.rmtree(stage, ignore_errors=True)
                raise DataError(f"{errors[0]} (--strict: the build stops at the first unreadable image; drop "
                                "--strict to skip them)")
            entry: dict[str, Any] = {"file": f"shard-{j:05d}.npy", "count": len(kept),
                                     "sha256": _save_npy(stage / f"shard-{j:05d}.npy", imgs)}
            if source.labels is not None:
                entry["labels_file"] = f"shard-{j:05d}.labels.npy"
                entry["labels_sha256"] = _save_npy(stage / entry["labels_file"],
                                                   source.labels[[items[k] for k in kept]])
            record["shards"].append(entry)
            record["skipped"] += len(errors)
            record["errors"] = (record["errors"] + errors)[:20]
            atomic_write_text(progress_file, json.dumps(record, indent=1) + "\n")
            bar.update(len(items))
        bar.close()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    count = sum(e["count"] for e in record["shards"])
    if count == 0:
        raise DataError(f"no image of {source.description} could be read ({record['errors'][:1]}); check SRC")
    meta = {"format": FORMAT, "version": VERSION, "count": count,
            "shape": [source.channels, source.resolution, source.resolution], "dtype": "uint8",
            "labels": source.labels is not None, "num_classes": len(source.class_names or []),
            "class_names": source.class_names, "source": source.description, "resize": source.resize,
            "skipped": record["skipped"], "shards": record["shards"]}
    if source.dtype != "uint8":
        meta.update(dtype=source.dtype, row_shape=list(source.row_shape))
    if source.finalize is not None:
        meta.update(source.finalize(stage, record["shards"]))
    atomic_write_text(stage / INDEX, json.dumps(meta, indent=1) + "\n")
    (stage / "progress.json").unlink()
    if out.exists():
        out.rmdir()  # the empty directory checked above
    os.replace(stage, out)
    return meta


def store_info(root: str | Path) -> str:
    """A few lines describing the store at `root`."""
    from .store import read_index

    meta = read_index(root)
    root = Path(root)
    size = sum((root / e["file"]).stat().st_size for e in meta["shards"] if (root / e["file"]).exists())
    names = meta.get("class_names") or []
    classes = f"{len(names)} classes ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})" if meta[
        "labels"] else "no labels"
    what = "images" if meta.get("latent") is None else f"latents (VAE {meta['latent']['vae']['source']})"
    return "\n".join([
        f"store {root}: {meta['count']} {what} of {'x'.join(str(s) for s in meta['shape'])} "
        f"{meta.get('dtype', 'uint8')}, {classes}",
        f"source: {meta['source']}; resize: {meta['resize']}; skipped while building: {meta.get('skipped', 0)}",
        f"{len(meta['shards'])} shards, {size / 2**20:.1f} MiB; format {meta['format']} v{meta['version']}",
    ])

