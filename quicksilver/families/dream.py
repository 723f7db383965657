"""Dream (Dream-org/Dream-v0-Instruct-7B, Dream-Coder, DiffuCoder): Qwen2.5 weights run bidirectionally.

Dream keeps the autoregressive habit of its Qwen2.5 initialisation: the logits at position i predict token
i+1 (HKUNLP/Dream ``generation_utils.py`` shifts them right by one before sampling), so the first masked
answer position is predicted from the last prompt position. Qwen2 attention has q/k/v biases. Mask id from
config.json (151666, ``<|mask|>``); ``<|endoftext|>`` ends text, ``<|im_end|>`` ends a chat turn.
"""

from __future__ import annotations

from typing import Any

import torch

from quicksilver.config import ModelConfig
from quicksilver.families.base import Family, end_ids, reject, resolve_mask_id
from quicksilver.families.qwen_like import qwen_fields, qwen_tensor
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer


class Dream(Family):
    name = "dream"
    model_types = ("dream",)
    description = "Dream (bidirectional, Qwen2 with attention biases, token shift)"

    def translate(self, hf: dict[str, Any], gen: dict[str, Any], tok: Tokenizer, source: str) -> dict[str, Any]:
        fields = qwen_fields(hf, source, qk_norm=False, default_bias=True)
        mask_id = resolve_mask_id(hf, tok, ("<|mask|>",), None, source)
        ends = end_ids(tok, gen, hf, ("<|endoftext|>", "<|im_end|>"))
        reject(not ends, source, "no eos_token_id")
        fields.update(
            attention_mode="bidirectional", block_size=32, token_shift=True, mask_token_id=mask_id,
            eos_token_id=ends[0], pad_token_id=hf.get("pad_token_id") or ends[0], stop_token_ids=ends[1:],
        )
        return fields

    def map_tensor(self, key: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        return qwen_tensor(key, tensor, cfg)

    def defaults(self, cfg: ModelConfig) -> SamplingParams:
        # Fast-dLLM's Dream setting: confidence threshold 0.9 over 32-token blocks with a prefix cache
        # the model sees the rest of the canvas as masks (lookahead), as in the reference sampler whose canvas is
        # the whole answer; with the lookahead "auto" picks Fast-dLLM's dual cache
        return SamplingParams(max_tokens=256, temperature=0.0, policy="threshold", threshold=0.9, block_size=32,
                              lookahead=256 - 32)
