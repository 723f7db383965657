"""Find and load a model by name or folder: the shipped models, our own layout, or a known family."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quicksilver.checkpoint import CheckpointError, LoadedModel, load_pretrained
from quicksilver.devices import check_precision, place_model, resolve_device
from quicksilver.variants import PRECISIONS, as_variant, check_compile_device, compile_layers

MODELS_DIR = Path(__file__).parent / "models"
DEFAULT_MODEL = "default"


class ModelNotFound(CheckpointError):
    pass


def shipped_models() -> list[str]:
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(name_or_path: str | Path | None) -> Path:
    """A shipped model's name ("default", "ar-twin") or a folder path -> the folder."""
    name = str(name_or_path) if name_or_path else DEFAULT_MODEL
    candidate = MODELS_DIR / name
    if "/" not in name and (candidate / "config.json").is_file():
        return candidate
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if name_or_path is None:
        raise ModelNotFound(
            "no default model is installed yet (quicksilver/models/default is missing); "
            "pass --model DIR or train one with `quicksilver train`"
        )
    raise ModelNotFound(f"{name}: no such model folder (shipped models: {', '.join(shipped_models()) or 'none'})")


def load_model(
    name_or_path: str | Path | None = None,
    dtype: torch.dtype | None = None,
    precision: str | None = None,
    device: str | torch.device | None = None,
    compile: bool = False,
) -> LoadedModel:
    """Load our layout directly; hand other Hugging Face folders to the matching family adapter. ``precision``
    ("bf16", "fp32", "int8", "int8w" or "int8mix": :mod:`quicksilver.variants`) converts the loaded weights in place;
    ``device`` ("cpu", the default, or "cuda"; :mod:`quicksilver.devices`) is where the model runs; ``compile``
    compiles its layers for decoding (:func:`quicksilver.variants.compile_layers`, CPU only), graphs built now."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    resolved = resolve_device(device)
    check_precision(precision, resolved)  # a bad device or pairing fails before the weights load
    if compile:
        check_compile_device(resolved)
    folder = resolve_model_path(name_or_path)
    cfg_path = folder / "config.json"
    model_type = None
    if cfg_path.is_file():
        try:
            model_type = json.loads(cfg_path.read_text()).get("model_type")
        except (json.JSONDecodeError, AttributeError):
            model_type = None  # load_pretrained reports the malformed file
    if model_type not in (None, "quicksilver"):
        from quicksilver import families  # imported lazily: most users never need it

        loaded = families.load_family(folder, dtype=dtype)
    else:
        loaded = load_pretrained(folder, dtype=dtype)
    if name_or_path is None or (MODELS_DIR / str(name_or_path)).resolve() == folder.resolve():
        loaded.name = folder.name
    if precision is not None:
        loaded.model = as_variant(loaded.model, precision, copy=False)
    if device is not None:
        place_model(loaded.model, device)
    if compile:
        compile_layers(loaded.model)
    return loaded
