"""Tests of steadydiff.data: Fashion-MNIST lookup/parsing/download, toy2d, image folders, sampler, batches."""

from __future__ import annotations

import gzip
import hashlib
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from steadydiff.config import DataConfig
from steadydiff.data import (
    TOY_KINDS,
    ArrayDataset,
    DataError,
    InfiniteSampler,
    get_batch,
    load_dataset,
    toy2d,
)
from steadydiff.data import fashion_mnist as fm

# ---------------------------------------------------------------------------------------------------------
# Helpers


def idx_bytes(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 0x08, arr.ndim]) + np.array(arr.shape, dtype=">u4").tobytes()
    return header + arr.tobytes()


def write_fashion(directory: Path, n: int = 5, seed: int = 0, gz_images: bool = True) -> dict:
    """Small synthetic idx files for both splits (images gzipped or not, labels plain)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, (img_stem, lbl_stem) in fm.SPLIT_FILES.items():
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        img = idx_bytes(images)
        if gz_images:
            (directory / (img_stem + ".gz")).write_bytes(gzip.compress(img))
        else:
            (directory / img_stem).write_bytes(img)
        (directory / lbl_stem).write_bytes(idx_bytes(labels))
        arrays[split] = images
    return arrays


@pytest.fixture
def no_fashion_sources(tmp_path, monkeypatch):
    """No STEADYDIFF_DATA, no Debian dir, an empty cache under tmp_path; returns the cache dir."""
    monkeypatch.delenv("STEADYDIFF_DATA", raising=False)
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no-debian")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "steadydiff" / "fashion-mnist"


def assert_one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


# ---------------------------------------------------------------------------------------------------------
# Fashion-MNIST


@pytest.mark.skipif(not fm.DEBIAN_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_fashion_mnist_from_debian_dir(monkeypatch):
    monkeypatch.delenv("STEADYDIFF_DATA", raising=False)
    train = load_dataset(DataConfig(name="fashion_mnist", split="train"))
    assert train.data.shape == (60000, 1, 28, 28) and train.data.dtype == torch.uint8  # 4x less RAM than floats
    assert train.sample_shape == (1, 28, 28) and len(train) == 60000
    assert train.items_range(0, 1000).min() == -1.0 and train.items_range(0, 1000).max() == 1.0
    assert train.labels is not None and train.labels.dtype == torch.int64
    assert train.num_classes == 10 and torch.equal(train.labels.bincount(), torch.full((10,), 6000))
    # x / 127.5 - 1 of the raw bytes, first image
    raw = fm.parse_idx(fm.read_payload(fm.DEBIAN_DIR / "train-images-idx3-ubyte.gz"), Path("x"), 3)
    assert torch.equal(train.items(torch.tensor([0]))[0, 0], torch.from_numpy(raw[0].astype(np.float32)) / 127.5 - 1)

    test = load_dataset(DataConfig(name="fashion_mnist", split="test", max_items=1234))
    assert test.data.shape == (1234, 1, 28, 28) and test.labels.shape == (1234,)
    assert set(test.labels.tolist()) == set(range(10)) and test.num_classes == 10


@pytest.mark.skipif(not fm.DEBIAN_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_sha256_constants_match_debian_files():
    for stem in ("train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert fm.payload_sha256(fm.DEBIAN_DIR / (stem + ".gz")) == fm.SHA256[stem]


@pytest.mark.parametrize("subdir", ["fashion-mnist", ""])
def test_fashion_lookup_honours_steadydiff_data(tmp_path, monkeypatch, subdir):
    arrays = write_fashion(tmp_path / "data" / subdir if subdir else tmp_path / "data", n=5)
    monkeypatch.setenv("STEADYDIFF_DATA", str(tmp_path / "data"))
    for split in ("train", "test"):
        ds = load_dataset(DataConfig(name="fashion_mnist", split=split))
        assert ds.data.shape == (5, 1, 28, 28) and ds.labels.tolist() == [0, 1, 2, 3, 4]
        expected = torch.from_numpy(arrays[split].astype(np.float32))[:, None] / 127.5 - 1
        assert torch.equal(ds.items_range(0, len(ds)), expected)


def test_fashion_root_wins_and_is_strict(tmp_path, monkeypatch):
    write_fashion(tmp_path / "env", n=5)
    write_fashion(tmp_path / "explicit", n=3, gz_images=False)
    monkeypatch.setenv("STEADYDIFF_DATA", str(tmp_path / "env"))
    ds = load_dataset(DataConfig(name="fashion_mnist", root=str(tmp_path / "explicit")))
    assert len(ds) == 3
    with pytest.raises(DataError, match="data.root") as e:
        load_dataset(DataConfig(name="fashion_mnist", root=str(tmp_path / "empty")))
    assert_one_line(e)


def test_fashion_corrupt_files(tmp_path, monkeypatch):
    monkeypatch.setenv("STEADYDIFF_DATA", str(tmp_path))
    write_fashion(tmp_path, n=5)
    labels = tmp_path / "train-labels-idx1-ubyte"
    good = labels.read_bytes()
    cases = {
        "magic": b"\x00\x00\x08\x03" + good[4:],  # labels file with an images magic number
        "size": good[:-1],  # one label short of the header's count
        "empty": b"",
    }
    for why, content in cases.items():
        labels.write_bytes(content)
        with pytest.raises(DataError, match="train-labels-idx1-ubyte") as e:
            load_dataset(DataConfig(name="fashion_mnist"))
        assert "corrupt" in assert_one_line(e), why
    labels.write_bytes(good)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:100])  # truncated gzip
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
        load_dataset(DataConfig(name="fashion_mnist"))


def test_fashion_wrong_resolution():
    with pytest.raises(DataError, match="data.resolution=28") as e:
        load_dataset(DataConfig(name="fashion_mnist", resolution=32))
    assert_one_line(e)


def test_fashion_not_found_and_offline(no_fashion_sources, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(fm.urllib.request, "urlopen", offline)
    with pytest.raises(DataError) as e:
        load_dataset(DataConfig(name="fashion_mnist"))
    msg = assert_one_line(e)
    assert "apt-get install dataset-fashion-mnist" in msg and "STEADYDIFF_DATA" in msg
    assert str(fm.DEBIAN_DIR) in msg and "no network" in msg
    leftovers = list(no_fashion_sources.iterdir()) if no_fashion_sources.exists() else []
    assert leftovers == []


def test_download_verified_rejects_wrong_hash(tmp_path):
    src = tmp_path / "src" / "file.gz"
    src.parent.mkdir()
    payload = b"hello idx"
    src.write_bytes(gzip.compress(payload))
    dest_dir = tmp_path / "cache"
    with pytest.raises(DataError, match="SHA-256") as e:
        fm.download_verified(src.as_uri(), dest_dir / "file.gz", "0" * 64)
    assert_one_line(e)
    assert list(dest_dir.iterdir()) == []  # no partial or temporary file left behind
    # the right hash (of the decompressed payload) is accepted and the file lands in place
    good = hashlib.sha256(payload).hexdigest()
    out = fm.download_verified(src.as_uri(), dest_dir / "file.gz", good)
    assert out.read_bytes() == src.read_bytes() and [p.name for p in dest_dir.iterdir()] == ["file.gz"]


def test_fashion_downloads_into_cache_when_absent(tmp_path, no_fashion_sources, monkeypatch):
    served = tmp_path / "server"
    write_fashion(served, n=4)
    for f in list(served.iterdir()):  # the server holds every file gzipped
        if f.suffix != ".gz":
            f.with_name(f.name + ".gz").write_bytes(gzip.compress(f.read_bytes()))
            f.unlink()
    hashes = {p.name[:-3]: fm.payload_sha256(p) for p in served.iterdir()}
    monkeypatch.setattr(fm, "BASE_URL", served.as_uri() + "/")
    monkeypatch.setattr(fm, "SHA256", hashes)
    ds = load_dataset(DataConfig(name="fashion_mnist", split="test"))
    assert ds.data.shape == (4, 1, 28, 28)
    assert sorted(p.name for p in no_fashion_sources.iterdir()) == [
        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz",
    ]
    # a tampered server copy is rejected
    monkeypatch.setattr(fm, "SHA256", {k: "f" * 64 for k in hashes})
    with pytest.raises(DataError, match="SHA-256"):
        load_dataset(DataConfig(name="fashion_mnist", split="train"))
    assert not any(p.name.startswith("train") for p in no_fashion_sources.iterdir())


def test_unknown_dataset_name():
    with pytest.raises(DataError, match="fashion_mnist, toy2d, folder"):
        load_dataset(DataConfig(name="imagenet"))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# toy2d


@pytest.mark.parametrize("kind", TOY_KINDS)
def test_toy2d(kind):
    cfg = DataConfig(name="toy2d", toy=kind, toy_size=4000)
    ds = load_dataset(cfg)
    assert ds.data.shape == (4000, 2) and ds.data.dtype == torch.float32 and ds.sample_shape == (2,)
    assert ds.labels is None and ds.num_classes == 0
    assert torch.isfinite(ds.data).all()
    assert torch.equal(ds.data, load_dataset(cfg).data)  # deterministic
    test = load_dataset(DataConfig(name="toy2d", toy=kind, toy_size=4000, split="test"))
    assert not torch.equal(ds.data, test.data)
    assert ds.data.mean(0).abs().max() < 0.1
    assert (ds.data.std(0) - 1).abs().max() < 0.15
    assert len(load_dataset(DataConfig(name="toy2d", toy=kind, toy_size=4000, max_items=10))) == 10


def test_toy2d_shapes_are_what_they_claim():
    g = torch.Generator().manual_seed(0)
    pts = toy2d._eight_gaussians(2000, g)
    angles = torch.atan2(pts[:, 1], pts[:, 0]) / (torch.pi / 4)
    assert set(angles.round().remainder(8).long().tolist()) == set(range(8))
    assert (pts.norm(dim=1) - 2).abs().max() < 0.6
    board = toy2d._checkerboard(2000, g)
    assert ((board.floor().sum(1).long() % 2) == 0).all() and board.abs().max() <= 2
    roll = toy2d._swissroll(2000, g)
    assert roll.norm(dim=1).min() > 3 and roll.norm(dim=1).max() < 16


def test_toy2d_rejects_hflip():
    with pytest.raises(DataError, match="hflip=false"):
        load_dataset(DataConfig(name="toy2d", hflip=True, toy_size=10))


# ---------------------------------------------------------------------------------------------------------
# Image folders


def make_tree(root: Path) -> None:
    (root / "cats").mkdir(parents=True)
    (root / "dogs" / "deep").mkdir(parents=True)
    Image.new("RGB", (40, 30), (255, 0, 0)).save(root / "cats" / "a.png")
    Image.new("RGB", (20, 50), (0, 0, 255)).save(root / "cats" / "b.jpg", quality=95)
    Image.new("L", (16, 16), 0).save(root / "dogs" / "c.png")
    Image.new("RGBA", (33, 21), (0, 255, 0, 255)).save(root / "dogs" / "deep" / "d.bmp")
    (root / "dogs" / "notes.txt").write_text("not an image")


def test_folder_labelled(tmp_path):
    make_tree(tmp_path / "imgs")
    ds = load_dataset(DataConfig(name="folder", root=str(tmp_path / "imgs"), resolution=8, labels=True))
    assert ds.data.shape == (4, 3, 8, 8) and ds.data.dtype == torch.uint8
    x = ds.items_range(0, 4)
    assert ds.labels.tolist() == [0, 0, 1, 1] and ds.num_classes == 2 and ds.class_names == ["cats", "dogs"]
    assert x.min() >= -1 and x.max() <= 1
    assert torch.allclose(x[0].mean((1, 2)), torch.tensor([1.0, -1.0, -1.0]), atol=0.02)  # red
    assert torch.allclose(x[1].mean((1, 2)), torch.tensor([-1.0, -1.0, 1.0]), atol=0.05)  # blue jpeg
    assert torch.equal(x[2], torch.full((3, 8, 8), -1.0))  # black grayscale, replicated
    assert torch.allclose(x[3].mean((1, 2)), torch.tensor([-1.0, 1.0, -1.0]), atol=0.02)  # green


def test_folder_unlabelled_recursive_and_grayscale(tmp_path):
    make_tree(tmp_path / "imgs")
    ds = load_dataset(DataConfig(name="folder", root=str(tmp_path / "imgs"), resolution=12))
    assert ds.data.shape == (4, 3, 12, 12) and ds.labels is None and ds.num_classes == 0
    gray = tmp_path / "gray"
    gray.mkdir()
    for i, size in enumerate([(10, 14), (30, 9)]):
        Image.new("L", size, 40 * i).save(gray / f"g{i}.png")
    ds = load_dataset(DataConfig(name="folder", root=str(gray), resolution=6, max_items=1))
    assert ds.data.shape == (1, 1, 6, 6)  # all grayscale -> one channel


def test_folder_centre_crop(tmp_path):
    arr = np.zeros((10, 20), dtype=np.uint8)
    arr[:, 10:] = 255  # left half black, right half white
    (tmp_path / "im").mkdir()
    Image.fromarray(arr, mode="L").save(tmp_path / "im" / "x.png")
    ds = load_dataset(DataConfig(name="folder", root=str(tmp_path / "im"), resolution=10))
    expected = torch.full((10, 10), -1.0)
    expected[:, 5:] = 1.0  # columns 5..14 of the original
    assert torch.equal(ds.items_range(0, 1)[0, 0], expected)


def test_folder_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist") as e:
        load_dataset(DataConfig(name="folder", root=str(tmp_path / "missing")))
    assert_one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no images"):
        load_dataset(DataConfig(name="folder", root=str(tmp_path / "empty")))
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (8, 8)).save(flat / "a.png")
    with pytest.raises(DataError, match="no class sub-folders"):
        load_dataset(DataConfig(name="folder", root=str(flat), labels=True))
    (flat / "cls").mkdir()
    Image.new("RGB", (8, 8)).save(flat / "cls" / "b.png")
    with pytest.raises(DataError, match="directly in .*a.png"):
        load_dataset(DataConfig(name="folder", root=str(flat), labels=True))


def test_folder_truncated_jpeg(tmp_path):
    root = tmp_path / "imgs"
    root.mkdir()
    Image.new("RGB", (32, 32), (10, 20, 30)).save(root / "good.png")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(root / "bad.jpg")
    data = (root / "bad.jpg").read_bytes()
    (root / "bad.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="bad.jpg") as e:
        load_dataset(DataConfig(name="folder", root=str(root), resolution=8))
    assert "remove or replace" in assert_one_line(e)


# ---------------------------------------------------------------------------------------------------------
# InfiniteSampler


def test_sampler_epoch_is_permutation_and_boundaries():
    n = 37
    s = InfiniteSampler(n, seed=3)
    first = s.indices(0, n)
    assert first.dtype == torch.int64 and torch.equal(first.sort().values, torch.arange(n))
    three = s.indices(0, 3 * n)
    for e in range(3):
        assert torch.equal(three[e * n : (e + 1) * n].sort().values, torch.arange(n))
    assert not torch.equal(three[:n], three[n : 2 * n])
    assert torch.equal(three[:n], first)


def test_sampler_is_a_function_of_position():
    n = 23
    long = InfiniteSampler(n, seed=7).indices(0, 6 * n + 5)
    for start, count in [(0, 1), (5, 17), (20, 10), (22, 50), (3 * n, n), (4 * n + 2, 2 * n - 2)]:
        fresh = InfiniteSampler(n, seed=7)  # a resumed run: nothing cached
        assert torch.equal(fresh.indices(start, count), long[start : start + count])
    warm = InfiniteSampler(n, seed=7)
    chunks = torch.cat([warm.indices(p, 9) for p in range(0, 6 * n + 5 - 9, 9)])
    assert torch.equal(chunks, long[: len(chunks)])
    assert warm.indices(0, 0).shape == (0,)


def test_sampler_seeds_and_no_shuffle():
    a, b = InfiniteSampler(100, seed=0), InfiniteSampler(100, seed=0)
    assert torch.equal(a.indices(50, 300), b.indices(50, 300))
    assert not torch.equal(a.indices(0, 100), InfiniteSampler(100, seed=1).indices(0, 100))
    plain = InfiniteSampler(4, seed=0, shuffle=False)
    assert torch.equal(plain.indices(2, 7), torch.tensor([2, 3, 0, 1, 2, 3, 0]))
    with pytest.raises(DataError):
        InfiniteSampler(0, seed=0)


# ---------------------------------------------------------------------------------------------------------
# get_batch


def image_ds(n: int = 200) -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    data = torch.rand(n, 2, 4, 5, generator=g) * 2 - 1
    return ArrayDataset(data, torch.arange(n) % 3, 3, "rand")


def test_get_batch_hflip():
    ds = image_ds()
    idx = torch.arange(200).flip(0)
    x, y = get_batch(ds, idx, hflip=True, generator=torch.Generator().manual_seed(1))
    orig = ds.data[idx]
    flipped = torch.tensor([not torch.equal(a, b) for a, b in zip(x, orig)])
    assert 70 <= int(flipped.sum()) <= 130  # about half
    assert torch.equal(x[flipped], torch.flip(orig[flipped], dims=[-1]))
    assert torch.equal(x[~flipped], orig[~flipped])
    assert torch.equal(y, ds.labels[idx])
    again, _ = get_batch(ds, idx, hflip=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again, x)  # the generator decides


def test_get_batch_without_hflip_and_points():
    ds = image_ds()
    idx = torch.tensor([5, 0, 5, 199])
    x, y = get_batch(ds, idx, hflip=False, generator=None)
    assert torch.equal(x, ds.data[idx]) and torch.equal(y, ds.labels[idx])
    pts = ArrayDataset(torch.randn(10, 2), None, 0, "pts")
    x, y = get_batch(pts, torch.tensor([1, 2]), hflip=False, generator=None)
    assert x.shape == (2, 2) and y is None
    with pytest.raises(DataError, match="hflip=false"):
        get_batch(pts, torch.tensor([1, 2]), hflip=True, generator=None)


def test_uint8_images_read_as_the_floats_they_replace():
    """Images are held as uint8 and converted per batch by x / 127.5 - 1: batches, and the content digest
    (the cache key of reference statistics and trained classifiers), equal those of the float32 tensor."""
    from steadydiff.metrics.features import tensor_digest

    u8 = torch.randint(0, 256, (37, 3, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    floats = u8.to(torch.float32) / 127.5 - 1
    a = ArrayDataset(u8, torch.arange(37) % 2, 2, "u8")
    b = ArrayDataset(floats, torch.arange(37) % 2, 2, "f32")
    idx = torch.tensor([36, 0, 5, 5])
    gen = torch.Generator().manual_seed(3)
    xa, _ = get_batch(a, idx, hflip=True, generator=gen)
    xb, _ = get_batch(b, idx, hflip=True, generator=torch.Generator().manual_seed(3))
    assert xa.dtype == torch.float32 and torch.equal(xa, xb)
    assert torch.equal(a.items_range(3, 9), floats[3:9])
    assert a.digest() == b.digest() == tensor_digest(floats)
    assert a.truncate(4).digest() == tensor_digest(floats[:4])
    with pytest.raises(DataError, match="uint8 data must be images"):
        ArrayDataset(torch.zeros(4, 2, dtype=torch.uint8), None, 0, "pts")
