"""Per-request decoding parameters and the token sampler.

``SamplingParams`` is frozen: a request's parameters never change while it decodes, and the engine can
batch requests with different parameters because every choice below is made per request.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

PolicyName = Literal[
    "low_confidence", "threshold", "left_to_right", "factor", "entropy", "margin", "self_speculative"
]
CacheMode = Literal["auto", "none", "prefix", "dual"]
POLICIES: tuple[str, ...] = get_args(PolicyName)
# seeds are signed 64-bit integers, as OpenAI's ``seed`` is; torch.Generator.manual_seed overflows past 64 bits
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def seed_error(seed: int) -> str | None:
    """Why ``seed`` cannot seed a request (the reason, without the field's name), or None if it can."""
    if not SEED_MIN <= seed <= SEED_MAX:
        return f"must be an integer from {SEED_MIN} to {SEED_MAX} (64 bits, signed), got {seed}"
    return None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # unmasking policy
    policy: PolicyName = "threshold"
    threshold: float = 0.9  # threshold and left_to_right: commit every masked position with confidence >= this
    factor: float = 1.0  # factor policy: largest n with c(i) >= 1 - factor / (i + 1)
    entropy_bound: float = 0.5  # entropy policy: commit while summed entropy minus the max <= bound
    margin: float = 0.5  # margin policy: commit positions whose top1 - top2 probability >= margin
    steps_per_block: int | None = None  # low_confidence policy: fixed commits schedule (default block size)
    block_size: int | None = None  # decode block; default from the model (its block size, or 32)
    # self-correction: re-mask committed tokens whose probability falls below remask_threshold, or edit
    # them to the model's new choice when that choice is at least edit_threshold likely
    remask_threshold: float | None = None
    edit_threshold: float | None = None
    max_remasks_per_block: int | None = None  # bound that guarantees termination (default: block size)
    cache: CacheMode = "auto"
    lookahead: int = 0  # bidirectional models: extra masked positions kept after the current block
    # self_speculative, greedy: also accept a draft whose causal probability is at least this fraction of
    # the top token's. 1.0 = only the causal greedy token (the answer is the causal one); lower trades that
    # exactness for more tokens per forward (docs/performance.md section 7). Sampling ignores it.
    accept_ratio: float = 1.0
    # OpenAI's logit adjustments (adjust_logits): penalties on tokens already in the answer, per-token biases
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted and sorted
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= self.temperature < math.inf:  # nan < 0 is False: nan would reach torch.multinomial
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        if self.seed is not None and (error := seed_error(self.seed)):
            raise ValueError(f"seed {error}")
        # the policies' knobs: a value outside these ranges (nan included) decodes the same as the nearest bound
        # or breaks the rule it parameterises (factor < 0 asks for confidences above 1), so it is a mistake
        for name in ("threshold", "margin", "remask_threshold", "edit_threshold"):  # probabilities
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1]")
        for name in ("factor", "entropy_bound"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0")
        if self.max_remasks_per_block is not None and self.max_remasks_per_block < 0:
            raise ValueError("max_remasks_per_block must be >= 0")
        if self.lookahead < 0:
            raise ValueError("lookahead must be >= 0")
        if not 0 < self.accept_ratio <= 1:
            raise ValueError("accept_ratio must be in (0, 1]")
        if self.accept_ratio < 1 and self.policy != "self_speculative":
            raise ValueError("accept_ratio < 1 needs policy 'self_speculative' (it relaxes draft verification)")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.steps_per_block is not None and self.steps_per_block < 1:
            raise ValueError("steps_per_block must be >= 1")
        if isinstance(self.stop, str):  # tolerate a single string
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):  # "" would match at once and end every answer empty
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple(sorted((int(tok), float(b)) for tok, b in bias))
        if any(tok < 0 for tok, _ in bias):
            raise ValueError("logit_bias token ids must be >= 0")
        if any(not -100 <= b <= 100 for _, b in bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def adjust_logits(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None) -> torch.Tensor:
    """OpenAI's logit adjustments, in place on float32 ``logits`` [N, V]: each ``logit_bias`` entry added, and
    for a token already ``counts`` [V] times in the answer, count x frequency_penalty + presence_penalty taken
    off (the prompt does not count). Ids past the vocabulary are the caller's to reject."""
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        logits[:, list(ids)] += torch.tensor(bias, dtype=logits.dtype)
    if counts is not None and (params.presence_penalty or params.frequency_penalty):
        c = counts.to(logits.dtype)
        logits -= c * params.frequency_penalty + (c > 0).to(logits.dtype) * params.presence_penalty
    return logits


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row of float32 ``logits`` [N, V].

    Returns (tokens [N], confidence [N] = probability of the chosen token, probs [N, V]) where probs are
    the distribution the policies judge (the temperature-1 softmax, so confidence means the same thing
    for greedy and sampled decoding).
    """
    probs = torch.softmax(logits, dim=-1)
    if params.temperature == 0:
        conf, tokens = probs.max(dim=-1)
        return tokens, conf, probs
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > params.top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    sample_probs = torch.softmax(scaled, dim=-1)
    tokens = torch.multinomial(sample_probs, 1, generator=generator).squeeze(-1)
    conf = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, conf, probs
