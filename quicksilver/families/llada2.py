"""LLaDA2.0 / LLaDA2.1 (inclusionAI/LLaDA2.0-mini, -flash; LLaDA2.1): block-diffusion mixture of experts.

Architecture (inclusionAI ``modeling_llada2_moe.py``, a Ling/BailingMoeV2 derivative):

* attention: one fused ``query_key_value`` projection laid out as [q heads | k heads | v heads], per-head
  RMSNorm on q and k (``query_layernorm``/``key_layernorm``) before RoPE, RoPE on the first
  ``head_dim * partial_rotary_factor`` dims of each head only, ``dense`` output projection;
* MLP: the first ``first_k_dense_replace`` layers are dense SwiGLU; the rest are MoE blocks whose router
  scores are sigmoid(x W_g) in float32, selects top-k experts by score + ``expert_bias`` restricted to the
  ``topk_group`` best of ``n_group`` expert groups (group score = sum of its two best biased scores), weights
  the chosen experts by their *unbiased* scores normalised to sum 1, times ``routed_scaling_factor``, and adds
  ``num_shared_experts`` always-on experts (one SwiGLU of width moe_intermediate_size * num_shared_experts);
* decoding is block-causal over 32-token blocks (dInfer / SGLang ``block_length`` 32), no token shift.

Mask ``<|mask|>`` (156895), ``<|endoftext|>`` (156892) ends text, ``<|role_end|>`` ends a turn.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from quicksilver.config import ModelConfig
from quicksilver.families.base import Family, check_rope_scaling, end_ids, need, reject, resolve_mask_id
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer

LLADA2_MASK_ID = 156895
LLADA2_BLOCK = 32

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_ATTN_NAMES = {
    "attention.query_layernorm.weight": "self_attn.q_norm.weight",
    "attention.key_layernorm.weight": "self_attn.k_norm.weight",
    "attention.dense.weight": "self_attn.o_proj.weight",
    "mlp.gate.expert_bias": "mlp.expert_bias",
}


class LLaDA2(Family):
    name = "llada2"
    model_types = ("llada2_moe",)
    description = "LLaDA2.0 / 2.1 (block-causal MoE)"

    def translate(self, hf: dict[str, Any], gen: dict[str, Any], tok: Tokenizer, source: str) -> dict[str, Any]:
        check_rope_scaling(hf, source)
        reject(bool(hf.get("use_bias", False)), source, "use_bias=true (bias on the attention output)")
        reject(hf.get("hidden_act", "silu") != "silu", source, f"hidden_act {hf.get('hidden_act')!r}")
        reject(hf.get("score_function", "sigmoid") != "sigmoid", source,
               f"score_function {hf.get('score_function')!r}")
        reject(hf.get("use_qk_norm") is False, source, "use_qk_norm=false")
        reject(bool(hf.get("norm_head")), source, "norm_head=true")
        heads = need(hf, "num_attention_heads", source)
        hidden = need(hf, "hidden_size", source)
        experts = hf.get("num_experts") or 0
        top_k = int(hf.get("num_experts_per_tok", 1))
        mask_id = resolve_mask_id(hf, tok, ("<|mask|>",), LLADA2_MASK_ID, source)
        ends = end_ids(tok, gen, hf, ("<|endoftext|>", "<|role_end|>"))
        if not ends and hf.get("pad_token_id") is not None:
            ends = [hf["pad_token_id"]]
        reject(not ends, source, "no eos_token_id")
        return dict(
            vocab_size=need(hf, "vocab_size", source), hidden_size=hidden,
            num_hidden_layers=need(hf, "num_hidden_layers", source), num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads, intermediate_size=need(hf, "intermediate_size", source),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            rope_theta=float(hf.get("rope_theta", 10000.0)), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("use_qkv_bias", False)), qk_norm=True,
            partial_rotary_factor=float(hf.get("partial_rotary_factor", 0.5)),
            num_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            num_shared_experts=hf.get("num_shared_experts") or 0,
            first_k_dense_layers=hf.get("first_k_dense_replace") or 0,
            moe_router_score="sigmoid",
            # the published gate renormalises the chosen weights whenever more than one expert is chosen
            moe_norm_topk_prob=top_k > 1,
            moe_routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_router_bias=bool(experts), moe_n_group=int(hf.get("n_group") or 1),
            moe_topk_group=int(hf.get("topk_group") or 1),
            attention_mode="block_causal", block_size=int(hf.get("block_size", LLADA2_BLOCK)), token_shift=False,
            mask_token_id=mask_id, eos_token_id=ends[0], pad_token_id=hf.get("pad_token_id") or ends[0],
            stop_token_ids=ends[1:],
        )

    def map_tensor(self, key: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        if key == "model.word_embeddings.weight":
            return [("embed_tokens.weight", tensor)]
        if key == "model.norm.weight":
            return [("norm.weight", tensor)]
        if key == "lm_head.weight":
            return [] if cfg.tie_word_embeddings else [("lm_head.weight", tensor)]
        m = _LAYER.fullmatch(key)
        if m is None:
            return [(key, tensor)]
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= cfg.num_hidden_layers:
            return []  # multi-token-prediction layers after the main stack (not used for diffusion decoding)
        prefix = f"layers.{layer}."
        if rest.startswith("attention.query_key_value."):
            # fused rows [q heads | k heads | v heads] -> three projections
            kind = rest.rsplit(".", 1)[1]
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            if tensor.shape[0] != q + 2 * kv:
                raise_shape(key, tensor, q + 2 * kv)
            qt, kt, vt = torch.split(tensor, [q, kv, kv], dim=0)
            return [(f"{prefix}self_attn.q_proj.{kind}", qt), (f"{prefix}self_attn.k_proj.{kind}", kt),
                    (f"{prefix}self_attn.v_proj.{kind}", vt)]
        if rest in _ATTN_NAMES:
            return [(prefix + _ATTN_NAMES[rest], tensor)]
        # input_layernorm, post_attention_layernorm, mlp.{gate_proj,...}, mlp.gate.weight, mlp.experts.N.*,
        # mlp.shared_experts.* already have our names
        return [(prefix + rest, tensor)]

    def defaults(self, cfg: ModelConfig) -> SamplingParams:
        # SGLang's LLaDA2 default (LowConfidence): threshold 0.95 over 32-token blocks
        return SamplingParams(max_tokens=256, temperature=0.0, policy="threshold", threshold=0.95,
                              block_size=cfg.block_size)


def raise_shape(key: str, tensor: torch.Tensor, rows: int) -> None:
    from quicksilver.checkpoint import CheckpointError

    raise CheckpointError(f"shape mismatch for {key!r}: file has {tuple(tensor.shape)}, config expects {rows} rows")
