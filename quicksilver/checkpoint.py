"""Model folders in Hugging Face layout.

A model is a folder with ``config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json``. Weights are read with safetensors (memory-mapped, one tensor at a time);
nothing is ever unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quicksilver.config import ConfigError, ModelConfig
from quicksilver.model import Transformer
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer, TokenizerError
from quicksilver.variants import QUANTISED, precision_of

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class CheckpointError(ValueError):
    """A model folder cannot be loaded; the message names the file and the problem."""


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    defaults: SamplingParams
    path: Path
    name: str


def generation_defaults(data: dict[str, Any]) -> SamplingParams:
    """SamplingParams defaults from generation_config.json (keys we do not use are ignored)."""
    fields = set(SamplingParams.__dataclass_fields__) - {"extra", "seed"}
    kwargs = {k: v for k, v in data.items() if k in fields}
    if "max_new_tokens" in data and "max_tokens" not in kwargs:
        kwargs["max_tokens"] = data["max_new_tokens"]
    if "stop" in kwargs:
        kwargs["stop"] = tuple(kwargs["stop"])
    return SamplingParams(**kwargs)


def save_pretrained(
    folder: str | Path,
    model: Transformer,
    tokenizer: Tokenizer,
    defaults: SamplingParams | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    if precision_of(model) in QUANTISED:  # its int8 buffers are not the float weights a folder holds
        raise ValueError(f"cannot save a model converted to {precision_of(model)}; save the float model")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    cfg.torch_dtype = {v: k for k, v in DTYPES.items()}[dtype]
    cfg.save(folder / "config.json")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors stores no aliases
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")  # atomic: a crash never leaves a half-written file
    tokenizer.save(folder)
    gen = defaults or SamplingParams()
    gen_dict = {k: v for k, v in gen.__dict__.items() if k not in ("extra", "seed")}
    gen_dict["stop"] = list(gen.stop)
    (folder / "generation_config.json").write_text(json.dumps(gen_dict, indent=2) + "\n")
    return folder


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: one file, or the shards named by the index."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc})") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard named in {index.name} not found")
        return files
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def iter_safetensors(files: list[Path]):
    """Yield (name, tensor) for every tensor, one file and one tensor at a time (mmap)."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield key, f.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError / OSError on corrupt files
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({exc})") from None


def load_state_into(
    model: Transformer, tensors, source: str, dtype: torch.dtype, strict: bool = True
) -> None:
    """Copy (name, tensor) pairs into the model, checking names and shapes."""
    params = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    seen: set[str] = set()
    for key, tensor in tensors:
        if key not in params:
            if strict:
                raise CheckpointError(f"{source}: unexpected tensor {key!r} (shape {tuple(tensor.shape)})")
            continue
        target = params[key]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{source}: shape mismatch for {key!r}: file has {tuple(tensor.shape)}, "
                f"config expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor.to(dtype))
        seen.add(key)
    missing = sorted(set(params) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensors {missing[:5]}{more}")


def load_pretrained(folder: str | Path, dtype: torch.dtype | None = None) -> LoadedModel:
    """Load a Quicksilver-layout folder. Other families go through :mod:`quicksilver.families`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder not found")
    try:
        cfg = ModelConfig.load(folder / "config.json")
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    dtype = dtype or DTYPES.get(cfg.torch_dtype, torch.bfloat16)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    files = weight_files(folder)
    load_state_into(model, iter_safetensors(files), str(files[0] if len(files) == 1 else folder), dtype)
    model.eval()
    try:
        tokenizer = Tokenizer.load(folder)
    except TokenizerError as exc:
        raise CheckpointError(str(exc)) from None
    gen_path = folder / "generation_config.json"
    defaults = SamplingParams()
    if gen_path.is_file():
        try:
            defaults = generation_defaults(json.loads(gen_path.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{gen_path}: {exc}") from None
    return LoadedModel(model, tokenizer, defaults, folder, folder.name)
