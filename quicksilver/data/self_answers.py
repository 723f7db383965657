"""A model's own answers to training-split task prompts, as training samples (self-distillation data).

Self-speculative decoding commits a draft only where it equals the causal stream's choice, so drafts trained to
predict the model's own greedy answers (rather than the reference answers, which the model often does not give)
are what raises tokens per forward. Prompt ``i`` depends only on ``(seed, i)``; answers are greedy, with the
model's decoding defaults and the eval's per-task answer budgets. Answers cut by the budget are dropped: a
training response ends with EOS.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from quicksilver.checkpoint import LoadedModel
from quicksilver.data.mixture import Sample, _weighted
from quicksilver.tasks import SUITE, TASKS, render_prompt

MAX_PROMPT = 448  # tokens: leaves room for an answer in a 512-token training row


def task_weights(mix: dict[str, float] | None) -> dict[str, float]:
    """The suite tasks of a training mixture (corpus kinds, drills and file samples dropped); all suite tasks
    equally without one."""
    if mix is None:
        return dict.fromkeys(SUITE, 1.0)
    weights = {k: float(v) for k, v in mix.items() if k in SUITE and v > 0}
    if not weights:
        raise ValueError("the mixture names no suite task to answer")
    return weights


def self_answers(
    loaded: LoadedModel, n: int, start: int = 0, mix: dict[str, float] | None = None, seed: str = "self-answers",
    batch_size: int = 16,
) -> Iterator[tuple[Sample, str]]:
    """(sample, finish reason) for prompts ``start .. start + n - 1``, in completion order; the sample's response
    is the model's greedy answer plus EOS (empty when the answer was cut by its budget)."""
    from quicksilver.decoding import Decoder
    from quicksilver.evaluate import MAX_TOKENS, _run_batch

    tok = loaded.tokenizer
    weights = task_weights(mix)
    params = loaded.defaults.replace(temperature=0.0)
    prompts, names, budgets = [], [], []
    for i in range(start, start + n):
        rng = random.Random(f"{seed}:{i}")
        name = _weighted(rng, weights)
        ids = tok.encode(render_prompt(TASKS[name].generate(rng, "train"), tok))
        if len(ids) > MAX_PROMPT:
            continue
        prompts.append(ids)
        names.append(name)
        budgets.append(params.replace(max_tokens=MAX_TOKENS.get(name, 96)))
    decoder = Decoder(loaded.model, tok, params)
    for k, state in _run_batch(decoder, prompts, budgets, batch_size):
        stopped = state.finish_reason == "stop"
        response = [*state.answer_ids, tok.eos_id] if stopped else []
        yield Sample(prompts[k], response, names[k]), state.finish_reason or "length"
