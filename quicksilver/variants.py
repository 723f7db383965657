"""Numeric variants of a loaded model: bf16, fp32, int8, int8w, or a torch.compile'd bf16 copy.

Serving commands take ``--precision`` (one of :data:`PRECISIONS`); the benchmark also measures "compile".
int8 (:class:`Int8Linear`) stores every linear layer's weights in int8 with one scale per output row and quantises
its input to int8 with one scale per input row, then multiplies in int32 (``torch._int_mm``), which is exact. So a
row's output depends only on that row, as in a float model: batching, the prefix cache and chunked prefill leave
answers as they are. On this project's CPUs (AVX-512, no AMX) it runs faster than bf16; on 1,100 suite prompts the
shipped default scores as in bf16 and the twin 2 lower (docs/performance.md section 8). It is an option, not the
default.

int8w (:class:`Int8WeightLinear`) keeps only the weights in int8 (one scale per output row) and multiplies bf16 inputs
by them in one fused kernel (``torch._weight_int8pack_mm``): no input quantisation to pay per call. For a single row
(an AR model's decode step) a linear layer runs 2-3x faster than in int8 or bf16 here; at a few dozen rows it
is slower than int8 (``python benchmarks/microbench.py linear``), which matters most in batched serving. So it suits
the AR twin's single stream, not the block decoder. Layers whose input size is not a multiple of 16 stay bf16: the
kernel is only right for those.
"""

from __future__ import annotations

import copy as copy_module

import torch
from torch import nn

from quicksilver.model import MoE, Transformer

PRECISIONS: tuple[str, ...] = ("bf16", "fp32", "int8", "int8w")  # what a served model may run in
VARIANTS: tuple[str, ...] = (*PRECISIONS, "compile")  # what the benchmark measures
QUANTISED: tuple[str, ...] = ("int8", "int8w")  # serving-only conversions: never saved as a model folder


def precision_of(model: Transformer) -> str:
    """The precision a loaded model runs in, named as ``--precision`` names it (another dtype: its torch name)."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return "int8"
    if any(isinstance(m, Int8WeightLinear) for m in model.modules()):
        return "int8w"
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(model.dtype, str(model.dtype).removeprefix("torch."))


def as_variant(model: Transformer, variant: str, copy: bool = True) -> Transformer:
    """``model`` in ``variant`` (a copy unless ``copy`` is False): "bf16", "fp32", "int8" (every linear layer an
    :class:`Int8Linear`; embeddings, norms and attention stay float32), "int8w" (every linear layer an
    :class:`Int8WeightLinear`, the rest bf16) or "compile" (bf16, forward compiled by
    torch.compile with dynamic shapes and frozen weights: tens of seconds per new graph on first use)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown model variant {variant!r} (known: {', '.join(VARIANTS)})")
    if any(isinstance(m, (Int8Linear, Int8WeightLinear)) for m in model.modules()):
        raise ValueError(f"the model is already in {precision_of(model)}; convert from the float model")
    model = copy_module.deepcopy(model) if copy else model
    if variant == "bf16":
        return model.to(torch.bfloat16).eval()
    if variant == "compile":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: this copy is for inference only
        compiled = model.to(torch.bfloat16).eval()
        compiled.forward = torch.compile(compiled.forward, dynamic=True)
        return compiled
    float_model = model.to(torch.bfloat16 if variant == "int8w" else torch.float32).eval()
    if variant == "fp32":
        return float_model
    quantised = Int8WeightLinear if variant == "int8w" else Int8Linear
    for module in list(float_model.modules()):
        for name, child in list(module.named_children()):
            # a mixture-of-experts router stays float: it reads its weight directly, and its choices are discrete
            if isinstance(child, nn.Linear) and not (isinstance(module, MoE) and name == "gate"):
                if quantised is Int8WeightLinear and not Int8WeightLinear.supports(child):
                    continue  # the fused kernel is wrong for such shapes: this layer stays bf16
                setattr(module, name, quantised(child))
    return float_model


def quantise_weight_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 with one float32 scale per output row (its largest magnitude maps to 127)."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    return (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    """A linear layer in int8: weights with one scale per output row, inputs quantised with one scale per input
    row (so rows stay independent), products summed exactly in int32, then scaled back to float32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantise_weight_rows(linear.weight)
        self.register_buffer("weight_t", weight.t().contiguous())  # [in, out], the layout torch._int_mm multiplies by
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        y = torch._int_mm((rows / scale).round_().to(torch.int8), self.weight_t).float()
        y = y.mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


INT8W_ALIGN = 16  # torch._weight_int8pack_mm gives wrong results (or crashes) for other input sizes


class Int8WeightLinear(nn.Module):
    """A linear layer with int8 weights (one scale per output row) and bf16 inputs and outputs: one fused kernel
    per call. Each output row depends only on its input row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if not self.supports(linear):
            raise ValueError(f"int8w needs an input size divisible by {INT8W_ALIGN}, not {linear.in_features}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantise_weight_rows(linear.weight)
        # not named "weight": a quantised layer must never pass for a float one in a saved state dict
        self.register_buffer("weight_int8", weight.contiguous())
        self.register_buffer("weight_scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return linear.in_features % INT8W_ALIGN == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(rows, self.weight_int8, self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"
