"""Shared cases for the prefix cache and chunked prefill tests: every kind of exact cache the decoder keeps, and
models and conversations whose greedy answers are varied and confident."""

from __future__ import annotations

import torch

from quicksilver.sampling import SamplingParams
from quicksilver.testing import tiny_model

SYSTEM = "You answer with code. def add(a, b):\n    return a + b\nThe quick brown fox jumps over the lazy dog. " * 2
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)

# (attention mode, model options, decoding policy): every kind of exact cache the decoder keeps
KINDS = {
    "speculative": ("block_causal", {"token_shift": True, "causal_context": True}, "self_speculative"),
    "causal_context": ("block_causal", {"token_shift": True, "causal_context": True}, "threshold"),
    "block_causal": ("block_causal", {}, "threshold"),
    "causal": ("causal", {}, "threshold"),
}


def peaked(mode: str, seed: int = 0, dtype: torch.dtype = torch.float32, **options) -> torch.nn.Module:
    """A random model with a scaled-up head: confident, varied greedy choices (no near-ties to flip)."""
    model = tiny_model(mode, seed=seed, dtype=dtype, **options)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def conversation(tok, turns: list[tuple[str, str]], question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}]
    for user, answer in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": question})
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
