"""Held-out evaluation on the verifiable task suite: per-task accuracy, tokens per forward and tokens/s.

Every model sees the same prompts: examples come from the tasks' "eval" split (held-out phrasings and system
prompts) with a fixed seed, so results are comparable across models and runs. Decoding uses
``Decoder.step`` over a small batch of requests at a time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from quicksilver.checkpoint import LoadedModel
from quicksilver.sampling import SamplingParams
from quicksilver.tasks import TASKS, Example, get_task, render_prompt

EVAL_SEED = 20251202
DEFAULT_N = 50
# Answer budgets per task (tokens), generous for our 4k BPE; the same for every model.
MAX_TOKENS: dict[str, int] = {
    "tool_call": 64, "tool_answer": 48, "json": 64, "arithmetic": 48, "word_problem": 48, "countdown": 40,
    "sudoku": 32, "retrieval": 32, "code": 96, "infill": 48,
}


def eval_examples(task: str, n: int = DEFAULT_N, seed: int = EVAL_SEED) -> list[Example]:
    """The fixed held-out examples of a task (index i depends only on (seed, task, i))."""
    t = get_task(task)
    return [t.generate(random.Random(f"eval:{seed}:{task}:{i}"), "eval") for i in range(n)]


@dataclass
class ItemResult:
    index: int
    correct: bool
    output: str
    tokens: int
    forwards: int
    finish_reason: str


def _run_batch(decoder, prompts: Sequence[list[int]], params: Sequence[SamplingParams], batch_size: int):
    """Decode all prompts, keeping up to ``batch_size`` requests in flight; yields (index, state) when done."""
    pending = list(range(len(prompts)))
    live: list[tuple[int, Any]] = []
    while pending or live:
        while pending and len(live) < batch_size:
            i = pending.pop(0)
            live.append((i, decoder.start(prompts[i], params[i])))
        decoder.step([s for _, s in live])
        still = []
        for i, s in live:
            if s.finished:
                yield i, s
            else:
                still.append((i, s))
        live = still


def evaluate(
    loaded: LoadedModel,
    tasks: Sequence[str] | None = None,
    n: int = DEFAULT_N,
    params: SamplingParams | None = None,
    seed: int = EVAL_SEED,
    batch_size: int = 8,
    max_tokens: int | None = None,
    keep_outputs: bool = False,
    on_task: Callable[[str, dict], None] | None = None,
) -> dict[str, Any]:
    """Run the held-out suite; returns {"model", "params", "tasks": {name: metrics}, "overall": metrics}.

    ``params`` defaults to the model's own generation defaults (policy, threshold, block size, ...). The answer
    budget is per task (``MAX_TOKENS``), the same for every model, unless ``max_tokens`` sets one for all."""
    from quicksilver.decoding import Decoder

    names = list(tasks) if tasks else list(TASKS)
    for name in names:
        get_task(name)  # unknown names fail before any decoding
    if n < 1:
        raise ValueError("n must be >= 1")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    base = params or loaded.defaults
    tok = loaded.tokenizer
    decoder = Decoder(loaded.model, tok, base)
    report: dict[str, Any] = {
        "model": loaded.name or str(loaded.path), "seed": seed, "n": n, "batch_size": batch_size,
        "params": {k: v for k, v in vars(base).items() if k != "extra"}, "tasks": {},
    }
    totals = {"correct": 0, "count": 0, "tokens": 0, "forwards": 0, "seconds": 0.0}
    for name in names:
        task = get_task(name)
        examples = eval_examples(name, n, seed)
        prompts, items = {}, []
        for i, ex in enumerate(examples):
            try:
                prompts[i] = tok.encode(render_prompt(ex, tok))
            except Exception as exc:  # e.g. a foreign chat template that rejects tools or the tool role: wrong
                items.append(ItemResult(i, False, f"<prompt not renderable: {exc}>", 0, 0, "error"))
        budget = max_tokens or MAX_TOKENS.get(name, base.max_tokens)
        order = sorted(prompts)
        task_params = [base.replace(max_tokens=budget)] * len(order)
        started = time.perf_counter()
        for k, state in _run_batch(decoder, [prompts[i] for i in order], task_params, batch_size):
            i = order[k]
            output = tok.decode(state.answer_ids, skip_special_tokens=False)
            if state.stop_text is not None:
                output = state.stop_text
            items.append(ItemResult(i, bool(task.verify(examples[i], output)), output, state.stats.tokens,
                                    state.stats.forwards, state.finish_reason or "length"))
        seconds = time.perf_counter() - started
        items.sort(key=lambda r: r.index)
        correct = sum(r.correct for r in items)
        tokens = sum(r.tokens for r in items)
        forwards = sum(r.forwards for r in items)
        metrics = {
            "accuracy": correct / len(items), "correct": correct, "count": len(items),
            "tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / forwards if forwards else 0.0,
            "seconds": seconds, "tokens_per_second": tokens / seconds if seconds else 0.0,
            "max_tokens": budget, "render_errors": sum(r.finish_reason == "error" for r in items),
        }
        if keep_outputs:
            metrics["outputs"] = [{"index": r.index, "correct": r.correct, "output": r.output,
                                   "finish_reason": r.finish_reason} for r in items]
        report["tasks"][name] = metrics
        for key in ("correct", "count", "tokens", "forwards", "seconds"):
            totals[key] += metrics[key]
        if on_task is not None:
            on_task(name, metrics)
    report["overall"] = {
        "accuracy": totals["correct"] / totals["count"],  # micro average over all examples
        "macro_accuracy": sum(m["accuracy"] for m in report["tasks"].values()) / len(names),
        "correct": totals["correct"], "count": totals["count"],
        "tokens_per_forward": totals["tokens"] / totals["forwards"] if totals["forwards"] else 0.0,
        "tokens_per_second": totals["tokens"] / totals["seconds"] if totals["seconds"] else 0.0,
        "seconds": totals["seconds"],
    }
    return report
