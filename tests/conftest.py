"""Shared test settings."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    """The tests run tiny models: they gain nothing from intra-op threads, and on a shared 2-core machine
    OpenMP barriers between two threads make each step many times slower and erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
