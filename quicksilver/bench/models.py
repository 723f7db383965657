"""Thread settings for benchmark runs (model variants live in :mod:`quicksilver.variants`)."""

from __future__ import annotations

import torch


def set_threads(n: int) -> int:
    """Set intra-op threads (returns the previous setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    return before
