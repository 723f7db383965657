"""Numeric variants of a loaded model: bf16, fp32, int8 or int8w, each optionally with its layers compiled.

Serving commands take ``--precision`` (one of :data:`PRECISIONS`) and ``--compile``; the benchmark names a compiled
variant "PRECISION+compile" (:data:`VARIANTS`).
int8 (:class:`Int8Linear`) stores every linear layer's weights in int8 with one scale per output row and quantises
its input to int8 with one scale per input row, then multiplies in int32 (``torch._int_mm``), which is exact. So a
row's output depends only on that row, as in a float model: batching, the prefix cache and chunked prefill leave
answers as they are. It runs faster than bf16 for the block decoder on this project's CPUs (an AVX-512 EPYC, and
an AMX Xeon: docs/performance.md sections 8 and 14); on 1,100 suite prompts the default scored as in bf16 and the
twin 2 lower (section 8). It is an option, not the default.

int8w (:class:`Int8WeightLinear`) keeps only the weights in int8 (one scale per output row) and multiplies bf16 inputs
by them in one fused kernel (``torch._weight_int8pack_mm``): no input quantisation to pay per call. For a single row
(an AR model's decode step) a linear layer runs 2-3x faster than in int8 or bf16 here; at a few dozen rows it
is slower than int8 (``python benchmarks/microbench.py linear``), which matters most in batched serving. So it suits
the AR twin's single stream, not the block decoder. Layers whose input size is not a multiple of 16 stay bf16: the
kernel is only right for those.

int8mix is int8 with each MLP's down projection (the product after SwiGLU, whose inputs have the widest spread)
in int8w: weights in int8, inputs unquantised. One scale per input row loses the most there: with those layers
int8w, about as many of the default's outputs match fp32's as bf16's do (docs/performance.md section 24), at close
to int8's speed for a decode step's rows.

Compiling (:func:`compile_layers`) fuses the elementwise work around each layer's matrix products with
``torch.compile``; the per-sequence attention stays eager, so one set of graphs serves any batch.
"""

from __future__ import annotations

import copy as copy_module
import functools
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quicksilver.model import (
    Attention,
    CopyHead,
    MoE,
    SwiGLU,
    Transformer,
    additive_mask,
    decode_step_outputs,
    single_sequence_forward,
    split_attention_inputs,
    split_attention_outputs,
)

PRECISIONS: tuple[str, ...] = ("bf16", "fp32", "int8", "int8w", "int8mix")  # what a served model may run in
COMPILED = "+compile"  # suffix of a variant whose layers are compiled (compile_layers)
VARIANTS: tuple[str, ...] = (*PRECISIONS, *(p + COMPILED for p in PRECISIONS))  # what the benchmark measures
QUANTISED: tuple[str, ...] = ("int8", "int8w", "int8mix")  # serving-only conversions: never saved as a model folder


def precision_of(model: Transformer) -> str:
    """The precision a loaded model runs in, named as ``--precision`` names it (another dtype: its torch name)."""
    int8 = any(isinstance(m, Int8Linear) for m in model.modules())
    int8w = any(isinstance(m, Int8WeightLinear) for m in model.modules())
    if int8 or int8w:
        return "int8mix" if int8 and int8w else "int8" if int8 else "int8w"
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(model.dtype, str(model.dtype).removeprefix("torch."))


def is_compiled(model: Transformer) -> bool:
    """Whether :func:`compile_layers` has compiled ``model``'s layers."""
    return any("attention_inputs" in vars(layer) for layer in getattr(model, "layers", ()))


def variant_of(model: Transformer) -> str:
    """The :data:`VARIANTS` name of what ``model`` runs as, e.g. "int8+compile"."""
    return precision_of(model) + (COMPILED if is_compiled(model) else "")


