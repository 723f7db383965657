"""The Quicksilver transformer: one implementation, three attention modes.

A LLaMA-style decoder stack (RoPE, RMSNorm, SwiGLU, grouped-query attention, optional tied embeddings,
optional mixture-of-experts MLP). What makes it a diffusion model or an autoregressive one is only the
attention mask it is run with:

* ``bidirectional``  every position sees every position (LLaDA / MDLM / Dream),
* ``block_causal``   causal across blocks of ``block_size`` tokens, bidirectional inside a block
                     (BD3-LM / SDAR / Fast-dLLM v2); finished blocks have exact KV caches. With
                     ``causal_context`` only the block being decoded is bidirectional and finished blocks
                     are plain causal text (a "context-causal" mask), computed as an AR model computes them,
* ``causal``         ordinary left-to-right attention (the autoregressive twin).

The model is stateless: ``forward`` takes the keys/values of earlier positions (``past``) and returns
the keys/values of its own inputs, so the decode loop decides what to cache. ``forward`` returns final
hidden states; ``logits`` projects only the rows the caller asks for, because a diffusion step needs
the vocabulary only at positions that are still masked.

With ``copy_head`` (our own models only) the output is a mixture of the vocabulary distribution and a pointer
over the tokens the position can see (:class:`CopyHead`), returned as log-probabilities so that every caller
that treats the output as logits (softmax, argmax, cross-entropy) works unchanged.

With ``draft_layers`` (block-causal with a causal context only) the noisy rows, the drafts, run through a second
stack of layers (a draft tower) that reads the shared layers' keys of the clean rows. Clean rows never attend to
noisy rows, so the clean causal stream is what the shared layers compute alone: drafts trained with the shared
weights frozen make a self-speculative decoder faster without changing its answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quicksilver.config import ModelConfig

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values), each [batch, kv_heads, seq, head_dim]


def attention_mask(
    mode: str, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int, causal_context: bool = False
) -> torch.Tensor | None:
    """Boolean mask [..., T, S] (True = may attend) from absolute query and key positions.

    Works on positions rather than indices so the same rule serves training, prefill and cached steps.
    Returns None for bidirectional attention (nothing to mask). With ``causal_context`` the block being
    decoded is the last block among the keys (the decoder never feeds positions past it).
    """
    if mode == "bidirectional":
        return None
    q = q_pos.unsqueeze(-1)
    k = k_pos.unsqueeze(-2)
    if mode == "causal":
        return k <= q
    if mode == "block_causal":
        bq = torch.div(q, block_size, rounding_mode="floor")
        bk = torch.div(k, block_size, rounding_mode="floor")
        if not causal_context:
            return bk <= bq
        current = torch.div(k_pos.amax(-1, keepdim=True), block_size, rounding_mode="floor").unsqueeze(-1)
        return torch.where(bq == current, bk <= bq, k <= q)
    raise ValueError(f"unknown attention mode {mode!r}")


def config_mask(cfg: ModelConfig, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
    """:func:`attention_mask` with a model config's own rule."""
    return attention_mask(cfg.attention_mode, q_pos, k_pos, cfg.block_size, cfg.causal_context)


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask [T, S] as the packed forward takes it: None when every query sees every key (the fused
    kernel then skips masking), else an additive float mask [1, 1, T, S] (0 or -inf). Attention converts a boolean
    mask the same way, but in every layer; converted once, the numbers are the same."""
    if mask is None or bool(mask.all()):
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[None, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32: bf16 sums of squares lose too much precision
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, 1, T, head_dim] for absolute positions [B, T] (HF "rotate half" layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot < x.shape[-1]:  # partial rotary: only the first `rot` dims of each head are rotated
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        assert self.head_dim is not None
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        # a serving variant may replace q/k/v by one product over their stacked rows (quicksilver.variants)
        self.qkv_proj: nn.Module | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        past: KV | None,
    ) -> tuple[torch.Tensor, KV]:
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        v = v.view(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        new_kv = (k, v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        y = self.sdpa(q, k, v, mask).transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.o_proj(y), new_kv

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of queries [B, H, T, D] over keys and values [B, KV, S, D] (grouped when KV < H)."""
        if self.n_kv == self.n_heads:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if q.is_cuda and mask is not None:  # CUDA's memory-efficient kernel (it takes masks) has no grouped mode
            group = self.n_heads // self.n_kv
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query, key and value projections of ``x`` [..., d] (heads not split yet)."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        return self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)

    def project_packed(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sel: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [1, heads, rows, D] of packed rows ``x`` [1, N, d], rotated. Keys and values
        cover every row; queries only rows ``sel`` when it is given (the last layer needs no other outputs)."""
        _, n, _ = x.shape
        cq, sq = (cos, sin) if sel is None else (cos[:, :, sel], sin[:, :, sel])
        if self.qkv_proj is None:  # separate projections: queries only for the wanted rows
            k, v = self.k_proj(x), self.v_proj(x)
            q = self.q_proj(x if sel is None else x[:, sel])
        else:
            q, k, v = self.project_qkv(x)
            q = q if sel is None else q[:, sel]
        k = k.view(1, n, self.n_kv, self.head_dim)
        v = v.view(1, n, self.n_kv, self.head_dim)
        q = q.reshape(1, q.shape[1], self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q.transpose(1, 2), cq, sq), apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def attend_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: list[int],
        masks: list[torch.Tensor | None],
        pasts: list[KV | None],
        query_rows: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Attention of several sequences packed along the rows (from :meth:`project_packed`), each over its own
        keys (its past, then its own rows), so each sequence sees exactly the shapes it would see alone.
        Returns the heads' outputs [1, rows with queries, heads x D] (before ``o_proj``) and each sequence's
        new (k, v) [1, H, T_i, D]."""
        q_lengths = lengths if query_rows is None else [int(r.numel()) for r in query_rows]
        outs: list[torch.Tensor] = []
        new_kvs: list[KV] = []
        start = q_start = 0
        for i, (t, tq, mask, past) in enumerate(zip(lengths, q_lengths, masks, pasts, strict=True)):
            rows, q_rows = slice(start, start + t), slice(q_start, q_start + tq)
            start, q_start = start + t, q_start + tq
            ki, vi = k[:, :, rows], v[:, :, rows]
            new_kvs.append((ki, vi))
            if tq == 0:
                continue
            if past is not None:
                ki = torch.cat([past[0], ki], dim=2)
                vi = torch.cat([past[1], vi], dim=2)
            if mask is not None and query_rows is not None:
                mask = mask[:, :, query_rows[i]]
            outs.append(self.sdpa(q[:, :, q_rows], ki, vi, mask))
        if not outs:
            return q.new_zeros(1, 0, self.n_heads * self.head_dim), new_kvs
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return y.transpose(1, 2).reshape(1, q_start, self.n_heads * self.head_dim), new_kvs


def _global_rows(query_rows: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """Per-sequence row indices -> indices into the packed rows."""
    offsets = [0]
    for t in lengths[:-1]:
        offsets.append(offsets[-1] + t)
    return torch.cat([r + o for r, o in zip(query_rows, offsets, strict=True)]).long()


def _merge(a: torch.Tensor, b: torch.Tensor, rows_a: torch.Tensor, rows_b: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``a`` and ``b`` (along ``dim``) put back at their places ``rows_a`` and ``rows_b``."""
    shape = list(a.shape)
    shape[dim] = rows_a.numel() + rows_b.numel()
    return a.new_empty(shape).index_copy_(dim, rows_a, a).index_copy_(dim, rows_b, b)


def _row_slice(x: torch.Tensor, start: int, end: int | None) -> torch.Tensor:
    """Rows ``start:end`` of ``x`` [1, N, d] as [1, n, d] with the strides of a tensor of that shape. ``x[:, a:b]``
    keeps the batch stride N x d, and oneDNN's bf16 matrix product then takes a path 4-5x slower (170-185 against
    41-43 us for 9 x 256 @ 256 x 512 on this CPU, 1 thread: benchmarks/row_slice_matmul.py)."""
    return x[0, start:end].unsqueeze(0)


def decode_step_outputs(
    model: Transformer, hidden: torch.Tensor, keys: torch.Tensor, tokens: torch.Tensor, visible: torch.Tensor,
    key_positions: torch.Tensor, query_positions: torch.Tensor, rows: torch.Tensor, position_bound: int,
) -> torch.Tensor:
    """A copy-head model's outputs [N, V] in a decoding step of B requests, in one call: their N wanted rows
    ``hidden`` [N, d] sit at the flat places ``rows`` [N] of a [B, Q] grid (Q: the most rows a request wants) whose
    rows are at ``query_positions`` [B, Q]; each request's last-layer keys [B, KV, S, D] (S: the most keys; padding
    holds the mask token and is never visible), ``tokens`` and ``key_positions`` [B, S], ``visible`` [B, Q, S]. What
    :meth:`Transformer.output_logits` gives, without its data-dependent branches, so
    :func:`quicksilver.variants.compile_layers` can compile it (``position_bound``: more than the largest key
    position + 1)."""
    b, q = query_positions.shape
    grid = hidden.new_zeros(b * q, hidden.shape[-1]).index_copy(0, rows, hidden).view(b, q, -1)
    p = model.copy_head.batched_pointers(grid, query_positions, keys, tokens, visible, key_positions, position_bound)
    pointers = Pointers(*(t.flatten(0, 1).index_select(0, rows) for t in (p.probs, p.gate, p.values)))
    return CopyHead.mix(model.logits(hidden), pointers)


def single_sequence_forward(
    model: Transformer, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
    past: list[KV] | None, output_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, list[KV]]:
    """:meth:`Transformer.forward_packed` for one sequence (``mask``, ``past`` and ``output_rows`` its only
    entries; ``output_rows`` not empty) and no draft tower, as one tensor-only function:
    :func:`quicksilver.variants.compile_layers` compiles it whole, attention included, so a single stream's step
    is one compiled call instead of two per layer with eager attention between them."""
    x = model.embed_tokens(input_ids.unsqueeze(0))
    rot_dim = int(model.config.head_dim * model.config.partial_rotary_factor)
    cos, sin = rope_cos_sin(positions.unsqueeze(0), rot_dim, model.config.rope_theta, x.dtype)
    new_kvs: list[KV] = []
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        sel = output_rows if i == last else None
        q, k, v = Block.attention_inputs(layer, x, cos, sin, sel)
        new_kvs.append((k, v))
        if past is not None:
            k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)
        attn = layer.self_attn
        y = attn.sdpa(q, k, v, mask if mask is None or sel is None else mask[:, :, sel])
        y = y.transpose(1, 2).reshape(1, q.shape[2], attn.n_heads * attn.head_dim)
        x = Block.attention_outputs(layer, x if sel is None else x[:, sel], y)
    return model.norm(x)[0], new_kvs


def split_attention_inputs(layer, layer_draft, x, cos, sin, n_clean: int):
    """:meth:`Block.attention_inputs` of rows ``x`` [1, N, d] whose first ``n_clean`` rows are clean (shared weights)
    and the rest noisy (``layer_draft``'s weights): queries, keys and values of all N rows, in order."""
    c = n_clean
    qc, kc, vc = type(layer).attention_inputs(layer, _row_slice(x, 0, c), cos[:, :, :c], sin[:, :, :c])
    qn, kn, vn = type(layer_draft).attention_inputs(layer_draft, _row_slice(x, c, None), cos[:, :, c:], sin[:, :, c:])
    return torch.cat([qc, qn], 2), torch.cat([kc, kn], 2), torch.cat([vc, vn], 2)


def split_attention_outputs(layer, layer_draft, x, y, n_clean: int):
    """:meth:`Block.attention_outputs` of rows whose first ``n_clean`` are clean, the rest noisy."""
    c = n_clean
    return torch.cat([type(layer).attention_outputs(layer, _row_slice(x, 0, c), _row_slice(y, 0, c)),
                      type(layer_draft).attention_outputs(layer_draft, _row_slice(x, c, None), _row_slice(y, c, None))],
                     1)


def _split_layer_packed(model, i, split, x, cos, sin, lengths, masks, pasts, query_rows):
    """Layer ``i``'s :meth:`Block.forward_packed` with the noisy rows run through its draft layer: the projections and
    MLP of clean and noisy rows use their own weights, attention runs once over all rows as usual. ``split`` is the
    number of clean rows when they all come before the noisy ones (one request: two slices, and with compiled
    layers two compiled calls as without a tower), else (clean rows, noisy rows, noisy [N])."""
    layer, layer_draft = model.layers[i], model.draft_layers[i]
    sel = None if query_rows is None else _global_rows(query_rows, lengths)
    if isinstance(split, int):
        q, k, v = model.split_inputs(layer, layer_draft, x, cos, sin, split)
    else:
        clean, noisy, is_noisy = split
        qc, kc, vc = layer.attention_inputs(x[:, clean], cos[:, :, clean], sin[:, :, clean])
        qn, kn, vn = layer_draft.attention_inputs(x[:, noisy], cos[:, :, noisy], sin[:, :, noisy])
        q, k, v = (_merge(c, n, clean, noisy, 2) for c, n in ((qc, qn), (kc, kn), (vc, vn)))
    if sel is not None:
        q, x = q[:, :, sel], x[:, sel]
    y, new_kvs = layer.self_attn.attend_packed(q, k, v, lengths, masks, pasts, query_rows)
    if y.shape[1] == 0:
        return x, new_kvs
    if isinstance(split, int):  # rows are sorted, so the wanted clean rows still come first
        n_clean = split if sel is None else int((sel < split).sum())
        return model.split_outputs(layer, layer_draft, x, y, n_clean), new_kvs
    is_noisy = is_noisy if sel is None else is_noisy[sel]
    out_clean, out_noisy = (~is_noisy).nonzero().squeeze(-1), is_noisy.nonzero().squeeze(-1)
    return _merge(layer.attention_outputs(x[:, out_clean], y[:, out_clean]),
                  layer_draft.attention_outputs(x[:, out_noisy], y[:, out_noisy]), out_clean, out_noisy, 1), new_kvs


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.gate_up_proj: nn.Module | None = None  # a serving variant's stacked gate/up product (variants.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts plus optional always-on shared experts (LLaDA2 / Ling style)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.moe_intermediate_size or cfg.intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.score = cfg.moe_router_score
        self.norm_topk = cfg.moe_norm_topk_prob
        self.scale = cfg.moe_routed_scaling_factor
        self.n_group = cfg.moe_n_group
        self.topk_group = cfg.moe_topk_group
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.moe_router_bias else None
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, hidden) for _ in range(cfg.num_experts))
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, hidden * cfg.num_shared_experts) if cfg.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        # routing in float32: bf16 router logits flip near-tied expert choices
        logits = F.linear(flat.float(), self.gate.weight.float())
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(-1)
        choose = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.n_group > 1:
            choose = self._limit_to_groups(choose)
        _, idx = choose.topk(self.top_k, dim=-1)
        weights = scores.gather(-1, idx)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        weights = (weights * self.scale).to(x.dtype)
        out = torch.zeros_like(flat)
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weights[rows, slot].unsqueeze(-1))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def _limit_to_groups(self, choose: torch.Tensor) -> torch.Tensor:
        """Keep only the experts of each token's ``topk_group`` best groups (others get -inf)."""
        n = choose.shape[0]
        grouped = choose.view(n, self.n_group, choose.shape[-1] // self.n_group)  # n may be 0 (no output rows)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best = group_score.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, choose.shape[-1])


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        use_moe = cfg.num_experts > 0 and layer >= cfg.first_k_dense_layers
        self.mlp = MoE(cfg) if use_moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask, past):
        h, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_kv

    def forward_packed(self, x, cos, sin, lengths, masks, pasts, query_rows=None):
        """The layer over several sequences packed along the rows of ``x`` [1, N, d] (see
        :meth:`Transformer.forward_packed`). Everything but attention runs once over all rows, in the two
        tensor-only steps :meth:`attention_inputs` and :meth:`attention_outputs`: those are what
        :func:`quicksilver.variants.compile_layers` compiles, whatever the batch."""
        sel = None if query_rows is None else _global_rows(query_rows, lengths)
        q, k, v = self.attention_inputs(x, cos, sin, sel)
        y, new_kvs = self.self_attn.attend_packed(q, k, v, lengths, masks, pasts, query_rows)
        if sel is not None:
            x = x[:, sel]
        if y.shape[1] == 0:  # no sequence wants an output row
            return x, new_kvs
        return self.attention_outputs(x, y), new_kvs

    def attention_inputs(self, x, cos, sin, sel=None):
        return self.self_attn.project_packed(self.input_layernorm(x), cos, sin, sel)

    def attention_outputs(self, x, y):
        x = x + self.self_attn.o_proj(y)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class CopyContext:
    """What a copy head reads besides the rows' hidden states, for rows grouped by the keys they attend to (G
    groups of Q rows over S keys): the rows' positions [G, Q], the last layer's keys [G, KV, S, D] (rotated), those
    keys' input tokens [G, S], which keys each row may attend to [G, Q, S] (the attention mask's rows) and the
    keys' positions [G, S] (induction pointers only: which key holds the token after a key)."""

    query_positions: torch.Tensor
    keys: torch.Tensor
    tokens: torch.Tensor
    visible: torch.Tensor
    key_positions: torch.Tensor | None = None


