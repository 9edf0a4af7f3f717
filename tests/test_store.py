"""Dataset stores (`steadydiff dataset build`, data.name=store): round trips bit for bit, training on a store
equals training in memory, a killed build continues and never looks complete, bad input is one clear line,
and memory does not grow with the store."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import UVIT, rgb_tree
from steadydiff.cli import main
from steadydiff.config import DataConfig, load_config
from steadydiff.data import DataError, build_store, load_dataset, open_store, read_index, verify_store
from steadydiff.data import build as build_mod
from steadydiff.train import Trainer


def arrays(n: int = 23, res: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.integers(0, 256, (n, res, res, 3), dtype=np.uint8), g.integers(0, 4, n)


def floats(ds) -> torch.Tensor:
    return ds.items_range(0, len(ds))


def test_folder_store_equals_the_in_memory_folder_bit_for_bit(tmp_path):
    rgb_tree(tmp_path / "imgs")
    meta = build_store(str(tmp_path / "imgs"), tmp_path / "st", resolution=8, labels=True, shard_size=3,
                       workers=2, progress=False)
    assert meta["count"] == 10 and len(meta["shards"]) == 4 and meta["class_names"] == ["ants", "bees"]
    mem = load_dataset(DataConfig(name="folder", root=str(tmp_path / "imgs"), resolution=8, labels=True))
    st = load_dataset(DataConfig(name="store", root=str(tmp_path / "st"), resolution=8, labels=True))
    assert len(st) == 10 and st.sample_shape == (3, 8, 8) and st.class_names == ["ants", "bees"]
    assert torch.equal(floats(st), floats(mem)) and torch.equal(st.labels, mem.labels)
    idx = torch.tensor([9, 0, 4, 4, 7])
    assert torch.equal(st.items(idx), mem.items(idx))


def test_zip_store_equals_the_folder_store(tmp_path):
    rgb_tree(tmp_path / "imgs")
    with zipfile.ZipFile(tmp_path / "imgs.zip", "w") as z:
        for p in sorted((tmp_path / "imgs").rglob("*.png")):
            z.write(p, p.relative_to(tmp_path / "imgs").as_posix())
        z.writestr("__MACOSX/ants/._00.png", b"junk")  # skipped like hidden files
    build_store(str(tmp_path / "imgs"), tmp_path / "a", resolution=8, labels=True, workers=0, progress=False)
    build_store(str(tmp_path / "imgs.zip"), tmp_path / "b", resolution=8, labels=True, workers=0, progress=False)
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    assert torch.equal(floats(a), floats(b)) and torch.equal(a.labels, b.labels) and a.class_names == b.class_names


def test_npz_store_round_trip_and_resize(tmp_path):
    x, y = arrays()
    np.savez(tmp_path / "d.npz", images=x, labels=y)
    build_store(str(tmp_path / "d.npz"), tmp_path / "st", labels=True, shard_size=5, progress=False)
    st = open_store(tmp_path / "st")
    expect = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).float() / 127.5 - 1
    assert torch.equal(floats(st), expect) and st.labels.tolist() == y.tolist() and st.num_classes == 4
    # Grayscale (N, H, W) without labels, resized 8 -> 4 on build.
    np.save(tmp_path / "g.npy", x[..., 0])
    build_store(str(tmp_path / "g.npy"), tmp_path / "g", resolution=4, progress=False)
    g = open_store(tmp_path / "g")
    assert g.sample_shape == (1, 4, 4) and g.labels is None and "centre 4x4 crop" in g.meta["resize"]


def test_fashion_mnist_store_equals_the_built_in_dataset(tmp_path, monkeypatch):
    # A small fake Fashion-MNIST in the idx format, found through STEADYDIFF_DATA.
    import gzip

    g = np.random.default_rng(1)
    imgs, labs = g.integers(0, 256, (12, 28, 28), dtype=np.uint8), g.integers(0, 10, 12).astype(np.uint8)
    d = tmp_path / "fm"
    d.mkdir()
    for stem in ("train", "t10k"):
        with gzip.open(d / f"{stem}-images-idx3-ubyte.gz", "wb") as f:
            f.write(np.array([0, 0, 8, 3], ">u1").tobytes() + np.array([12, 28, 28], ">u4").tobytes() + imgs.tobytes())
        with gzip.open(d / f"{stem}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(np.array([0, 0, 8, 1], ">u1").tobytes() + np.array([12], ">u4").tobytes() + labs.tobytes())
    monkeypatch.setenv("STEADYDIFF_DATA", str(d))
    build_store("fashion_mnist", tmp_path / "st", labels=True, progress=False)
    mem = load_dataset(DataConfig(name="fashion_mnist"))
    st = load_dataset(DataConfig(name="store", root=str(tmp_path / "st")))
    assert torch.equal(floats(st), floats(mem)) and torch.equal(st.labels, mem.labels)
    assert st.class_names == mem.class_names and st.digest() != mem.digest()  # store digests hash its files


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_training_on_a_store_reproduces_training_in_memory_and_resumes_exactly(tmp_path, assert_resume_exact):
    rgb_tree(tmp_path / "imgs", n_per_class=12)
    build_store(str(tmp_path / "imgs"), tmp_path / "st", resolution=8, shard_size=5, workers=0, progress=False)
    mem = load_config(None, UVIT + ["data.name=folder", f"data.root={tmp_path / 'imgs'}"])
    Trainer(mem, tmp_path / "mem", show_progress=False).fit()
    # On the store: 6 steps in one go, and stopped at step 3 and resumed: the same trajectory (same losses).
    runs = assert_resume_exact(UVIT + ["data.name=store", f"data.root={tmp_path / 'st'}"], 6, split=3, losses=0)
    assert _losses(tmp_path / "mem") == _losses(runs.full) and len(_losses(tmp_path / "mem")) == 6
    assert _losses(runs.split) == _losses(runs.full)


def test_a_killed_build_never_looks_complete_and_continues(tmp_path, monkeypatch):
    x, y = arrays(n=20)
    np.savez(tmp_path / "d.npz", images=x, labels=y)
    build_store(str(tmp_path / "d.npz"), tmp_path / "clean", labels=True, shard_size=4, progress=False)
    real_save, calls = build_mod._save_npy, []

    def dying(path, arr):
        calls.append(path.name)
        if len(calls) == 5:  # in the middle of shard 2 (images 0, labels 0, images 1, labels 1, images 2)
            raise KeyboardInterrupt
        return real_save(path, arr)

    monkeypatch.setattr(build_mod, "_save_npy", dying)
    with pytest.raises(KeyboardInterrupt):
        build_store(str(tmp_path / "d.npz"), tmp_path / "st", labels=True, shard_size=4, progress=False)
    with pytest.raises(DataError, match="unfinished build"):
        open_store(tmp_path / "st")
    assert main(["train", "--config", "configs/demo.yaml", "--out", str(tmp_path / "r"), "--set", "data.name=store",
                 "--set", f"data.root={tmp_path / 'st'}"]) == 2
    # Re-run: shards 0 and 1 are kept; 2, 3, 4 are written; the result equals an uninterrupted build.
    monkeypatch.setattr(build_mod, "_save_npy", real_save)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "st.partial").glob("shard-0000[01]*.npy")}
    meta = build_store(str(tmp_path / "d.npz"), tmp_path / "st", labels=True, shard_size=4, progress=False)
    assert before == {p.name: (tmp_path / "st" / p.name).stat().st_mtime_ns for p in map(Path, before)}
    assert meta["shards"] == read_index(tmp_path / "clean")["shards"]
    assert not (tmp_path / "st.partial").exists() and verify_store(tmp_path / "st")["count"] == 20
    # A partial build of other arguments is refused, not mixed.
    (tmp_path / "other.partial").mkdir()
    (tmp_path / "other.partial" / "progress.json").write_text(json.dumps({"plan": {"source": "elsewhere"}}))
    with pytest.raises(DataError, match="unfinished build of other arguments"):
        build_store(str(tmp_path / "d.npz"), tmp_path / "other", labels=True, shard_size=4, progress=False)


def _store(tmp_path: Path, **kw) -> Path:
    x, y = arrays(n=10)
    np.savez(tmp_path / "d.npz", images=x, labels=y)
    build_store(str(tmp_path / "d.npz"), tmp_path / "st", shard_size=4, progress=False, **kw)
    return tmp_path / "st"


def test_damaged_stores_are_refused_with_the_fix(tmp_path):
    st = _store(tmp_path, labels=True)
    shard = st / "shard-00001.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])  # truncated
    with pytest.raises(DataError, match="truncated or corrupt.*dataset verify"):
        open_store(st)
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    open_store(st)  # opening checks shapes only...
    with pytest.raises(DataError, match="shard-00001.npy fails its checksum"):
        verify_store(st)  # ...verify re-hashes
    shard.unlink()
    with pytest.raises(DataError, match="shard-00001.npy is missing"):
        open_store(st)
    meta = json.loads((st / "dataset.json").read_text())
    (st / "dataset.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(DataError, match="format version 99, newer than this steadydiff reads"):
        open_store(st)


@pytest.mark.parametrize("overrides,needle", [
    (["data.resolution=16"], "holds images of 8x8 but data.resolution=16; set data.resolution=8"),
    (["data.labels=true"], "has no labels; rebuild it with --labels"),
])
def test_store_config_mismatches_are_one_line_errors(tmp_path, capsys, overrides, needle):
    st = _store(tmp_path)
    args = ["train", "--config", "configs/demo.yaml", "--out", str(tmp_path / "run"), "--set", "data.name=store",
            "--set", f"data.root={st}", "--set", "data.resolution=8"] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and not (tmp_path / "run").exists()


def test_build_bad_input(tmp_path, capsys):
    st = _store(tmp_path)
    assert main(["dataset", "build", str(tmp_path / "d.npz"), "--out", str(st), "--quiet"]) == 2
    assert "already a complete store" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["dataset", "build", str(tmp_path / "empty"), "--out", str(tmp_path / "e"), "--resolution", "8"]) == 2
    assert "holds no images" in capsys.readouterr().err
    assert main(["dataset", "build", str(tmp_path / "nope.zip"), "--out", str(tmp_path / "n")]) == 2
    assert "does not exist" in capsys.readouterr().err
    np.save(tmp_path / "f.npy", np.zeros((3, 8, 8), np.float32))
    assert main(["dataset", "build", str(tmp_path / "f.npy"), "--out", str(tmp_path / "f")]) == 2
    assert "store uint8 pixels" in capsys.readouterr().err
    np.save(tmp_path / "u.npy", np.zeros((3, 8, 8), np.uint8))
    assert main(["dataset", "build", str(tmp_path / "u.npy"), "--out", str(tmp_path / "u"), "--labels"]) == 2
    assert "has no array named 'labels'" in capsys.readouterr().err
    assert main(["dataset", "info", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "f").exists()


def test_unreadable_images_are_skipped_and_counted_or_fatal_with_strict(tmp_path, capsys):
    rgb_tree(tmp_path / "imgs", n_per_class=3)
    (tmp_path / "imgs" / "ants" / "zz.png").write_bytes(b"not a png")
    assert main(["dataset", "build", str(tmp_path / "imgs"), "--out", str(tmp_path / "s"), "--resolution", "8",
                 "--labels", "--workers", "0", "--strict", "--quiet"]) == 2
    assert "zz.png is corrupt or unreadable" in capsys.readouterr().err and not (tmp_path / "s").exists()
    assert main(["dataset", "build", str(tmp_path / "imgs"), "--out", str(tmp_path / "t"), "--resolution", "8",
                 "--labels", "--workers", "0", "--quiet"]) == 0
    assert "6 images; skipped 1 unreadable" in capsys.readouterr().out
    st = open_store(tmp_path / "t")
    assert len(st) == 6 and st.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert main(["dataset", "verify", str(tmp_path / "t")]) == 0 and "verified, 6 images" in capsys.readouterr().out


RSS_PROBE = textwrap.dedent("""
    import sys, torch
    from steadydiff.config import DataConfig
    from steadydiff.data import load_dataset

    def rss():  # private (anonymous) memory: mapped store pages are page cache the kernel can drop, not ours
        line = next(ln for ln in open("/proc/self/status") if ln.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024
    torch.zeros(1)
    base = rss()
    ds = load_dataset(DataConfig(name="store", root=sys.argv[1], resolution=32, cache=sys.argv[2]))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ds.items(torch.randint(0, len(ds), (64,), generator=g))
    print(rss() - base)
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_memory_does_not_grow_with_the_store(tmp_path):
    """Private RSS (RssAnon) after opening a 60 MiB store and reading 20 batches stays small; loading it to RAM (the
    control) shows the measurement sees 60 MiB when it is there."""
    n = 20_000
    x = np.random.default_rng(0).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    np.save(tmp_path / "big.npy", x)
    del x
    build_store(str(tmp_path / "big.npy"), tmp_path / "st", shard_size=4000, progress=False)
    (tmp_path / "big.npy").unlink()

    def grow(cache: str) -> int:
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(tmp_path / "st"), cache], capture_output=True,
                             text=True, check=True)
        return int(out.stdout.strip())

    size = n * 3 * 32 * 32
    mapped, in_ram = grow("none"), grow("ram")
    assert mapped < 0.25 * size, (mapped, size)
    assert in_ram > 0.9 * size, (in_ram, size)