def as_variant(model: Transformer, variant: str, copy: bool = True) -> Transformer:
    """``model`` in ``variant`` (a copy unless ``copy`` is False): "bf16", "fp32", "int8" (every linear layer an
    :class:`Int8Linear`; embeddings, norms and attention stay float32), "int8w" (every linear layer an
    :class:`Int8WeightLinear`, the rest bf16) or "int8mix" (int8, but the MLP down projections int8w); with the
    suffix "+compile" its layers are then compiled
    (:func:`compile_layers`)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown model variant {variant!r} (known: {', '.join(VARIANTS)})")
    if is_compiled(model):
        raise ValueError("the model's layers are already compiled; convert from the uncompiled model")
    if any(isinstance(m, (Int8Linear, Int8WeightLinear)) for m in model.modules()):
        raise ValueError(f"the model is already in {precision_of(model)}; convert from the float model")
    model = copy_module.deepcopy(model) if copy else model
    precision = variant.removesuffix(COMPILED)
    model = _to_precision(model, precision)
    return compile_layers(model) if variant.endswith(COMPILED) else model


def _to_precision(model: Transformer, precision: str) -> Transformer:
    if precision == "bf16":
        return model.to(torch.bfloat16).eval()
    float_model = model.to(torch.bfloat16 if precision == "int8w" else torch.float32).eval()
    if precision == "fp32":
        return float_model
    stack_projections(float_model)

    def choose(_qualified: str, parent: nn.Module, layer: nn.Linear) -> type[nn.Module] | None:
        weight_only = precision == "int8w" or (
            precision == "int8mix" and isinstance(parent, SwiGLU) and layer is parent.down_proj)
        if weight_only and Int8WeightLinear.supports(layer):
            return Int8WeightLinear
        return None if precision == "int8w" else Int8Linear  # int8w: the kernel is wrong for such shapes, keep bf16

    quantise_linears(float_model, choose)
    return float_model


def quantise_linears(model: nn.Module, choose: Callable[[str, nn.Module, nn.Linear], type[nn.Module] | None]) -> None:
    """Replace ``model``'s linear layers in place: ``choose(qualified name, parent, layer)`` names the class to build
    from each (:class:`Int8Linear`, :class:`Int8WeightLinear`), or None to keep it. A mixture-of-experts router always
    stays float: it reads its weight directly, and its choices are discrete; so does a copy head (two tiny products
    per step, whose gate decides between copying and the vocabulary)."""
    for parent_name, parent, name, child in _quantisable_linears(model):
        quantised = choose(f"{parent_name}.{name}".lstrip("."), parent, child)
        if quantised is not None:
            setattr(parent, name, quantised(child))


def _quantisable_linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(parent's name, parent, attribute name, layer) of each linear layer that int8 quantises: all but a copy
    head's and a mixture-of-experts router's."""
    return [(parent_name, parent, name, child)
            for parent_name, parent in list(model.named_modules())
            for name, child in list(parent.named_children())
            if isinstance(child, nn.Linear) and not isinstance(parent, CopyHead)
            and not (isinstance(parent, MoE) and name == "gate")]


def round_to_int8_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded as int8 stores it: each row (last dimension) to 255 levels with one scale (its largest magnitude
    maps to 127), returned in ``t``'s dtype. Gradients pass straight through, as if no rounding happened."""
    rows = t.detach().float()
    scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    rounded = (rows / scale).round().clamp(-127, 127).mul(scale).to(t.dtype)
    return t + (rounded - t.detach())


