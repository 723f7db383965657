"""Numeric variants of a loaded model: bf16, fp32, int8 dynamic quantisation, or a torch.compile'd bf16 copy.

Serving commands take ``--precision`` (one of :data:`PRECISIONS`); the benchmark also measures "compile".
On this project's CPUs (AVX-512 bf16, no AMX) int8 linear layers run faster than bf16 ones; the shipped models lose
about half a point of suite accuracy in int8 (docs/performance.md section 8), so it is an option, not the default.
int8 dynamic quantisation also scales activations once per forward input, so a row's numbers depend on the rows
beside it: batching, the prefix cache and chunked prefill change some greedy answers (float models give a row the
same numbers whatever shares its forward).
"""

from __future__ import annotations

import copy as copy_module
import warnings

import torch

from quicksilver.model import Transformer

PRECISIONS: tuple[str, ...] = ("bf16", "fp32", "int8")  # what a served model may run in
VARIANTS: tuple[str, ...] = (*PRECISIONS, "compile")  # what the benchmark measures


def as_variant(model: Transformer, variant: str, copy: bool = True) -> Transformer:
    """``model`` in ``variant`` (a copy unless ``copy`` is False): "bf16", "fp32", "int8" (dynamic per-row int8
    weights for every Linear, float32 activations; attention and norms stay float32) or "compile" (bf16, forward
    compiled by torch.compile with dynamic shapes and frozen weights: tens of seconds per new graph on first use)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown model variant {variant!r} (known: {', '.join(VARIANTS)})")
    model = copy_module.deepcopy(model) if copy else model
    if variant == "bf16":
        return model.to(torch.bfloat16).eval()
    if variant == "compile":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: this copy is for inference only
        compiled = model.to(torch.bfloat16).eval()
        compiled.forward = torch.compile(compiled.forward, dynamic=True)
        return compiled
    fp32 = model.to(torch.float32).eval()
    if variant == "fp32":
        return fp32
    with warnings.catch_warnings():  # torch.ao is deprecated in favour of torchao, which is not installed
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(fp32, {torch.nn.Linear}, dtype=torch.qint8, inplace=True).eval()
