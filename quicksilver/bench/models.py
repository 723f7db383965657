"""Preparing a model for a benchmark variant: dtype, int8 dynamic quantisation, thread count."""

from __future__ import annotations

import copy
import warnings

import torch

from quicksilver.model import Transformer

VARIANTS: tuple[str, ...] = ("bf16", "fp32", "int8", "compile")


def prepare(model: Transformer, variant: str) -> Transformer:
    """A copy of ``model`` in ``variant``: "bf16", "fp32", "int8" (dynamic per-row int8 weights for every
    Linear, float32 activations; attention and norms stay float32) or "compile" (bf16, forward compiled by
    torch.compile with dynamic shapes and frozen weights: tens of seconds per new graph on first use)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown model variant {variant!r} (known: {', '.join(VARIANTS)})")
    if variant == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16).eval()
    if variant == "compile":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: this copy is for inference only
        compiled = copy.deepcopy(model).to(torch.bfloat16).eval()
        compiled.forward = torch.compile(compiled.forward, dynamic=True)
        return compiled
    fp32 = copy.deepcopy(model).to(torch.float32).eval()
    if variant == "fp32":
        return fp32
    with warnings.catch_warnings():  # torch.ao is deprecated in favour of torchao, which is not installed
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(fp32, {torch.nn.Linear}, dtype=torch.qint8).eval()


def set_threads(n: int) -> int:
    """Set intra-op threads (returns the previous setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    return before
