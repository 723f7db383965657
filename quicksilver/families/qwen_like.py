"""Shared pieces of the Qwen2 / Qwen3-architecture families (Dream, SDAR, Fast-dLLM v2).

Their checkpoints use the Hugging Face Qwen names (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``
with biases in Qwen2, ``q_norm``/``k_norm`` in Qwen3, ``model.norm``, ``lm_head``), which match ours after
dropping the leading ``model.``.
"""

from __future__ import annotations

from typing import Any

import torch

from quicksilver.config import ModelConfig
from quicksilver.families.base import check_rope_scaling, end_ids, llama_layout_key, need, reject, resolve_mask_id
from quicksilver.tokenizer import Tokenizer

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some exports still contain


def qwen_fields(hf: dict[str, Any], source: str, *, qk_norm: bool, default_bias: bool) -> dict[str, Any]:
    check_rope_scaling(hf, source)
    reject(bool(hf.get("use_sliding_window")), source, "sliding-window attention")
    reject(hf.get("hidden_act", "silu") != "silu", source, f"hidden_act {hf.get('hidden_act')!r}")
    heads = need(hf, "num_attention_heads", source)
    bias = bool(hf.get("attention_bias", default_bias))
    # Qwen3 puts the bias flag on o_proj as well; our o_proj has none
    reject(qk_norm and bias, source, "attention_bias=true in a Qwen3 layout (o_proj bias)")
    return dict(
        vocab_size=need(hf, "vocab_size", source), hidden_size=need(hf, "hidden_size", source),
        num_hidden_layers=need(hf, "num_hidden_layers", source), num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim"),
        intermediate_size=need(hf, "intermediate_size", source),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        rope_theta=float(hf.get("rope_theta", 10000.0)), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=bias, qk_norm=qk_norm,
    )


def qwen_tensor(key: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    if key.endswith(IGNORED_SUFFIXES):
        return []
    if key == "lm_head.weight" and cfg.tie_word_embeddings:
        return []  # some tied exports still write the head; it is the embedding matrix
    return [(llama_layout_key(key), tensor)]


def block_causal_fields(
    hf: dict[str, Any], gen: dict[str, Any], tok: Tokenizer, source: str, *, qk_norm: bool, default_bias: bool,
    mask_names: tuple[str, ...], mask_fallback: int | None, block_size: int, token_shift: bool,
) -> dict[str, Any]:
    """Config fields of a block-diffusion model converted from a Qwen checkpoint (SDAR, Fast-dLLM v2)."""
    fields = qwen_fields(hf, source, qk_norm=qk_norm, default_bias=default_bias)
    mask_id = resolve_mask_id(hf, tok, mask_names, mask_fallback, source)
    ends = end_ids(tok, gen, hf, ("<|im_end|>", "<|endoftext|>"))
    reject(not ends, source, "no eos_token_id")
    fields.update(
        attention_mode="block_causal", block_size=block_size, token_shift=token_shift,
        mask_token_id=mask_id, eos_token_id=ends[0], pad_token_id=hf.get("pad_token_id") or ends[0],
        stop_token_ids=ends[1:],
    )
    return fields