class Int8AwareLinear(nn.Linear):
    """Training only: a linear layer that sees its weights and inputs rounded as :class:`Int8Linear` rounds them
    (one scale per weight output row, one per input row) and learns through the rounding with straight-through
    gradients. Weights that trained this way lose less when served in int8. Its state dict is a plain
    ``nn.Linear``'s, so a checkpoint or exported model does not know it was trained so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(round_to_int8_rows(x), round_to_int8_rows(self.weight), self.bias)


def make_int8_aware(model: nn.Module) -> int:
    """Make every linear layer that ``--precision int8`` quantises an :class:`Int8AwareLinear`, in place (the same
    parameters; only the forward changes). Returns how many layers changed."""
    layers = {id(child): child for *_, child in _quantisable_linears(model)}  # a tied head is one layer
    for layer in layers.values():
        layer.__class__ = Int8AwareLinear
    return len(layers)


def stack_projections(model: Transformer) -> None:
    """Replace each attention's q/k/v projections by one layer over their stacked rows, and each SwiGLU's gate and
    up projections likewise: one matrix product where there were three and two. At a decode step's few rows a
    product costs mostly its call, so this saves time; quantised per output row (as int8 and int8w are), the
    stacked layer computes exactly what the separate ones did. The last layer's attention stays as it is: its
    queries are projected only for the rows whose logits are wanted, which at many streams saves more."""
    # the shared stack's last attention (a draft tower's last layer projects every row: stacked like the others)
    layers = getattr(model, "layers", None)
    last_attention = [layers[-1].self_attn] if layers else [m for m in model.modules() if isinstance(m, Attention)][-1:]
    for module in model.modules():
        if isinstance(module, Attention) and module.qkv_proj is None and module not in last_attention:
            module.qkv_proj = _stacked([module.q_proj, module.k_proj, module.v_proj])
            module.q_proj = module.k_proj = module.v_proj = None
        elif isinstance(module, SwiGLU) and module.gate_up_proj is None:
            module.gate_up_proj = _stacked([module.gate_proj, module.up_proj])
            module.gate_proj = module.up_proj = None


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    first = linears[0]
    stacked = nn.Linear(first.in_features, sum(lin.out_features for lin in linears), bias=first.bias is not None,
                        device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if first.bias is not None:
            stacked.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return stacked


def check_compile_device(device: torch.device) -> None:
    """One-line ValueError unless layers can be compiled for ``device``: measured on the CPU only."""
    if device.type != "cpu":
        raise ValueError(f"--compile is measured on the CPU only; leave it off on {device}")


def compile_layers(model: Transformer, warm_up: bool = True) -> Transformer:
    """Compile, with ``torch.compile`` (inductor), the two tensor-only steps of every layer's packed forward: the
    norm, projections and rotation before attention, and the output projection, residuals and MLP after it
    (:meth:`quicksilver.model.Block.forward_packed`). The per-sequence attention between them stays eager, so
    no batch shape or request mix reaches the compiled code, only row counts, which are dynamic. Inductor fuses
    the elementwise work around each matrix product (norms, rotation, activation, int8 (de)quantisation), which
    at this model size is much of a forward's time.

    One compiled function serves every layer of one structure (each passes its own weights); layers built
    differently (int8's last layer, whose attention projections stay separate) get functions of their own.
    ``warm_up`` builds the graphs now (:func:`warm_up_layers`) rather than in the first request: about 40 s on this
    project's 2-core CPU the first time, seconds once inductor's on-disk cache has them. A mixture-of-experts MLP
    stays eager (its routing is data-dependent). Works in place on ``model`` and returns it; ``Transformer.forward``
    (training, the embedder) is unchanged. Outputs match the eager model's within float rounding (inductor fuses in
    float32). Set the thread count before compiling: dynamo guards on it, and a change would build the graphs
    again."""
    check_compile_device(model.device)
    options = {"guard_filter_fn": _guard_inputs_only}
    compiled: dict[tuple, tuple] = {}  # layer structure -> its two compiled functions
    for layer in [*model.layers, *(model.draft_layers or ())]:
        inputs, outputs = compiled.setdefault(_structure(layer), (
            torch.compile(_own_code(_attention_inputs), dynamic=True, options=options),
            torch.compile(_own_code(_attention_outputs), dynamic=True, options=options)))
        layer.attention_inputs = functools.partial(inputs, layer)
        if not isinstance(layer.mlp, MoE):
            layer.attention_outputs = functools.partial(outputs, layer)
    if model.draft_layers is not None:  # one request's clean and noisy rows: both weight sets in one graph
        model.split_inputs = torch.compile(_own_code(_split_inputs), dynamic=True, options=options)
        model.split_outputs = torch.compile(_own_code(_split_outputs), dynamic=True, options=options)
    if model.copy_head is not None:  # the copy head's pointers and mixture: dozens of small eager ops per step
        model.step_outputs = torch.compile(_own_code(decode_step_outputs), dynamic=True, options=options)
    if not any(isinstance(layer.mlp, MoE) for layer in model.layers):  # one sequence: one call per forward
        model.single_forward = torch.compile(_own_code(single_sequence_forward), dynamic=True, options=options)
    if warm_up:
        warm_up_layers(model)
    return model


@torch.inference_mode()  # as decoding runs: a graph built outside inference mode would not be reused in it
def warm_up_layers(model: Transformer) -> None:
    """Run the packed forward in the shapes decoding uses, so that the compiled graphs exist before real work.

    Row counts are dynamic, except that counts of 0 and 1 get graphs of their own (torch specialises them), and a
    first trace in which two sizes are equal assumes they always are (hence 13 rows and 5 wanted: counts unlikely
    to equal each other or a model dimension). The shapes: a prompt wanting some of its rows, a prefill chunk
    wanting none (chunked prefill), then steps of one row and of several over its keys, wanting one row, none or
    all of them. At most seven graphs before attention and two after it for each layer structure. Then, when they
    are compiled, the one-sequence forward's graphs (five) and the copy head's (five)."""
    single, model.single_forward = model.single_forward, None  # these packed shapes serve batches (below: one)
    try:
        _warm_up_packed(model)
    finally:
        model.single_forward = single
    if model.single_forward is not None:
        _warm_up_single_forward(model)
    if model.copy_head is not None:
        _warm_up_step_outputs(model)


def _warm_up_packed(model: Transformer) -> None:
    n, device = 13, model.device
    ids = torch.arange(n, device=device) % model.config.vocab_size
    positions = torch.arange(n, device=device)
    _, (past,) = model.forward_packed(ids, positions, [n], [None], [None], output_rows=[torch.arange(5)])
    model.forward_packed(ids, positions, [n], [None], [None], output_rows=[torch.arange(0)])
    for rows, wanted in ((1, 1), (1, 0), (n, 1), (3, 3)):
        model.forward_packed(ids[:rows], positions[:rows] + n, [rows], [None], [past],
                             output_rows=[torch.arange(wanted)])
    if model.draft_layers is not None:  # a self-speculative step: clean rows, then noisy ones through the tower
        model.forward_packed(ids, positions + n, [n], [None], [past], output_rows=[torch.arange(2, 9)],
                             draft_rows=torch.arange(n, device=device) >= 4)


def _warm_up_step_outputs(model: Transformer) -> None:
    """The copy head's step outputs for one request and for several, each wanting several rows or one, and for a
    request with a single key (a one-token prompt)."""
    n, device, cfg = 13, model.device, model.config
    for groups, rows, keys in ((1, 5, n), (1, 1, n), (1, 1, 1), (3, 5, n + 4), (2, 1, n + 4)):
        positions = torch.arange(keys, device=device).repeat(groups, 1)
        wanted = groups * rows - 1 if groups > 1 and rows > 1 else groups * rows  # one request short of Q rows
        model.step_outputs(
            model, torch.zeros(wanted, cfg.hidden_size, dtype=model.dtype, device=device),
            torch.zeros(groups, cfg.num_key_value_heads, keys, cfg.head_dim, dtype=model.dtype, device=device),
            positions % n, torch.ones(groups, rows, keys, dtype=torch.bool, device=device), positions,
            (torch.arange(rows, device=device) + keys - rows).repeat(groups, 1), torch.arange(wanted, device=device),
            keys + 2)


def _warm_up_single_forward(model: Transformer) -> None:
    """The one-sequence forward's graphs, as a decoder calls it: a prompt with no past, then steps over a past of
    cache views (normal tensors, see :class:`quicksilver.decoding.kv_cache.KVCache`), each with an attention mask
    (its values do not matter, only that there is one) and without one (a block that sees all its keys), wanting
    several rows (one wanted row is asked for twice: :meth:`Transformer.forward_packed`); and an autoregressive
    step (one row, no mask). Sizes differ from each other
    (17 keys, 13 rows, 5 wanted), so no graph assumes two of them equal."""
    cfg, device = model.config, model.device
    past_len, rows = 17, 13
    ids = torch.arange(past_len + rows, device=device) % cfg.vocab_size
    positions = torch.arange(past_len + rows, device=device)
    with torch.inference_mode(False):  # as the cache's buffers are: one per layer for keys, one for values
        buffers = [torch.zeros(1, cfg.num_key_value_heads, 64, cfg.head_dim, dtype=model.dtype, device=device)
                   for _ in range(2 * len(model.layers))]
    past = [(k[:, :, :past_len], v[:, :, :past_len]) for k, v in zip(buffers[::2], buffers[1::2], strict=True)]
    step = positions[past_len:].clone()  # fresh tensors (no storage offset), as a decoder's are
    for keys, prior in ((step, None), (positions, past)):
        mask = additive_mask(keys[None, :] <= step[:, None], model.dtype)  # causal: never all True
        # without a mask too: a block that sees all its keys (policies other than self_speculative decode so; a
        # graph built in the first such request cost it 1-2 s, docs/performance.md section 30)
        for m in (mask, None):
            model.single_forward(model, ids[past_len:].clone(), step, m, prior, torch.arange(5, device=device))
    model.single_forward(model, ids[past_len: past_len + 1].clone(), positions[past_len: past_len + 1].clone(),
                         None, past, torch.zeros(2, dtype=torch.long, device=device))  # one row, wanted twice


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own. Dynamo keeps its graphs, and its limit of recompiles, per code object:
    without this every compiled model in a process would share one list of graphs (the benchmark compiles seven),
    reach the limit and silently run eager, and models could take each other's graphs (see below)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _structure(layer: nn.Module) -> tuple[tuple[str, str], ...]:
    """What a compiled function may assume of a layer, its guards on the layer being dropped: its submodules'
    names and types (a projection stacked or not, a linear layer float or quantised)."""
    return tuple((name, type(module).__name__) for name, module in layer.named_modules())


def _guard_inputs_only(guards: list) -> list[bool]:
    """Keep dynamo's guards on the call's tensors (their shapes, dtypes, ``sel`` being None or not) and drop those
    on the layer module and on globals: about a hundred checks per call. Safe only because each compiled model has
    its own graphs (:func:`_own_code`), a served model's layers do not change, and the layers that share a compiled
    function have the same structure (:func:`_structure`; head counts and norms are one per model; a
    mixture-of-experts MLP is not compiled)."""
    return [not (g.is_global or g.name.startswith(("layer", "model"))) for g in guards]


def _attention_inputs(layer, x, cos, sin, sel=None):
    return type(layer).attention_inputs(layer, x, cos, sin, sel)


def _attention_outputs(layer, x, y):
    return type(layer).attention_outputs(layer, x, y)


def _split_inputs(layer, layer_draft, x, cos, sin, n_clean):  # (parameter names: see _guard_inputs_only)
    return split_attention_inputs(layer, layer_draft, x, cos, sin, n_clean)


def _split_outputs(layer, layer_draft, x, y, n_clean):
    return split_attention_outputs(layer, layer_draft, x, y, n_clean)


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
    """A linear layer with int8 weights (one scale per output row) and bf16 inputs: one fused kernel per call. The
    output has the input's dtype (bf16 in an int8w model, float32 in int8mix). Each output row depends only on
    its input row."""

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
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"
