"""Sample-quality metrics: distances between sets of samples or feature vectors."""

from .distances import (
    DEFAULT_RBF_BANDWIDTHS,
    fd_from_features,
    frechet_distance,
    gaussian_stats,
    kid,
    mmd_rbf,
    precision_recall,
    sliced_wasserstein,
)
from .evaluate import METRICS, evaluate
from .features import EXTRACTOR_NAMES, FeatureExtractor, get_extractor
from .reference import reference_stats

__all__ = [
    "EXTRACTOR_NAMES",
    "FeatureExtractor",
    "METRICS",
    "evaluate",
    "get_extractor",
    "reference_stats",
    "DEFAULT_RBF_BANDWIDTHS",
    "fd_from_features",
    "frechet_distance",
    "gaussian_stats",
    "kid",
    "mmd_rbf",
    "precision_recall",
    "sliced_wasserstein",
]
