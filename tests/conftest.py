"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Small tensor ops on a shared 2-core machine: one thread is as fast and does not contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
