"""Shared types of the data package: the in-memory dataset and its error."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..utils.errors import SteadydiffError


class DataError(SteadydiffError):
    """Bad or missing data; str(e) is ONE line that names the fix."""

    def __init__(self, message: str) -> None:
        # Messages often embed an OS or Pillow error text; keep the whole thing on one line.
        super().__init__(" ".join(str(message).split()))


@dataclass
class ArrayDataset:
    """A whole dataset held in memory.

    `data` is float32: images (N, C, H, W) scaled to [-1, 1], or toy points (N, 2). `labels` is int64 (N,)
    or None; `num_classes` is 0 when unlabelled. `class_names` (optional) names class i at position i.
    """

    data: torch.Tensor
    labels: torch.Tensor | None
    num_classes: int
    name: str
    class_names: list[str] | None = None

    def __post_init__(self) -> None:
        if self.data.dtype != torch.float32:
            raise DataError(f"dataset {self.name}: data must be float32, got {self.data.dtype}")
        if self.data.dim() < 2:
            shape = tuple(self.data.shape)
            raise DataError(f"dataset {self.name}: data must be (N, ...) with N samples, got {shape}")
        if self.labels is not None:
            if self.labels.dtype != torch.int64 or self.labels.shape != (self.data.shape[0],):
                raise DataError(
                    f"dataset {self.name}: labels must be int64 of shape ({self.data.shape[0]},), "
                    f"got {self.labels.dtype} {tuple(self.labels.shape)}"
                )
            if self.num_classes <= 0:
                raise DataError(f"dataset {self.name}: labelled data needs num_classes > 0")
        elif self.num_classes != 0:
            raise DataError(f"dataset {self.name}: unlabelled data must have num_classes 0")

    def __len__(self) -> int:
        return int(self.data.shape[0])

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.data.shape[1:])

    def truncate(self, max_items: int | None) -> ArrayDataset:
        """The first `max_items` items (all when None)."""
        if max_items is None:
            return self
        if max_items < 1:
            raise DataError(f"data.max_items must be >= 1 or null, got {max_items}")
        if max_items >= len(self):
            return self
        # Copies, so the full-size tensors can be freed.
        labels = None if self.labels is None else self.labels[:max_items].clone()
        data = self.data[:max_items].clone()
        return ArrayDataset(data, labels, self.num_classes, self.name, self.class_names)