def test_a_rank_slice_reads_the_rows_and_flips_of_the_whole_batch():
    from steadydiff.data import ArrayDataset, get_batch

    ds = ArrayDataset(torch.randint(0, 256, (30, 3, 4, 4), dtype=torch.uint8), torch.arange(30) % 3, 3, "u8")
    idx = torch.randperm(30)[:12]
    whole, y = get_batch(ds, idx, True, torch.Generator().manual_seed(5))
    for part in (slice(0, 4), slice(4, 8), slice(8, 12)):
        x, yk = get_batch(ds, idx, True, torch.Generator().manual_seed(5), keep=part)
        assert torch.equal(x, whole[part]) and torch.equal(yk, y[part])


def test_prefetcher_returns_fn_of_k_in_any_order_and_after_jumps():
    import threading

    from steadydiff.data import Prefetcher

    seen_threads = set()

    def fn(k):
        seen_threads.add(threading.current_thread().name)
        return k * k

    p = Prefetcher(fn, workers=3)
    assert [p.get(k) for k in range(10)] == [k * k for k in range(10)]
    assert p.get(50) == 2500 and p.get(51) == 2601 and p.get(3) == 9  # a resume, a jump back
    assert all(name.startswith("steadydiff-loader") for name in seen_threads)
    p.close()
    assert p.get(4) == 16  # restarts after close
    p.close()
    assert Prefetcher(fn, workers=0).get(7) == 49


