"""SDAR (JetLM/SDAR-*-Chat): block diffusion on the Qwen3 architecture.

Block-causal attention over absolute blocks of ``block_size`` tokens (config.json, 4 for the chat models):
bidirectional inside a block, causal across blocks, so finished blocks get exact KV caches (JetAstra/SDAR
``generate.py``). Qwen3 layout: per-head q/k RMSNorm before RoPE, no biases. No token shift. Mask token
``<|MASK|>`` (151669, tokenizer_config ``mask_token``); generation_config ends on ``<|im_end|>`` and
``<|endoftext|>``.
"""

from __future__ import annotations

from typing import Any

import torch

from quicksilver.config import ModelConfig
from quicksilver.families.base import Family
from quicksilver.families.qwen_like import block_causal_fields, qwen_tensor
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer


class SDAR(Family):
    name = "sdar"
    model_types = ("sdar",)
    description = "SDAR (block-causal, Qwen3)"

    def translate(self, hf: dict[str, Any], gen: dict[str, Any], tok: Tokenizer, source: str) -> dict[str, Any]:
        return block_causal_fields(hf, gen, tok, source, qk_norm=True, default_bias=False, mask_names=("<|MASK|>",),
                                   mask_fallback=None, block_size=int(hf.get("block_size", 4)), token_shift=False)

    def map_tensor(self, key: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        return qwen_tensor(key, tensor, cfg)

    def defaults(self, cfg: ModelConfig) -> SamplingParams:
        # SDAR generate.py: decode one model block at a time, commit every token above 0.85 confidence
        # (at least one per step: "low_confidence_dynamic")
        return SamplingParams(max_tokens=256, temperature=0.0, policy="threshold", threshold=0.85,
                              block_size=cfg.block_size)
