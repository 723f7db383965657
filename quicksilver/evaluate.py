"""Held-out evaluation on the verifiable task suite: per-task accuracy, tokens per forward and tokens/s.

Every model sees the same prompts: examples come from the tasks' "eval" split (held-out phrasings and system
prompts) with a fixed seed, so results are comparable across models and runs. Decoding uses
``Decoder.step`` over a small batch of requests at a time.

``constrained=True`` measures what an API client gets instead of free decoding: each example becomes the
request a client would send (``tools`` with ``tool_choice``, default "auto"; the json task as
``response_format: json_schema`` with its schema, strict), decoded under the constraint the server builds for it
(the same ``quicksilver.structured.request.constraint_factory``), and graded on the text the client receives:
tool calls the server validated and returns as ``tool_calls`` are rendered back to ``<|tool_calls|>[...]``,
an answer the server would refuse (HTTP 500/400) counts as wrong. Other tasks decode freely either way.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from quicksilver.checkpoint import LoadedModel
from quicksilver.sampling import SamplingParams
from quicksilver.tasks import SUITE, Example, get_task, render_prompt
from quicksilver.tasks.base import SPLITS
from quicksilver.tokenizer import TOOL_CALLS, Tokenizer

EVAL_SEED = 20251202
DEFAULT_N = 50
# Answer budgets per task (tokens), generous for our 4k BPE; the same for every model.
MAX_TOKENS: dict[str, int] = {
    "tool_call": 64, "tool_answer": 48, "tool_varied": 64, "sums": 48, "json": 64, "json_varied": 64, "arithmetic": 48,
    "word_problem": 48, "countdown": 40, "sudoku": 32, "retrieval": 32, "code": 96, "infill": 48,
}


def eval_examples(task: str, n: int = DEFAULT_N, seed: int = EVAL_SEED, phrasings: str = "eval") -> list[Example]:
    """The fixed held-out examples of a task (index i depends only on (seed, task, i)). ``phrasings="train"``
    words the same held-out draws with the training phrasings instead: a diagnostic that separates what a
    model cannot do from wordings it has not seen (the values and seeds stay held out)."""
    t = get_task(task)
    return [t.generate(random.Random(f"eval:{seed}:{task}:{i}"), phrasings) for i in range(n)]


TOOL_CHOICES = ("auto", "required")


@dataclass(frozen=True)
class ClientRequest:
    """The structured-output part of the API request a client would send for an example."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    json_schema: dict[str, Any] | None = None
    strict: bool = True  # what OpenAI-style structured-output clients send

    @property
    def kind(self) -> str:
        if self.tools:
            return f"tools, tool_choice={self.tool_choice}"
        return "response_format=json_schema (strict)" if self.json_schema is not None else "free"


def client_request(example: Example, tool_choice: str = "auto") -> ClientRequest:
    """Examples with tools -> tools + ``tool_choice``; the json task -> its schema as response_format; else free."""
    if example.tools:
        return ClientRequest(tools=example.tools, tool_choice=tool_choice)
    if example.task == "json":
        return ClientRequest(json_schema=example.answer["schema"])
    return ClientRequest()


def client_text(result: Any, tokenizer: Tokenizer, request: ClientRequest) -> tuple[str, str | None]:
    """(text a grader sees, server error or None) for one finished answer, as the server returns it (the same
    :func:`~quicksilver.structured.answer.client_answer` rule): tool calls come back as
    ``content + <|tool_calls|> + JSON list``, anything else as the message content."""
    from quicksilver.structured.answer import client_answer

    answer = client_answer(result.token_ids, result.text, result.finish_reason, tokenizer, tools=request.tools,
                           tool_choice=request.tool_choice, json_schema=request.json_schema)
    if answer.error is not None:
        return "", answer.error
    if answer.tool_calls:
        return (answer.content or "") + TOOL_CALLS + json.dumps(answer.tool_calls, ensure_ascii=False), None
    return answer.content or "", None


@dataclass
class ItemResult:
    index: int
    correct: bool
    output: str
    tokens: int
    forwards: int
    finish_reason: str


