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

__all__ = [
    "DEFAULT_RBF_BANDWIDTHS",
    "fd_from_features",
    "frechet_distance",
    "gaussian_stats",
    "kid",
    "mmd_rbf",
    "precision_recall",
    "sliced_wasserstein",
]
