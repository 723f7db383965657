"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B / 1.5B): block diffusion adapted from Qwen2.5-Instruct.

Block-causal attention over absolute 32-token blocks (config ``bd_size``) with token shift: the logits at
position i predict token i+1, so the first token of a block comes from the last position of the previous
one (NVlabs/Fast-dLLM ``v2``). Inside a block, tokens are decoded in sub-blocks of 8 (``small_block_size``):
our decode block is the sub-block while the model block stays 32. Qwen2 layout (q/k/v biases). Mask token
``|<MASK>|`` (151665, an additional special token); ``<|im_end|>`` ends a turn.
"""

from __future__ import annotations

from typing import Any

import torch

from quicksilver.config import ModelConfig
from quicksilver.families.base import Family
from quicksilver.families.qwen_like import block_causal_fields, qwen_tensor
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer

FAST_DLLM_MASK_ID = 151665
SUB_BLOCK = 8


class FastDLLMv2(Family):
    name = "fast_dllm_v2"
    model_types = ("fast_dllm_qwen",)
    description = "Fast-dLLM v2 (block-causal Qwen2.5, token shift, sub-blocks)"

    def translate(self, hf: dict[str, Any], gen: dict[str, Any], tok: Tokenizer, source: str) -> dict[str, Any]:
        return block_causal_fields(hf, gen, tok, source, qk_norm=False, default_bias=True, mask_names=("|<MASK>|",),
                                   mask_fallback=FAST_DLLM_MASK_ID, block_size=int(hf.get("bd_size", 32)),
                                   token_shift=True)

    def map_tensor(self, key: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        return qwen_tensor(key, tensor, cfg)

    def defaults(self, cfg: ModelConfig) -> SamplingParams:
        # v2/run_chatbot.py: threshold 0.9, sub-blocks of 8 inside the 32-token model block
        return SamplingParams(max_tokens=256, temperature=0.0, policy="threshold", threshold=0.9,
                              block_size=min(SUB_BLOCK, cfg.block_size))
