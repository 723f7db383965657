"""Request fields -> a frozen :class:`SamplingParams`: limits against the context, effort levels, logit bias.

``reasoning_effort`` picks how many tokens a denoising step may commit (Mercury's "refinement steps"):
``instant``/``minimal``/``none`` threshold 0.7, ``low`` 0.8, ``medium`` 0.9, ``high``/``xhigh`` one
token per step (low-confidence policy). A model whose default policy is ``self_speculative`` keeps it and
the effort sets how close to the causal top token an accepted draft must be (``accept_ratio``: 0.1, 0.25,
0.5, then 1.0 = exactly its causal greedy answer; greedy requests only, sampled ones stay exact): on the
shipped default that is faster and more accurate than the thresholds above (docs/performance.md section 7).
Without it the model's defaults apply.
"""

from __future__ import annotations

from typing import Any

from quicksilver.api.errors import APIError
from quicksilver.api.protocol import SamplingFields
from quicksilver.sampling import SamplingParams

EFFORT_PARAMS: dict[str, dict[str, Any]] = {
    "none": {"policy": "threshold", "threshold": 0.7},
    "minimal": {"policy": "threshold", "threshold": 0.7},
    "instant": {"policy": "threshold", "threshold": 0.7},
    "low": {"policy": "threshold", "threshold": 0.8},
    "medium": {"policy": "threshold", "threshold": 0.9},
    "high": {"policy": "low_confidence", "steps_per_block": None},
    "xhigh": {"policy": "low_confidence", "steps_per_block": None},
}
# for a model that verifies its own drafts: how near the causal top token a draft must be to be accepted
SPECULATIVE_EFFORT_PARAMS: dict[str, dict[str, Any]] = {
    "none": {"accept_ratio": 0.1},
    "minimal": {"accept_ratio": 0.1},
    "instant": {"accept_ratio": 0.1},
    "low": {"accept_ratio": 0.25},
    "medium": {"accept_ratio": 0.5},
    "high": {"accept_ratio": 1.0},
    "xhigh": {"accept_ratio": 1.0},
}


def build_params(
    req: SamplingFields, defaults: SamplingParams, prompt_len: int, context: int,
    max_tokens: int | None, vocab_size: int, effort: str | None = None, prompt_param: str = "messages",
) -> SamplingParams:
    room = context - prompt_len
    if room < 1:
        raise prompt_too_long(context, prompt_len, prompt_param)
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
                            "the completion).", param="max_tokens", code="context_length_exceeded")
    changes: dict[str, Any] = {"max_tokens": max_tokens if max_tokens is not None else min(defaults.max_tokens, room)}
    if req.temperature is not None:
        changes["temperature"] = req.temperature
    if req.top_p is not None:
        if req.top_p == 0:  # some clients send 0 for "most likely token only"
            changes["temperature"] = 0.0
        else:
            changes["top_p"] = req.top_p
    if req.top_k is not None:
        changes["top_k"] = req.top_k
    if req.seed is not None:
        changes["seed"] = req.seed
    if req.stop is not None:
        changes["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            changes[name] = getattr(req, name)
    if req.logit_bias:
        changes["logit_bias"] = logit_bias_ids(req.logit_bias, vocab_size)
    if effort is not None:
        # a model that verifies its drafts returns its own causal greedy answer at accept_ratio 1: its most
        # careful setting, better than one unverified token per step; looser acceptance is its faster one
        table = SPECULATIVE_EFFORT_PARAMS if defaults.policy == "self_speculative" else EFFORT_PARAMS
        changes.update(table[effort])
    try:
        return defaults.replace(**changes)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def prompt_too_long(context: int, prompt_len: int, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                         f"{prompt_len} tokens.", param=param, code="context_length_exceeded")


def logit_bias_ids(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        # decimal digits only: int() would also read " 1", "1_0" and other scripts' digits
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                           param="logit_bias")
        out[token] = value
    return out


def check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