@dataclass
class Pointers:
    """A copy head's pointers for N rows over S keys: probabilities [N, P, S] (zero where a pointer cannot land),
    the gate's mixture weights [N, 1 + P] (vocabulary first) and the token each pointer copies from each key [N, P, S]
    (the key's own token, or for an induction pointer the token after it)."""

    probs: torch.Tensor
    gate: torch.Tensor
    values: torch.Tensor


class CopyHead(nn.Module):
    """A pointer over the context (pointer-generator style), for models too small to learn copying.

    At 5.5M parameters neither shipped model copies names or numbers from its prompt: it starts a copied value
    with a plausible but wrong token (MODEL_CARD). The copy head is one extra query per key/value head, read from
    the final hidden state and rotated at the row's position, against the last layer's own keys (already computed
    and cached, so decoding needs no new cache). Each head's softmax over the keys the row may attend to, with the
    keys' tokens as values, is a distribution over copied tokens; a gate mixes the vocabulary distribution with
    the heads'. Keys holding a mask token are never copied: they say nothing yet.

    With ``copy_head_induction`` each key/value head has a second, induction pointer: it copies the token *after*
    the key it points at, where the row may see that token too. Having copied "56" of "5678", a row can point at
    the "56" in the prompt (its own input token) and copy the "78" that follows, as an induction head would.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.head_dim is not None
        self.n_kv, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.n_pointers = self.n_kv * (2 if cfg.copy_head_induction else 1)  # copy pointers, then induction ones
        self.rot_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rope_theta, self.mask_token_id = cfg.rope_theta, cfg.mask_token_id
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_pointers * self.head_dim, bias=False)
        self.gate = nn.Linear(cfg.hidden_size, 1 + self.n_pointers)

    def reset_parameters(self) -> None:
        """Start close to the model without the head: no query (uniform pointers) and a gate that gives the
        pointers P / (e^4 + P) of the mass (3.5% with two, 6.8% with four): enough gradient to learn from."""
        nn.init.zeros_(self.q_proj.weight)
        nn.init.zeros_(self.gate.weight)
        with torch.no_grad():
            self.gate.bias.copy_(torch.tensor([4.0] + [0.0] * self.n_pointers))

    def pointer_weights(self, hidden: torch.Tensor, ctx: CopyContext, select: torch.Tensor | None = None) -> Pointers:
        """The pointers of the rows ``select`` [G, Q] (bool; default all) of ``hidden`` [G, Q, d], as [N, ...]
        tensors in ``hidden[select]`` order, over the keys some selected row sees. Only those rows and keys are
        computed: a training row over [x_t || x_0] scores a few hundred of its thousand rows, each row's scores
        span every key, and a clean row sees none of x_t."""
        if select is None:
            select = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        seen = ctx.visible[select].any(0)  # [S]; none when no row is selected (a forward with no outputs to read)
        if bool(seen.any()) and not bool(seen.all()):
            ctx = CopyContext(ctx.query_positions, ctx.keys[:, :, seen], ctx.tokens[:, seen], ctx.visible[..., seen],
                              None if ctx.key_positions is None else ctx.key_positions[:, seen])
        parts = [self._group_pointers(hidden[g][rows], ctx, g, rows) for g, rows in enumerate(select)]
        return Pointers(torch.cat([p.probs for p in parts]), torch.cat([p.gate for p in parts]),
                        torch.cat([p.values for p in parts]))

    def _group_pointers(self, h: torch.Tensor, ctx: CopyContext, g: int, rows: torch.Tensor) -> Pointers:
        """The pointers of the rows ``rows`` [Q] (bool) of group ``g``, whose hidden states are ``h`` [n, d]."""
        if self.n_pointers > self.n_kv and ctx.key_positions is None:
            raise ValueError("induction pointers need the keys' positions (CopyContext.key_positions)")
        key_positions = None if ctx.key_positions is None else ctx.key_positions[g][None]
        p = self.batched_pointers(h[None], ctx.query_positions[g][rows][None], ctx.keys[g][None],
                                  ctx.tokens[g][None], ctx.visible[g][rows][None], key_positions)
        return Pointers(p.probs[0], p.gate[0], p.values[0])

    def batched_pointers(
        self, h: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, tokens: torch.Tensor,
        visible: torch.Tensor, key_positions: torch.Tensor | None, position_bound: int | None = None,
    ) -> Pointers:
        """The pointers of B groups of n rows at once: hidden states ``h`` [B, n, d] at ``query_positions`` [B, n],
        each group over its own keys [B, KV, S, D] holding ``tokens`` [B, S] at ``key_positions`` [B, S], as
        ``visible`` [B, n, S] allows. Returns [B, n, ...] tensors. A row that sees no key (padding) gets none."""
        b, n = h.shape[:2]
        q = self.q_proj(h).view(b, n, self.n_pointers, self.head_dim).transpose(1, 2)  # [B, P, n, hd]
        cos, sin = rope_cos_sin(query_positions, self.rot_dim, self.rope_theta, q.dtype)
        q = apply_rope(q, cos, sin)
        # pointer p reads key/value head p % KV: the pointers of one head as one product over its keys (repeating
        # the keys for every pointer instead copied them all, the largest cost of a many-request step)
        s, r = keys.shape[2], self.n_pointers // self.n_kv
        q_by_head = q.float().view(b, r, self.n_kv, n, self.head_dim).transpose(1, 2).reshape(
            b, self.n_kv, r * n, self.head_dim)  # not -1: a group may select no row (n = 0)
        scores = (q_by_head @ keys.float().transpose(-1, -2)).view(b, self.n_kv, r, n, s).transpose(1, 2)
        scores = scores.reshape(b, self.n_pointers, n, s) / math.sqrt(self.head_dim)  # [B, P, n, S]
        copyable = visible & (tokens[:, None] != self.mask_token_id)  # [B, n, S]
        allowed, values = [copyable] * self.n_kv, [tokens[:, None].expand(b, n, -1)] * self.n_kv
        if self.n_pointers > self.n_kv:
            nxt = self._following(key_positions, tokens, visible, position_bound)
            allowed += [copyable & (nxt != self.mask_token_id)] * self.n_kv
            values += [nxt] * self.n_kv
        allowed = torch.stack(allowed, 2)  # [B, n, P, S]
        scores = scores.transpose(1, 2).masked_fill(~allowed, float("-inf"))
        pointers = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a pointer with no key left: all zero
        # a pointer with nothing to copy gets none of the mass (and no gradient); the vocabulary always can
        empty = ~allowed.any(-1)  # [B, n, P]
        gate_logits = self.gate(h).float()
        gate_logits = torch.cat([gate_logits[..., :1], gate_logits[..., 1:].masked_fill(empty, float("-inf"))], -1)
        return Pointers(pointers, torch.softmax(gate_logits, dim=-1), torch.stack(values, 2))

    def _following(self, positions: torch.Tensor, tokens: torch.Tensor, visible: torch.Tensor,
                   position_bound: int | None = None) -> torch.Tensor:
        """[B, n, S]: for B groups of rows that see the keys ``visible`` [B, n, S] (at ``positions`` [B, S], holding
        ``tokens`` [B, S]), the token at each key's position + 1 as the row sees it (the mask token where the row
        sees none there). A row sees at most one key per position, but not always in the next column: a training
        row over [x_t || x_0] reads the clean keys before its block and the noisy ones in it. ``position_bound``
        (at least the largest position + 2; default exactly that) sizes the scratch table, so a compiled caller
        need not read it."""
        b, n = visible.shape[:2]
        # positions 0 .. max + 1, then a slot for the keys a row does not see
        size = int(positions.max()) + 2 if position_bound is None else position_bound
        slot = torch.where(visible, positions[:, None], size)  # [B, n, S]
        seen = torch.full((b, n, size + 1), self.mask_token_id, dtype=tokens.dtype, device=positions.device)
        seen.scatter_(2, slot, tokens[:, None].expand(b, n, -1))
        return seen.gather(2, (positions + 1)[:, None].expand(b, n, -1))

    @staticmethod
    def mix(logits: torch.Tensor, pointers: Pointers) -> torch.Tensor:
        """Log-probabilities [N, V] of the mixture, for N rows: logits [N, V] float32 and their pointers."""
        copied = pointers.probs * pointers.gate[:, 1:, None]  # [N, P, S]: each pointer's weight on each key
        probs = torch.softmax(logits, dim=-1) * pointers.gate[:, :1]
        probs = probs.scatter_add(1, pointers.values.flatten(1), copied.flatten(1))
        return probs.clamp_min(1e-30).log()

    @staticmethod
    def target_nll(pointers: Pointers, targets: torch.Tensor) -> torch.Tensor:
        """The pointers' own NLL of each row's target [N], pointers averaged, for the rows where some pointer
        can land on a key that gives it: [M] (M <= N)."""
        hits = (pointers.values == targets[:, None, None]) & (pointers.probs > 0)
        rows = hits.flatten(1).any(-1)
        mass = (pointers.probs[rows] * hits[rows]).sum(-1).mean(-1)
        return -mass.clamp_min(1e-30).log()


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.copy_head = CopyHead(cfg) if cfg.copy_head else None
        # the noisy rows' own layers (draft tower): clean rows never attend to noisy rows, so with these the clean
        # (causal) stream is computed by ``layers`` alone, whatever the drafts' weights are
        self.draft_layers = (nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
                             if cfg.draft_layers else None)
        # a layer's two weight sets over one request's rows; quicksilver.variants.compile_layers compiles these
        self.split_inputs, self.split_outputs = split_attention_inputs, split_attention_outputs
        self.step_outputs = decode_step_outputs  # a copy head's outputs in a decoding step; compiled alike
        # one sequence's whole forward, set (compiled) by compile_layers; eager models take the packed path
        self.single_forward: Callable | None = None
        self.apply(self._init_weights)
        if self.copy_head is not None:
            self.copy_head.reset_parameters()

    def copy_layers_to_drafts(self) -> None:
        """Start the draft tower as a copy of the shared layers: the drafts then begin as the model without a tower
        computes them (e.g. an AR model's weights run as a block model), and training specialises them."""
        if self.draft_layers is not None:
            self.draft_layers.load_state_dict(self.layers.state_dict())

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def make_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """The model's own attention rule, as a [B, 1, T, S] mask (None when nothing is masked)."""
        m = config_mask(self.config, q_pos, k_pos)
        return None if m is None else m.unsqueeze(1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None | str = "auto",
        past: list[KV] | None = None,
        noisy: bool = False,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Run the stack.

        input_ids: [B, T]; positions: [B, T] absolute positions (default 0..T-1 after the past);
        mask: bool [B, 1, T, S+T] (True = attend), None for full attention, or "auto" for the model's
        own attention mode over ``positions``; past: per-layer (k, v) of S earlier positions; noisy: the inputs are
        noisy rows (drafts), run through the draft tower when the model has one.
        Returns final-norm hidden states [B, T, d] and the per-layer (k, v) of the T inputs.
        """
        b, t = input_ids.shape
        past_len = past[0][0].shape[2] if past else 0
        if positions is None:
            positions = torch.arange(past_len, past_len + t, device=input_ids.device).expand(b, t)
        if isinstance(mask, str):
            if past:
                raise ValueError("mask='auto' needs explicit masks when a past is given")
            mask = self.make_mask(positions, positions)
        x = self.embed_tokens(input_ids)
        rot_dim = int(self.config.head_dim * self.config.partial_rotary_factor)
        cos, sin = rope_cos_sin(positions, rot_dim, self.config.rope_theta, x.dtype)
        new_kvs: list[KV] = []
        layers = self.draft_layers if noisy and self.draft_layers is not None else self.layers
        for i, layer in enumerate(layers):
            x, kv = layer(x, cos, sin, mask, past[i] if past else None)
            new_kvs.append(kv)
        return self.norm(x), new_kvs

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: list[int],
        masks: list[torch.Tensor | None],
        pasts: list[list[KV] | None],
        output_rows: list[torch.Tensor] | None = None,
        draft_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[list[KV]]]:
        """Run several sequences in one pass without padding them to a common length.

        input_ids, positions: [N], the sequences' inputs one after another (``lengths`` rows each);
        masks: per sequence bool [1, 1, T_i, S_i+T_i] (True = attend) or None for full attention;
        pasts: per sequence its per-layer (k, v) [1, H, S_i, D] or None.
        Every layer's projections and MLP run once over all N rows (they treat rows independently); only
        attention is split per sequence, with each sequence's own keys. A sequence therefore gets the same
        numbers as a plain ``forward`` of it alone would compute, whatever else is packed with it.
        Returns final-norm hidden states [N, d] and, per sequence, the per-layer (k, v) of its inputs.
        With ``output_rows`` (per sequence, the row indices whose hidden states the caller reads, e.g. the
        still-masked positions) the last layer computes only those rows (keys and values still cover every
        row) and the result is [sum of their counts, d], sequence after sequence. ``draft_rows`` [N] bool: the
        noisy rows, which a model with a draft tower runs through it.
        """
        if sum(lengths) != input_ids.numel() or positions.shape != input_ids.shape:
            raise ValueError("packed input_ids/positions must hold sum(lengths) rows")
        if output_rows is not None and len(output_rows) != len(lengths):
            raise ValueError("output_rows needs one index tensor per sequence")
        tower = self.draft_layers is not None and draft_rows is not None and bool(draft_rows.any())
        if (self.single_forward is not None and not tower and len(lengths) == 1
                and (output_rows is None or output_rows[0].numel() > 0)):
            past = None if pasts[0] is None else [(k, v) for k, v in pasts[0]]  # one container type: one guard
            rows = None if output_rows is None else output_rows[0]
            one = rows is not None and rows.numel() == 1
            # one wanted row is asked for twice: compiled code specialises on a count of 1, and every graph it
            # need not build saves seconds of warm-up
            hidden, kvs = self.single_forward(self, input_ids, positions, masks[0], past,
                                              rows.repeat(2) if one else rows)
            return (hidden[:1] if one else hidden), [kvs]
        x = self.embed_tokens(input_ids.unsqueeze(0))
        rot_dim = int(self.config.head_dim * self.config.partial_rotary_factor)
        cos, sin = rope_cos_sin(positions.unsqueeze(0), rot_dim, self.config.rope_theta, x.dtype)
        per_seq: list[list[KV]] = [[] for _ in lengths]
        last = len(self.layers) - 1
        split: int | tuple | None = None  # how a draft tower's rows are told apart (_split_layer_packed)
        if tower:
            n_clean = int((~draft_rows).sum())
            split = n_clean if not bool(draft_rows[:n_clean].any()) else \
                ((~draft_rows).nonzero().squeeze(-1), draft_rows.nonzero().squeeze(-1), draft_rows)
        for i, layer in enumerate(self.layers):
            layer_pasts = [None if p is None else p[i] for p in pasts]
            rows = output_rows if i == last else None
            if split is None:
                x, kvs = layer.forward_packed(x, cos, sin, lengths, masks, layer_pasts, rows)
            else:
                x, kvs = _split_layer_packed(self, i, split, x, cos, sin, lengths, masks, layer_pasts, rows)
            for seq, kv in zip(per_seq, kvs, strict=True):
                seq.append(kv)
        return self.norm(x)[0], per_seq

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states (any leading shape) onto the vocabulary, in float32. With a copy head this is
        only the vocabulary part: :meth:`output_logits` gives the model's output."""
        return self.lm_head(hidden).float()

    def forward_outputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, mask: torch.Tensor | None | str = "auto"
    ) -> torch.Tensor:
        """The model's output [B, T, V] for every row of one plain forward (no past): what :meth:`output_logits`
        gives, for scripts that score whole sequences."""
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        if isinstance(mask, str):
            mask = self.make_mask(positions, positions)
        hidden, kvs = self(input_ids, positions, mask=mask)
        if self.copy_head is None:
            return self.logits(hidden)
        visible = torch.ones(b, t, t, dtype=torch.bool, device=input_ids.device) if mask is None else \
            mask[:, 0].expand(b, t, t)
        select = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        ctx = CopyContext(positions, kvs[-1][0], input_ids, visible, positions)
        return self.output_logits(hidden, select, ctx).view(b, t, -1)

    def output_logits(self, hidden: torch.Tensor, select: torch.Tensor, ctx: CopyContext | None) -> torch.Tensor:
        """The model's output for the rows ``select`` [G, Q] (bool) of ``hidden`` [G, Q, d], [N, V] float32:
        logits, or with a copy head the mixture's log-probabilities (``ctx``: what the head points into)."""
        return self.outputs_and_pointer_nll(hidden, select, ctx)[0]

    def outputs_and_pointer_nll(
        self, hidden: torch.Tensor, select: torch.Tensor, ctx: CopyContext | None, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``output_logits`` and, given the rows' ``targets`` [N] and a copy head, the pointers' own NLL of each
        target, pointers averaged, for the rows whose target is a token they may copy: [M] (M <= N). Training
        the pointers on it, whatever the gate gives them, is the pointer loss (``pointer_weight``)."""
        logits = self.logits(hidden[select])
        if self.copy_head is None:
            return logits, None
        pointers = self.copy_head.pointer_weights(hidden, ctx, select)
        out = CopyHead.mix(logits, pointers)
        return out, None if targets is None else CopyHead.target_nll(pointers, targets)


def count_flops_per_token(cfg: ModelConfig) -> float:
    """Approximate forward FLOPs per token (2 x matmul parameters), for throughput reports."""
    d, hd = cfg.hidden_size, cfg.head_dim or 1
    attn = d * hd * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    mlp = 3 * d * cfg.intermediate_size
    return 2.0 * (cfg.num_hidden_layers * (attn + mlp) + d * cfg.vocab_size)


def init_std_scaled(model: Transformer) -> None:
    """GPT-2 style scaled init of residual projections (helps small models train stably)."""
    n = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * n))
