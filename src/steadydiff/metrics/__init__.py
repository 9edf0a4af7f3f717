"""Sample-quality metrics."""

from .distances import sliced_wasserstein

__all__ = ["sliced_wasserstein"]
