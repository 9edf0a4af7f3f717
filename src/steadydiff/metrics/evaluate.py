"""Sample-quality evaluation of a model: `steadydiff eval` and the trainer's periodic eval.

Metrics (one sample set is drawn and shared by all requested metrics):
    fd_fmnist   Frechet distance on the penultimate features of steadydiff's Fashion-MNIST classifier, against
                cached reference statistics of the training split (our default on Fashion-MNIST)
    fid         Frechet distance on the standard Inception-v3 FID features (extra [fid]) vs the training split
    kid         KID (unbiased, cubic kernel) on the fmnist classifier features vs n real training images
    precision / recall   improved precision and recall (k = 3) on the fmnist classifier features
    sw / mmd    sliced Wasserstein distance and RBF MMD^2 on raw points (toy2d)
    class_acc   class-conditional models: the fraction of samples the Fashion-MNIST classifier assigns to the
                class they were drawn for (class_acc_mnist: the MNIST classifier); what guidance should raise

Each is one `Metric` entry of METRICS: the registry `steadydiff eval --metric`, `train.eval_metrics` and the
CLI's help read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..utils.errors import ConfigError
from ..utils.registry import Registry
from .distances import frechet_distance, gaussian_stats, kid, mmd_rbf, precision_recall, sliced_wasserstein

# What a metric needs of the generated set: features of an extractor (its registry name), that name with the
# LOGITS suffix (a classifier's logits), or the raw samples (SAMPLES).
SAMPLES = "samples"
LOGITS = ":logits"
IMAGES, POINTS = "images", "points"  # the data a metric applies to: (C, H, W) images or (D,) points


class EvalContext:
    """Shared pieces of one evaluation: the generated set (its features per extractor, and the samples
    themselves for point data), the real data, and reference statistics (computed lazily)."""

    def __init__(self, fake: dict[str, torch.Tensor], dataset, data_cfg, n: int, seed: int, device,
                 ref_n: int | None, labels: torch.Tensor | None = None):
        self.fake, self.dataset, self.data_cfg, self.n, self.seed, self.device = (
            fake, dataset, data_cfg, n, seed, device)
        self.labels = labels  # the class each generated sample was drawn for (None: unconditional)
        self.ref_n = ref_n
        self._real_features: dict[str, torch.Tensor] = {}

    @property
    def samples(self) -> torch.Tensor:
        return self.fake[SAMPLES]

    def real(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + 1)
        idx = torch.randperm(len(self.dataset), generator=g)[: self.n]
        return self.dataset.items(idx)

    def extractor(self, name: str):
        from .features import get_extractor

        return get_extractor(name, device=self.device)

    def features(self, which: str, extractor: str) -> torch.Tensor:
        if which == "fake":
            return self.fake[extractor].double()
        if extractor not in self._real_features:
            self._real_features[extractor] = self.extractor(extractor).features(self.real()).double().cpu()
        return self._real_features[extractor]

    def fd(self, extractor: str) -> float:
        from .reference import reference_stats

        ref = reference_stats(self.data_cfg, "train", self.extractor(extractor), n=self.ref_n)
        mu, sigma = gaussian_stats(self.features("fake", extractor))
        return frechet_distance(mu, sigma, ref["mu"], ref["sigma"])


def _pr(ctx: EvalContext) -> tuple[float, float]:
    return precision_recall(ctx.features("real", "fmnist"), ctx.features("fake", "fmnist"), k=3)


def _kid(ctx: EvalContext) -> float:
    a, b = ctx.features("real", "fmnist"), ctx.features("fake", "fmnist")
    return kid(a, b, subsets=50, subset_size=min(1000, len(a), len(b)), seed=ctx.seed)[0]


def _class_acc(ctx: EvalContext, classifier: str) -> float:
    logits = ctx.fake[classifier + LOGITS]
    return (logits.argmax(dim=1) == ctx.labels.cpu()).double().mean().item()


@dataclass(frozen=True)
class Metric:
    """fn: the value, from the shared `EvalContext`; needs: what of the generated set it reads (see SAMPLES);
    domain: IMAGES or POINTS; conditional: it scores class-conditional models only; min_n: the fewest samples
    it is defined on (a covariance needs 2; precision / recall need more than k = 3 neighbours)."""

    fn: Callable[[EvalContext], float]
    needs: str
    domain: str
    conditional: bool = False
    min_n: int = 2


METRICS: Registry[Metric] = Registry("metric", key="train.eval_metrics")
METRICS.add("fd_fmnist", Metric(lambda ctx: ctx.fd("fmnist"), "fmnist", IMAGES))
METRICS.add("fid", Metric(lambda ctx: ctx.fd("inception"), "inception", IMAGES))
METRICS.add("kid", Metric(_kid, "fmnist", IMAGES))
METRICS.add("precision", Metric(lambda ctx: _pr(ctx)[0], "fmnist", IMAGES, min_n=4))
METRICS.add("recall", Metric(lambda ctx: _pr(ctx)[1], "fmnist", IMAGES, min_n=4))
METRICS.add("class_acc", Metric(lambda ctx: _class_acc(ctx, "fmnist"), "fmnist" + LOGITS, IMAGES, conditional=True,
                                min_n=1))
METRICS.add("class_acc_mnist", Metric(lambda ctx: _class_acc(ctx, "mnist"), "mnist" + LOGITS, IMAGES,
                                      conditional=True, min_n=1))
METRICS.add("sw", Metric(lambda ctx: sliced_wasserstein(ctx.samples, ctx.real(),
                                                        generator=torch.Generator().manual_seed(0)), SAMPLES, POINTS,
                         min_n=1))
METRICS.add("mmd", Metric(lambda ctx: mmd_rbf(ctx.samples, ctx.real()), SAMPLES, POINTS))


def parse_metrics(text: str | list[str], sample_ndim: int | None = None, given: str = "--metric") -> list[str]:
    """Metric names from `a,b,c` (or a list), each checked against METRICS and, given the samples' number of
    dimensions, against the data (`given`: the flag or config key that named them)."""
    names = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    for m in names:
        METRICS.choose(m, given)
    if sample_ndim is not None:
        domain = POINTS if sample_ndim == 1 else IMAGES
        allowed = [m for m, metric in METRICS.items() if metric.domain == domain]
        bad = [m for m in names if m not in allowed]
        if bad:
            raise ConfigError(f"metric {bad[0]} does not apply to this data; use {', '.join(allowed)}")
    return names


def evaluate(model, formulation, cfg, dataset, metrics: list[str], n: int, sampler: str, steps: int,
             seed: int = 0, device: torch.device | str = "cpu", clip: bool = True,
             ref_n: int | None = None, batch: int = 256, dist_info=None,
             class_label: int | None = None, decode=None) -> dict[str, Any]:
    """Draw `n` samples once (in chunks of `batch`, see `generate_chunks`) and compute every metric on them.
    Returns {metric: value, ...}.

    `ref_n`: reference statistics (fd_fmnist, fid) over the first `ref_n` training images (default: all).
    Inception runs at ~6 images/s on 2 CPU cores, so on a CPU pass e.g. ref_n=2000 for `fid`; statistics
    over different ref_n are cached separately and FIDs are comparable only at equal (n, ref_n).

    `decode` (a model trained on a latent store): samples are decoded to pixels and scored against the image
    store the latents were encoded from.

    `dist_info` (a `DistInfo` with world_size > 1, under torchrun): every process must call this; each draws
    its share of the chunks and extracts their features, rank 0 gathers them and returns the metrics, the
    other ranks return {}. The samples, and so the metrics, are those of a single-process call.
    """
    from ..diffusion.generate import generate_chunks, merge_chunks, sample_labels
    from ..utils.distributed import DistInfo, gather_to_main, local_main_first
    from .features import CLASSIFIER_RECIPES, get_extractor

    info = dist_info if dist_info is not None else DistInfo()
    data_cfg, latent_shape = cfg.data, dataset.sample_shape
    if decode is not None:  # latent diffusion: decoded samples against the image store the latents came from
        from ..data import load_dataset
        from ..diffusion.latent import image_store

        data_cfg = image_store(cfg.data)
        dataset = load_dataset(data_cfg)
    metrics = parse_metrics(metrics, len(dataset.sample_shape))
    conditional = [m for m in metrics if METRICS[m].conditional]
    if conditional and not cfg.model.num_classes:
        raise ConfigError(f"{conditional[0]} scores class-conditional models; this model has model.num_classes=0")
    few = [m for m in metrics if n < METRICS[m].min_n]
    if few:
        raise ConfigError(f"{few[0]} needs at least {METRICS[few[0]].min_n} samples, got {n}; raise --n "
                          "(train.eval_n)")
    on_classifier = [m for m in metrics if METRICS[m].needs.removesuffix(LOGITS) in CLASSIFIER_RECIPES]
    if on_classifier and (dataset.sample_shape[0] != 1 or dataset.sample_shape[1:] != (28, 28)):
        raise ConfigError(f"{'/'.join(on_classifier)} use a 28x28 grayscale classifier's features; use --metric "
                          "fid for other image data")
    chunks = generate_chunks(model, formulation, latent_shape, n, sampler, steps, seed, device,
                             cfg.model.num_classes, batch=batch, clip=clip, rank=info.rank,
                             world_size=info.world_size, class_label=class_label, decode=decode)
    local: dict[str, dict[int, torch.Tensor]] = {}
    for need in dict.fromkeys(METRICS[m].needs for m in metrics):  # each extractor once, in a fixed order
        if need == SAMPLES:
            local[need] = chunks
            continue
        name, logits = need.removesuffix(LOGITS), need.endswith(LOGITS)
        with local_main_first(info):  # a classifier not yet cached is trained once per node, not per process
            extractor = get_extractor(name, device=device)
        local[need] = {k: (extractor.logits(x) if logits else extractor.features(x)).cpu() for k, x in chunks.items()}
    parts = gather_to_main(local, info)
    if parts is None:
        return {}
    fake = {need: merge_chunks([part[need] for part in parts]) for need in local}
    ctx = EvalContext(fake, dataset, data_cfg, n, seed, device, ref_n,
                      sample_labels(0, n, cfg.model.num_classes, class_label))
    return {m: float(METRICS[m].fn(ctx)) for m in metrics}


def plot_guidance_sweep(sweep: list[dict[str, Any]], path) -> None:
    """One panel per metric against the guidance weight W (`steadydiff eval --guidance 1,1.5,2,3`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..utils.io import atomic_write

    names = list(sweep[0]["metrics"])
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.0), squeeze=False)
    ws = [r["guidance"] for r in sweep]
    for ax, name in zip(axes[0], names):
        ax.plot(ws, [r["metrics"][name] for r in sweep], "o-")
        ax.set_xlabel("guidance weight W")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=100, format="png"))
    plt.close(fig)