def test_loader_workers_do_not_change_the_trajectory(tmp_path):
    rgb_tree(tmp_path / "imgs", n_per_class=12)
    base = UVIT + ["data.name=folder", f"data.root={tmp_path / 'imgs'}"]
    runs = {}
    for w in (0, 3):
        Trainer(load_config(None, base + [f"data.workers={w}"]), tmp_path / f"w{w}", show_progress=False).fit()
        runs[w] = _losses(tmp_path / f"w{w}")
    assert runs[0] == runs[3] and len(runs[0]) == 6


def _cifar_tar(path: Path, n: int = 4) -> dict:
    import pickle
    import tarfile

    g = np.random.default_rng(2)
    batches = {}
    with tarfile.open(path, "w:gz") as tar:
        def add(name, obj):
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            batches[name] = {b"data": g.integers(0, 256, (n, 3072), dtype=np.uint8),
                             b"labels": g.integers(0, 10, n).tolist()}
            add(name, batches[name])
        add("batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    return batches


def test_cifar10_archive_store(tmp_path):
    batches = _cifar_tar(tmp_path / "cifar-10-python.tar.gz")
    build_store(str(tmp_path / "cifar-10-python.tar.gz"), tmp_path / "tr", labels=True, progress=False)
    build_store(f"cifar10-test:{tmp_path / 'cifar-10-python.tar.gz'}", tmp_path / "te", labels=True, progress=False)
    tr, te = open_store(tmp_path / "tr"), open_store(tmp_path / "te")
    assert len(tr) == 20 and len(te) == 4 and tr.sample_shape == (3, 32, 32) and tr.class_names[3] == "c3"
    first = batches["data_batch_1"][b"data"][0].reshape(3, 32, 32)  # CIFAR rows are channel planes
    assert torch.equal(tr.items(torch.tensor([0]))[0], torch.from_numpy(first).float() / 127.5 - 1)
    assert te.labels.tolist() == batches["test_batch"][b"labels"]


def test_an_archive_pickle_cannot_run_code(tmp_path):
    import pickle
    import tarfile

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["batches.meta"]:
            data = pickle.dumps(Evil())
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(DataError, match="not allowed in a dataset archive"):
        build_store(str(tmp_path / "evil.tar.gz"), tmp_path / "st", progress=False)
    assert not (tmp_path / "pwned").exists()


def test_hugging_face_source_equals_the_same_images_as_a_folder(tmp_path, monkeypatch):
    """hf:NAME goes through `datasets.load_dataset` (an optional extra; this test needs it installed). A local
    parquet dataset stands in for the hub: no network."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rgb_tree(tmp_path / "imgs", n_per_class=3)
    files = sorted((tmp_path / "imgs").rglob("*.png"))
    images = [Image.open(f).convert("RGB") for f in files]
    labels = [0 if f.parent.name == "ants" else 1 for f in files]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["ants", "bees"])})
    (tmp_path / "hf" / "data").mkdir(parents=True)
    datasets.Dataset.from_dict({"image": images, "label": labels}, features=feats).to_parquet(
        str(tmp_path / "hf" / "data" / "train-00000-of-00001.parquet"))
    build_store(f"hf:{tmp_path / 'hf'}", tmp_path / "a", resolution=8, labels=True, progress=False)
    build_store(str(tmp_path / "imgs"), tmp_path / "b", resolution=8, labels=True, workers=0, progress=False)
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    assert torch.equal(floats(a), floats(b)) and torch.equal(a.labels, b.labels)
    assert a.class_names == b.class_names == ["ants", "bees"]
