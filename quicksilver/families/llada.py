"""LLaDA / LLaDA 1.5 (GSAI-ML/LLaDA-8B-Instruct, LLaDA-1.5): a bidirectional LLaMA-like masked diffusion model.

Checkpoint layout (OLMo-derived, see ML-GSAI/LLaDA ``modeling_llada.py``): ``model.transformer.wte`` embeddings,
per block ``q_proj/k_proj/v_proj``, ``attn_out`` (output projection), ``attn_norm``/``ff_norm`` RMSNorms and a
SwiGLU MLP written ``ff_out(silu(ff_proj(x)) * up_proj(x))``; ``ln_f`` final norm and ``model.transformer.ff_out``
as the LM head (``weight_tying`` false). No token shift: logits at i predict token i. Mask id 126336,
``<|endoftext|>`` (126081) ends text and ``<|eot_id|>`` (126348) ends a chat turn.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from quicksilver.config import ModelConfig
from quicksilver.families.base import Family, end_ids, need, reject, resolve_mask_id
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer

LLADA_MASK_ID = 126336

_BLOCK_NAMES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj", "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj",
}
_BLOCK_KEY = re.compile(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_NAMES = {
    "model.transformer.wte.weight": "embed_tokens.weight",
    "model.transformer.ln_f.weight": "norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}


class LLaDA(Family):
    name = "llada"
    model_types = ("llada",)
    description = "LLaDA / LLaDA 1.5 (bidirectional, LLaMA-like)"

    def translate(self, hf: dict[str, Any], gen: dict[str, Any], tok: Tokenizer, source: str) -> dict[str, Any]:
        reject(hf.get("block_type", "llama") != "llama", source, f"block_type {hf.get('block_type')!r}")
        # "silu" is the gated ff_proj/up_proj MLP of the released models; OLMo's "swiglu" splits one projection
        reject(hf.get("activation_type", "silu") != "silu", source, f"activation_type {hf.get('activation_type')!r}")
        reject(hf.get("layer_norm_type", "rms") != "rms", source, f"layer_norm_type {hf.get('layer_norm_type')!r}")
        reject(not hf.get("rope", True) or hf.get("alibi", False), source, "position encoding other than RoPE")
        reject(bool(hf.get("include_bias")), source, "include_bias=true (biases on every linear layer)")
        reject(bool(hf.get("attention_layer_norm")), source, "attention_layer_norm=true (q/k LayerNorm)")
        reject(bool(hf.get("input_emb_norm")) or bool(hf.get("scale_logits")), source,
               "input_emb_norm / scale_logits")
        reject(hf.get("layer_norm_with_affine") is False, source, "RMSNorm without weights")
        d = need(hf, "d_model", source)
        heads = need(hf, "n_heads", source)
        kv = 1 if hf.get("multi_query_attention") else (hf.get("n_kv_heads") or heads)
        mlp = hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * d
        mask_id = resolve_mask_id(hf, tok, ("<|mdm_mask|>",), LLADA_MASK_ID, source)
        ends = end_ids(tok, gen, hf, ("<|endoftext|>", "<|eot_id|>"))
        reject(not ends, source, "no eos_token_id")
        return dict(
            vocab_size=hf.get("embedding_size") or need(hf, "vocab_size", source), hidden_size=d,
            num_hidden_layers=need(hf, "n_layers", source), num_attention_heads=heads, num_key_value_heads=kv,
            intermediate_size=mlp, max_position_embeddings=hf.get("max_sequence_length", 4096),
            rope_theta=float(hf.get("rope_theta", 10000.0)), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("weight_tying", False)),
            attention_bias=bool(hf.get("include_qkv_bias", False)),
            attention_mode="bidirectional", block_size=32, token_shift=False, mask_token_id=mask_id,
            eos_token_id=ends[0], pad_token_id=hf.get("pad_token_id") or ends[0], stop_token_ids=ends[1:],
        )

    def map_tensor(self, key: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        if key in _TOP_NAMES:
            return [(_TOP_NAMES[key], tensor)]
        m = _BLOCK_KEY.fullmatch(key)
        if m and m.group(2) in _BLOCK_NAMES:
            return [(f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}", tensor)]
        return [(key, tensor)]

    def defaults(self, cfg: ModelConfig) -> SamplingParams:
        # LLaDA's own sampler is semi-autoregressive with 32-token blocks; Fast-dLLM's threshold rule (0.9)
        # with a prefix cache is its fast setting
        # the model sees the rest of the canvas as masks (lookahead), as in the reference sampler whose canvas is
        # the whole answer; with the lookahead "auto" picks Fast-dLLM's dual cache
        return SamplingParams(max_tokens=256, temperature=0.0, policy="threshold", threshold=0.9, block_size=32,
                              lookahead=256 - 32)
