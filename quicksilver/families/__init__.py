"""Adapters for real open checkpoints (LLaDA, Dream, SDAR, LLaDA2, Fast-dLLM v2)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quicksilver.checkpoint import CheckpointError, LoadedModel


def load_family(folder: Path, dtype: torch.dtype | None = None) -> LoadedModel:
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    raise CheckpointError(f"{folder / 'config.json'}: unsupported model_type {model_type!r}")
