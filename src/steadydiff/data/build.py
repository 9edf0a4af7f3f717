"""`steadydiff dataset build SRC --out STORE`: any image source (`data/sources.py`) into a store (see
`data/store.py`).

Images are decoded in `workers` processes, `shard_size` at a time. Every finished shard is recorded in
STORE.partial/progress.json, so that a killed build, re-run with the same arguments, continues from the next
shard; dataset.json is written last and the staging directory then renamed to STORE, so a store that looks
complete is complete. Unreadable images are skipped and counted (or fatal with `strict`).
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.io import atomic_write, atomic_write_text
from .base import DataError
from .sources import Source, open_source
from .store import FORMAT, INDEX, VERSION, file_sha256

# ------------------------------------------------------------------------------------------------------------
# The build

def _save_npy(path: Path, arr: np.ndarray) -> str:
    """Write `arr` to `path` through a temporary file and a rename; return its SHA-256."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would append ".npy" to a temporary path
            np.save(f, arr, allow_pickle=False)

    atomic_write(path, write)
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

