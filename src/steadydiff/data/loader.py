"""Reading batches ahead of the training step, in background threads.

Batch k is a pure function of (seed, k) (`InfiniteSampler` positions and per-step coin flips), so it can be
assembled early, by any thread, in any order, and the trajectory stays exactly the one a synchronous loop
gives, whatever the number of workers, and after a resume at any step. Threads rather than processes: the
work is positional file reads (`os.pread`), uint8 copies and a conversion to float, all of which release the
GIL; the batch tensors need no pickling and, on CUDA, go straight to pinned memory.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Prefetcher:
    """`get(k)` returns `fn(k)`, computed `depth` steps ahead by `workers` threads (workers 0: computed on
    the spot). Asking for a step other than the next one (a resume, a jump) discards what was read ahead."""

    def __init__(self, fn: Callable[[int], Any], workers: int, depth: int | None = None):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        self.fn, self.workers = fn, workers
        self.depth = depth if depth is not None else max(2, 2 * workers)
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future] = {}

    def _submit(self, k: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="steadydiff-loader")
        self._ahead[k] = self._pool.submit(self.fn, k)

    def get(self, k: int) -> Any:
        if self.workers == 0:
            return self.fn(k)
        if k not in self._ahead:
            self._drop()
            for j in range(k, k + self.depth):
                self._submit(j)
        fut = self._ahead.pop(k)
        self._submit(k + self.depth)
        return fut.result()

    def _drop(self) -> None:
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()

    def close(self) -> None:
        """Stop reading ahead and release the threads (a later `get` starts them again)."""
        self._drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
