"""Where a model runs: the CPU (the default) or a CUDA accelerator.

Only the forward moves: the decode loop keeps its bookkeeping (canvas, policies, constraints) on the CPU and
reads the wanted rows' logits back once per step (``Decoder.step``); the KV caches live beside the model.
"""

from __future__ import annotations

import torch

from quicksilver.model import Transformer
from quicksilver.variants import QUANTISED, precision_of

DEVICE_TYPES = ("cpu", "cuda")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """A usable device for ``name`` (None: the CPU), or a one-line ValueError."""
    if name is None:
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device {name!r}: {str(exc).split(' device type at start')[0]}") from None
    if device.type not in DEVICE_TYPES:
        raise ValueError(f"device {name!r}: only {' and '.join(DEVICE_TYPES)} are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: torch sees no CUDA device on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def check_precision(precision: str | None, device: torch.device) -> None:
    """One-line ValueError unless a model in ``precision`` can run on ``device``."""
    if device.type != "cpu" and precision in QUANTISED:  # torch._int_mm on rows, _weight_int8pack_mm: CPU kernels
        raise ValueError(f"precision {precision} runs on the CPU only; use bf16 or fp32 on {device}")


def place_model(model: Transformer, device: str | torch.device | None) -> Transformer:
    """Move ``model`` to ``device`` (in place; returns it)."""
    device = resolve_device(device)
    if device.type == "cpu":
        return model.to(device)
    check_precision(precision_of(model), device)
    # cuDNN's attention builds a plan per new shape (about 0.1 s each on an H200, docs/performance.md section 10),
    # and decode steps bring new shapes all the time (prompt lengths, packed batches): use the other kernels
    torch.backends.cuda.enable_cudnn_sdp(False)
    return model.to(device)
