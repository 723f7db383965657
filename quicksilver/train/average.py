"""Weight averaging: one model folder whose weights are the (weighted) mean of several.

Averaging the end points of successive short runs that continue one another (a "model soup" of one lineage,
as in latest-weight averaging) often scores as well as the best of them at no training cost. The folders must
share the architecture and the tokenizer; the result takes its decoding defaults from the last folder.

    quicksilver train average runs/a/export runs/b/export -o runs/ab/export [--weights 1,2]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from quicksilver.checkpoint import CheckpointError, load_pretrained, save_pretrained

# keys of config.json that may differ between folders that hold the same architecture
_STORAGE_KEYS = ("torch_dtype",)


def average_models(folders: Sequence[str | Path], out: str | Path, weights: Sequence[float] | None = None) -> Path:
    """Write the weighted mean of ``folders``' weights to ``out`` (bf16), with the last folder's tokenizer and
    decoding defaults, and ``average.json`` naming the sources. Returns ``out``."""
    folders = [Path(f) for f in folders]
    if len(folders) < 2:
        raise ValueError("average needs at least two model folders")
    weights = [1.0] * len(folders) if weights is None else [float(w) for w in weights]
    if len(weights) != len(folders):
        raise ValueError(f"{len(weights)} weights for {len(folders)} folders")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("weights must be >= 0 and not all 0")
    out = Path(out)
    if out.resolve() in {f.resolve() for f in folders}:
        raise ValueError(f"{out}: the output must not be one of the inputs")

    total = sum(weights)
    reference = load_pretrained(folders[-1], dtype=torch.float32)
    ref_config = _architecture(reference.model.config.to_dict())
    ref_vocab = reference.tokenizer.backend.to_str()
    sums = {k: v.detach().clone() * (weights[-1] / total) for k, v in reference.model.state_dict().items()}
    for folder, weight in zip(folders[:-1], weights[:-1], strict=True):
        loaded = load_pretrained(folder, dtype=torch.float32)
        if _architecture(loaded.model.config.to_dict()) != ref_config:
            raise CheckpointError(f"{folder}: config.json differs from {folders[-1]} (not the same architecture)")
        if loaded.tokenizer.backend.to_str() != ref_vocab:
            raise CheckpointError(f"{folder}: tokenizer differs from {folders[-1]}")
        for key, value in loaded.model.state_dict().items():
            sums[key] += value * (weight / total)
        del loaded
    with torch.no_grad():
        for key, value in reference.model.state_dict().items():
            value.copy_(sums[key])
    save_pretrained(out, reference.model, reference.tokenizer, reference.defaults)
    sources = [{"folder": str(f), "weight": w / total} for f, w in zip(folders, weights, strict=True)]
    (out / "average.json").write_text(json.dumps({"averaged_from": sources}, indent=2) + "\n")
    return out


def _architecture(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _STORAGE_KEYS}
