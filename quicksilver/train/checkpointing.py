"""Training checkpoints: everything needed to continue bit-for-bit, written atomically.

A checkpoint is ``ckpt-<step>.pt`` in ``<run>/checkpoints``: model (fp32 master weights), optimizer,
step (which fixes the LR schedule), data positions and noise-generator states of every rank, the torch
RNG, tokens seen and training time. It is written to a temporary file and renamed, so a process killed
mid-write leaves the previous checkpoint intact: at most one checkpoint interval is lost.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ckpt-{step:08d}.pt"
    tmp = folder / f".ckpt-{step:08d}.pt.tmp"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:  # make the bytes durable before the rename makes them visible
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"{path}: cannot read checkpoint ({exc})") from None
