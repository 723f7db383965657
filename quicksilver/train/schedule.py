"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.

The schedule is a pure function of the step, so "scheduler state" is just the step counter that the
checkpoint stores; a warm start from a shipped model continues from the step recorded in its folder.
"""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
