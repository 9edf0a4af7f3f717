"""Shared test fixtures (tests/README.md says how the suite is organised and run).

Under pytest-xdist each worker is a process: each gets cores / workers intra-op threads (1 on the 2-core CI
machine), also for the processes it starts (OMP_NUM_THREADS). Two workers at 2 threads each on 2 cores spin
in OpenMP waiting for each other: a 16 s diagnose took 128 s next to other work.
"""

import os

import pytest
import torch


def _worker_threads() -> int | None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, workers))


WORKER_THREADS = _worker_threads()
if WORKER_THREADS is not None:
    torch.set_num_threads(WORKER_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))  # the subprocesses a test starts


@pytest.fixture
def one_thread():
    """Small tensor ops on a shared 2-core machine: one thread is as fast and does not contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
