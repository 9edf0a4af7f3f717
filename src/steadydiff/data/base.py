"""Shared types of the data package: the in-memory dataset and its error."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..utils.errors import SteadydiffError


class DataError(SteadydiffError):
    """Bad or missing data; str(e) is ONE line that names the fix."""

    def __init__(self, message: str) -> None:
        # Messages often embed an OS or Pillow error text; keep the whole thing on one line.
        super().__init__(" ".join(str(message).split()))


def to_unit_range(x: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1] as x / 127.5 - 1: the one conversion every image path uses, so that
    a batch is bit-identical whether its pixels came from RAM, a store, or a float tensor made this way."""
    return x.to(torch.float32).div_(127.5).sub_(1.0)


@dataclass
class ArrayDataset:
    """A whole dataset held in memory.

    `data` is uint8 images (N, C, H, W) with pixel values 0-255 (4x less memory than floats; `items` converts
    per batch), or float32: images already in [-1, 1], or toy points (N, 2). `labels` is int64 (N,) or None;
    `num_classes` is 0 when unlabelled. `class_names` (optional) names class i at position i.

    Every dataset (this one, `StoreDataset`) offers the same reading interface: `len`, `sample_shape`,
    `labels`, `items(indices)` and `items_range(start, stop)` (float32 in [-1, 1]), `digest()`.
    """

    data: torch.Tensor
    labels: torch.Tensor | None
    num_classes: int
    name: str
    class_names: list[str] | None = None

    def __post_init__(self) -> None:
        if self.data.dtype not in (torch.float32, torch.uint8):
            raise DataError(f"dataset {self.name}: data must be uint8 images or float32, got {self.data.dtype}")
        if self.data.dtype == torch.uint8 and self.data.dim() != 4:
            raise DataError(f"dataset {self.name}: uint8 data must be images (N, C, H, W), got "
                            f"{tuple(self.data.shape)}")
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

    @property
    def is_image(self) -> bool:
        return self.data.dim() == 4

    def _float(self, x: torch.Tensor) -> torch.Tensor:
        return to_unit_range(x) if x.dtype == torch.uint8 else x

    def items(self, indices: torch.Tensor) -> torch.Tensor:
        """The samples at `indices` (int64, any device) as float32, on the data's device."""
        return self._float(self.data.index_select(0, indices.to(device=self.data.device, dtype=torch.int64)))

    def items_range(self, start: int, stop: int) -> torch.Tensor:
        """Samples start..stop-1 as float32 (a copy when converted, else a view)."""
        return self._float(self.data[start:stop])

    def digest(self) -> str:
        """SHA-256 (hex) of the samples as one float32 tensor: its dtype, shape and bytes, streamed in chunks
        (the same value `metrics.features.tensor_digest` gives for that tensor, whatever the storage)."""
        h = hashlib.sha256()
        h.update(f"{torch.float32}{(len(self), *self.sample_shape)};".encode())
        for i in range(0, len(self), 4096):
            h.update(self.items_range(i, i + 4096).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

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
