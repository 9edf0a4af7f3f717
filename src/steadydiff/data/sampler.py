"""A resumable, seeded, infinite stream of dataset indices, batch assembly, and fixed seeded subsets."""

from __future__ import annotations

import hashlib

import torch

from .base import ArrayDataset, DataError


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for (seed, epoch): distinct pairs give unrelated permutations."""
    digest = hashlib.blake2b(f"steadydiff-sampler:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class InfiniteSampler:
    """Seeded infinite stream of indices: epoch e uses permutation seeded by (seed, e); the stream is a pure
    function of the global position, so resuming at any step continues mid-epoch with the same order.

    Position p lies in epoch p // n at offset p % n; with `shuffle=False` the stream is 0, 1, ..., n-1, 0, ...
    The last two epochs' permutations are cached, so reading the stream in order costs one `randperm` per
    epoch.
    """

    _CACHE = 2

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n < 1:
            raise DataError(f"cannot sample from an empty dataset (n={n}); check the data config")
        self.n = int(n)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._perms: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of epoch `epoch` (int64, a permutation of 0..n-1)."""
        if not self.shuffle:
            return torch.arange(self.n, dtype=torch.int64)
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.n, generator=g, dtype=torch.int64)
            if len(self._perms) >= self._CACHE:
                self._perms.pop(next(iter(self._perms)))  # drop the oldest
            self._perms[epoch] = perm
        return perm

    def indices(self, start: int, count: int) -> torch.Tensor:
        """The stream at global positions [start, start + count), int64 (count,)."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")
        out = torch.empty(count, dtype=torch.int64)
        filled, pos = 0, int(start)
        while filled < count:
            epoch, offset = divmod(pos, self.n)
            take = min(self.n - offset, count - filled)
            out[filled : filled + take] = self.permutation(epoch)[offset : offset + take]
            filled += take
            pos += take
        return out


def get_batch(
    ds: ArrayDataset, indices: torch.Tensor, hflip: bool, generator: torch.Generator | None,
    keep: slice | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, labels) for `indices`; with `hflip`, each image is mirrored left-right with probability 0.5, the
    coin flips drawn from `generator` (one per image of the whole batch, in batch order). `keep` reads only
    that slice of the batch (a DDP rank's share): the same rows, flipped the same way, as slicing the whole."""
    idx = indices.to(dtype=torch.int64)
    keep = keep if keep is not None else slice(None)
    flips = None
    if hflip and ds.is_image:
        device = generator.device if generator is not None else torch.device("cpu")
        flips = torch.rand(len(idx), generator=generator, device=device)[keep] < 0.5
    eps = None
    if getattr(ds, "latent", None) is not None:  # a latent store: a fresh draw from each posterior, every step
        if hflip:
            raise DataError(f"{ds.name} is a latent store: mirrored latents are not latents of mirrored images; "
                            "set data.hflip=false")
        device = generator.device if generator is not None else torch.device("cpu")
        eps = torch.randn((len(idx), *ds.sample_shape), generator=generator, device=device)[keep].cpu()
    idx = idx[keep]
    x = ds.items(idx) if eps is None else ds.draw(idx, eps)
    labels = None if ds.labels is None else ds.labels.index_select(0, idx.to(ds.labels.device))
    if hflip:
        if flips is None:
            raise DataError(
                f"data.hflip applies to images only, but {ds.name} has samples of shape {ds.sample_shape}; "
                "set data.hflip=false"
            )
        x = torch.where(flips.to(x.device)[:, None, None, None], x.flip(-1), x)
    return x, labels


def fixed_subset(ds: ArrayDataset, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(items, labels) of the first `n` examples of a permutation drawn from `generator`: the one way a fixed
    set (probe batch, validation set, reference images, diagnostics batch) is chosen. The generator advances by
    exactly one `randperm`, so callers can keep drawing their own quantities from it afterwards."""
    idx = torch.randperm(len(ds), generator=generator)[:n]
    return ds.items(idx), None if ds.labels is None else ds.labels[idx]


def model_labels(labels: torch.Tensor | None, num_classes: int) -> torch.Tensor | None:
    """The labels a model is called with: the data's labels for a class-conditional model
    (`model.num_classes > 0`), None for an unconditional one (even when the data has labels)."""
    return labels if (labels is not None and num_classes) else None
