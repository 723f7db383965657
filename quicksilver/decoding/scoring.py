"""Token log-probabilities of a text under the model's left-to-right (causal) stream: OpenAI's ``logprobs``.

A causal model and a block-diffusion model with a causal context and token shift (the shipped ``default``) both
read a clean sequence left to right, row i predicting token i + 1; the default's self-speculative answers are that
stream's own choices. So one forward over prompt + answer with a causal mask gives every answer token's
log-probability given the tokens before it. A bidirectional diffusion model (LLaDA, Dream) has no such
distribution: :func:`supports_logprobs` is False for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quicksilver.config import ModelConfig
from quicksilver.model import Transformer, attention_mask


def supports_logprobs(cfg: ModelConfig) -> bool:
    causal_stream = cfg.attention_mode == "causal" or (cfg.attention_mode == "block_causal" and cfg.causal_context)
    return bool(cfg.token_shift) and causal_stream


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at this position, best first


@torch.no_grad()
def token_logprobs(model: Transformer, ids: Sequence[int], start: int, top: int = 0) -> list[TokenLogprob]:
    """Log-probabilities of ``ids[start:]`` (``start`` >= 1), each given the tokens before it, with the ``top``
    most likely tokens at each of those positions; one forward over ``ids``."""
    if not supports_logprobs(model.config):
        raise ValueError("this model has no left-to-right distribution to score tokens with")
    if not 1 <= start <= len(ids):
        raise ValueError(f"start must be in 1..{len(ids)}, got {start}")
    if start == len(ids):
        return []
    device = model.embed_tokens.weight.device
    tokens = torch.tensor([list(ids)], device=device)
    positions = torch.arange(len(ids), device=device)[None]
    mask = attention_mask("causal", positions, positions, 1)[:, None]  # [1, 1, T, T]
    out = model.forward_outputs(tokens, positions, mask)[0, start - 1 : len(ids) - 1].float()
    logp = torch.log_softmax(out, dim=-1)  # idempotent on a copy head's log-probabilities
    targets = tokens[0, start:]
    chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
    if top:
        values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(targets.tolist(), chosen, tops, strict=True)]
