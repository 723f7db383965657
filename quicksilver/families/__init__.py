"""Adapters for real open diffusion checkpoints (LLaDA, Dream, SDAR, LLaDA2, Fast-dLLM v2).

``load_family(folder)`` reads config.json's ``model_type``, picks the adapter and streams the weights into
our transformer; ``quicksilver.loading.load_model`` calls it for every folder that is not in our own layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quicksilver.checkpoint import CheckpointError, LoadedModel
from quicksilver.families.base import Family, summary_line
from quicksilver.families.dream import Dream
from quicksilver.families.fast_dllm_v2 import FastDLLMv2
from quicksilver.families.llada import LLaDA
from quicksilver.families.llada2 import LLaDA2
from quicksilver.families.sdar import SDAR

FAMILIES: tuple[Family, ...] = (LLaDA(), Dream(), SDAR(), LLaDA2(), FastDLLMv2())

__all__ = ["FAMILIES", "Family", "family_for", "load_family", "summary_line"]


def family_for(folder: str | Path) -> Family:
    """The adapter for a Hugging Face folder, chosen by config.json's model_type."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a valid config ({exc})") from None
    for family in FAMILIES:
        if isinstance(model_type, str) and model_type.lower() in family.model_types:
            return family
    known = ", ".join(f"{t} ({f.description})" for f in FAMILIES for t in f.model_types)
    raise CheckpointError(f"{path}: unsupported model_type {model_type!r}; supported: quicksilver, {known}")


def load_family(folder: Path, dtype: torch.dtype | None = None, quiet: bool = False) -> LoadedModel:
    """Load a supported family's folder into our transformer (bf16 unless ``dtype``); prints one summary line."""
    folder = Path(folder)
    return family_for(folder).load(folder, dtype=dtype, quiet=quiet)