def _run_batch(decoder, prompts: Sequence[list[int]], params: Sequence[SamplingParams], batch_size: int,
               constraints: Sequence[Callable[[], Any] | None] | None = None):
    """Decode all prompts, keeping up to ``batch_size`` requests in flight; yields (index, state) when done.

    ``constraints[i]``, when given and not None, makes request i's (fresh) constraint."""
    pending = list(range(len(prompts)))
    live: list[tuple[int, Any]] = []
    while pending or live:
        while pending and len(live) < batch_size:
            i = pending.pop(0)
            make = constraints[i] if constraints is not None else None
            live.append((i, decoder.start(prompts[i], params[i], make() if make is not None else None)))
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
    constrained: bool = False,
    tool_choice: str = "auto",
    phrasings: str = "eval",
) -> dict[str, Any]:
    """Run the held-out suite; returns {"model", "params", "constrained", "tasks": {name: metrics}, "overall"}.

    ``params`` defaults to the model's own generation defaults (policy, threshold, block size, ...). The answer
    budget is per task (``MAX_TOKENS``), the same for every model, unless ``max_tokens`` sets one for all.
    ``constrained``: decode and grade as an API client would get it (see the module doc); ``tool_choice`` is the
    one such a client sends with tools ("auto", as the server defaults to; "required" forces a call).
    ``phrasings``: "eval" (the held-out wordings, the suite) or "train" (see ``eval_examples``)."""
    from quicksilver.decoding import Decoder
    from quicksilver.structured.request import constraint_factory

    names = list(tasks) if tasks else list(SUITE)
    for name in names:
        get_task(name)  # unknown names fail before any decoding
    if n < 1:
        raise ValueError("n must be >= 1")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if tool_choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice must be one of {TOOL_CHOICES}")
    if phrasings not in SPLITS:
        raise ValueError(f"phrasings must be one of {SPLITS}")
    base = params or loaded.defaults
    tok = loaded.tokenizer
    decoder = Decoder(loaded.model, tok, base)
    report: dict[str, Any] = {
        "model": loaded.name or str(loaded.path), "seed": seed, "n": n, "batch_size": batch_size,
        "params": {k: v for k, v in vars(base).items() if k != "extra"}, "constrained": constrained,
        "phrasings": phrasings, "tasks": {},
    }
    if constrained:
        report["tool_choice"] = tool_choice
    totals = {"correct": 0, "count": 0, "tokens": 0, "forwards": 0, "seconds": 0.0}
    for name in names:
        task = get_task(name)
        examples = eval_examples(name, n, seed, phrasings)
        budget = max_tokens or MAX_TOKENS.get(name, base.max_tokens)
        prompts, items, makers, requests = {}, [], {}, {}
        build_seconds = 0.0  # building a request's constraint is part of serving it: timed with the decoding
        for i, ex in enumerate(examples):
            try:
                prompts[i] = tok.encode(render_prompt(ex, tok))
            except Exception as exc:  # e.g. a foreign chat template that rejects tools or the tool role: wrong
                items.append(ItemResult(i, False, f"<prompt not renderable: {exc}>", 0, 0, "error"))
                continue
            if not constrained:
                continue
            requests[i] = client_request(ex, tool_choice)
            built = time.perf_counter()
            try:
                makers[i] = constraint_factory(tok, tools=requests[i].tools, tool_choice=requests[i].tool_choice,
                                               json_schema=requests[i].json_schema, strict=requests[i].strict,
                                               max_tokens=budget)
            except ValueError as exc:  # the server answers 400 "cannot enforce this schema": no answer, wrong
                del prompts[i]
                items.append(ItemResult(i, False, f"<request rejected: {exc}>", 0, 0, "rejected"))
            build_seconds += time.perf_counter() - built
        order = sorted(prompts)
        task_params = [base.replace(max_tokens=budget)] * len(order)
        constraints = [makers.get(i) for i in order] if constrained else None
        started = time.perf_counter() - build_seconds
        for k, state in _run_batch(decoder, [prompts[i] for i in order], task_params, batch_size, constraints):
            i = order[k]
            finish = state.finish_reason or "length"
            if constrained:
                output, error = client_text(decoder.result(state), tok, requests[i])
                if error is not None:
                    output, finish = f"<server error: {error}>", "server_error"
            else:
                output = tok.decode(state.answer_ids, skip_special_tokens=False)
                if state.stop_text is not None:
                    output = state.stop_text
            correct = finish != "server_error" and bool(task.verify(examples[i], output))
            items.append(ItemResult(i, correct, output, state.stats.tokens, state.stats.forwards, finish))
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
        if constrained:
            metrics["request"] = ", ".join(sorted({r.kind for r in requests.values()})) or "none"
            metrics["constrained_requests"] = sum(m is not None for m in makers.values())
            metrics["rejected"] = sum(r.finish_reason == "rejected" for r in items)
            metrics["server_errors"] = sum(r.finish_reason == "server_error" for r in items)
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
