"""An image folder (PNG, JPEG, BMP, and WebP when Pillow supports it), loaded whole into memory.

Every image is decoded once at load time and kept as uint8 (N, C, R, R), so memory is N * C * R * R bytes:
fine for folders of up to a few hundred thousand small images. For larger ones build a store once
(`steadydiff dataset build FOLDER --out STORE --resolution R`, the same rules) and train with data.name=store.

Rules:
- Files are found recursively under `data.root` (hidden files and folders skipped) and ordered by their
  path relative to the root, so the order is the same on every machine. `data.max_items` keeps the first N.
- With `data.labels`, each immediate sub-folder of the root is a class; classes are the sorted folder names
  and a class index is its position in that list. Images directly in the root are then an error.
- Channels: if ALL loaded images are grayscale (Pillow modes 1, L, LA, I, I;16*, F) the data is 1-channel
  (mode L); otherwise every image is converted to RGB (grayscale ones are replicated to 3 channels; palette
  images count as colour). Transparency is composited onto white. EXIF orientation is applied.
- Geometry: resized (Pillow bicubic, antialiased) so the short side equals `data.resolution`, then the
  centre `resolution` x `resolution` square is cropped. Values are x / 127.5 - 1, in [-1, 1].
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, features

from .base import ArrayDataset, DataError

GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}


def image_extensions() -> tuple[str, ...]:
    exts = [".png", ".jpg", ".jpeg", ".bmp"]
    if features.check("webp"):
        exts.append(".webp")
    return tuple(exts)


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def list_images(directory: Path, exts: tuple[str, ...]) -> list[Path]:
    """Image files under `directory`, recursively, sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
        dirnames[:] = [d for d in dirnames if not is_hidden(d)]
        for f in filenames:
            if not is_hidden(f) and f.lower().endswith(exts):
                found.append(Path(dirpath) / f)
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def _to_gray_l(img: Image.Image) -> Image.Image:
    """A grayscale image of any single-band mode as 8-bit L (alpha composited onto white)."""
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        arr = np.asarray(img).astype(np.int64)
        top = 65535 if img.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255
        return Image.fromarray((np.clip(arr, 0, top) * 255 // top).astype(np.uint8), mode="L")
    if img.mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        scale = 255.0 if arr.max(initial=0.0) <= 1.0 else 1.0
        return Image.fromarray(np.clip(arr * scale, 0, 255).round().astype(np.uint8), mode="L")
    if img.mode == "LA":
        background = Image.new("L", img.size, 255)
        background.paste(img.getchannel("L"), mask=img.getchannel("A"))
        return background
    return img.convert("L")


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "PA", "P", "LA", "La", "RGBa") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def resize_crop(img: Image.Image, resolution: int) -> Image.Image:
    w, h = img.size
    scale = resolution / min(w, h)
    nw, nh = max(resolution, round(w * scale)), max(resolution, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - resolution) // 2, (nh - resolution) // 2
    return img.crop((left, top, left + resolution, top + resolution))


def load_image(path, resolution: int, name: str | None = None) -> tuple[np.ndarray, bool]:
    """(uint8 array (R, R) for grayscale or (R, R, 3) for colour, is_gray) of an image file or file object;
    `name` is what errors call it (default: the path)."""
    try:
        with Image.open(path) as opened:
            opened.load()
            img = ImageOps.exif_transpose(opened)
            gray = img.mode in GRAY_MODES
            img = _to_gray_l(img) if gray else _to_rgb(img)
            img = resize_crop(img, resolution)
            return np.asarray(img, dtype=np.uint8), gray
    except MemoryError:
        raise
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, DecompressionBombError...
        raise DataError(
            f"image {name or path} is corrupt or unreadable ({type(e).__name__}: {e}); remove or replace it"
        ) from e


def class_folders(root: Path, exts: tuple[str, ...]) -> tuple[list[str], list[Path], list[int]]:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not is_hidden(p.name))
    if not classes:
        raise DataError(
            f"data.labels=true but {root} has no class sub-folders; put images in {root}/<class_name>/ "
            "or set data.labels=false"
        )
    loose = sorted(
        p for p in root.iterdir() if p.is_file() and not is_hidden(p.name) and p.name.lower().endswith(exts)
    )
    if loose:
        raise DataError(
            f"data.labels=true but {len(loose)} image(s) lie directly in {root} (e.g. {loose[0].name}); "
            f"move them into a class sub-folder {root}/<class_name>/ or set data.labels=false"
        )
    files: list[Path] = []
    labels: list[int] = []
    for index, name in enumerate(classes):
        found = list_images(root / name, exts)
        if not found:
            raise DataError(
                f"class folder {root / name} holds no images ({', '.join(exts)}); "
                "add images or remove the folder"
            )
        files += found
        labels += [index] * len(found)
    return classes, files, labels


def load_folder(
    root: str | None, resolution: int, labels: bool = False, max_items: int | None = None
) -> ArrayDataset:
    """The images under `root` as (N, C, resolution, resolution) uint8 (read as x / 127.5 - 1); see the
    module rules."""
    if not root:
        raise DataError("the folder dataset needs data.root=PATH/TO/IMAGES")
    base = Path(root).expanduser()
    if not base.is_dir():
        what = "is not a directory" if base.exists() else "does not exist"
        raise DataError(f"data.root={root} {what}; set data.root to the folder holding your images")
    if resolution < 1:
        raise DataError(f"data.resolution must be >= 1, got {resolution}")
    if max_items is not None and max_items < 1:
        raise DataError(f"data.max_items must be >= 1 or null, got {max_items}")
    exts = image_extensions()
    class_names: list[str] | None = None
    if labels:
        class_names, files, label_list = class_folders(base, exts)
    else:
        files, label_list = list_images(base, exts), []
    if not files:
        raise DataError(
            f"no images ({', '.join(exts)}) found under data.root={root}; add images or fix data.root"
        )
    if max_items is not None:
        files, label_list = files[:max_items], label_list[:max_items]

    arrays, grays = zip(*(load_image(p, resolution) for p in files))
    if all(grays):
        stacked = np.stack(arrays)[:, None]  # (N, 1, R, R)
    else:
        rgb = [np.repeat(a[:, :, None], 3, axis=2) if g else a for a, g in zip(arrays, grays)]
        stacked = np.stack(rgb).transpose(0, 3, 1, 2)  # (N, 3, R, R)
    x = torch.from_numpy(np.ascontiguousarray(stacked, dtype=np.uint8))
    if labels:
        y = torch.tensor(label_list, dtype=torch.int64)
        return ArrayDataset(x, y, len(class_names or []), f"folder/{base.name}", class_names)
    return ArrayDataset(x, None, 0, f"folder/{base.name}")
