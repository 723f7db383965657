"""The prompts the benchmark decodes (held-out task-suite examples) and single-stream measurement.

Every configuration decodes the same prompts. Configurations are interleaved prompt by prompt (prompt 1
with every configuration, then prompt 2, ...), so slow phases of a shared machine are spread over all of
them and the ratios between configurations stay meaningful even when absolute numbers drift.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from quicksilver.decoding import Decoder
from quicksilver.sampling import SamplingParams
from quicksilver.tasks import Example, get_task, render
from quicksilver.tokenizer import Tokenizer


@dataclass
class Prompt:
    task: str
    example: Example
    ids: list[int]
    max_tokens: int


def suite_prompts(tokenizer: Tokenizer, tasks: Sequence[str], per_task: int) -> list[Prompt]:
    """Held-out eval examples (the same ones ``quicksilver eval`` uses), ``per_task`` of each task,
    interleaved across tasks so a truncated run still covers every task."""
    from quicksilver.evaluate import MAX_TOKENS, eval_examples

    by_task = {t: eval_examples(t, per_task) for t in tasks}
    out: list[Prompt] = []
    for i in range(per_task):
        for t in tasks:
            ex = by_task[t][i]
            ids = tokenizer.encode(render(ex, tokenizer)[0])
            out.append(Prompt(t, ex, ids, MAX_TOKENS.get(t, 64)))
    return out


@dataclass
class Config:
    """One thing to measure: a decoder (model + variant) and the sampling parameters it runs with."""

    label: str
    decoder: Decoder
    params: SamplingParams
    meta: dict = field(default_factory=dict)


@dataclass
class Record:
    task: str
    correct: bool
    tokens: int  # useful tokens: returned to the user (no EOS, padding or canvas filler)
    forwards: int
    latency_s: float
    ttft_s: float | None
    chars: int = 0  # characters of the returned text: a rate in these does not depend on the tokenizer


def run_one(cfg: Config, prompt: Prompt) -> Record:
    params = cfg.params.replace(max_tokens=prompt.max_tokens)
    t0 = time.perf_counter()
    state = cfg.decoder.start(prompt.ids, params)
    result = cfg.decoder.run(state)
    latency = time.perf_counter() - t0
    tok = cfg.decoder.tokenizer
    output = state.stop_text if state.stop_text is not None else tok.decode(state.answer_ids, skip_special_tokens=False)
    first = state.stats.first_token_time
    return Record(
        task=prompt.task,
        correct=bool(get_task(prompt.task).verify(prompt.example, output)),
        tokens=state.stats.tokens,
        forwards=state.stats.forwards,
        latency_s=latency,
        ttft_s=None if first is None else first - t0,
        chars=len(result.text),  # the text a user gets (Decoder.result)
    )


def run_interleaved(configs: Sequence[Config], prompts: Sequence[Prompt], warmup: int = 1) -> dict[str, list[Record]]:
    """Decode every prompt with every config, prompt-major; the order of configs alternates per prompt."""
    for cfg in configs:  # warm-up: first calls allocate buffers and pick kernels
        for p in prompts[:warmup]:
            run_one(cfg, p)
    out: dict[str, list[Record]] = {c.label: [] for c in configs}
    for i, p in enumerate(prompts):
        order = configs if i % 2 == 0 else list(reversed(configs))
        for cfg in order:
            out[cfg.label].append(run_one(cfg, p))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def summarise(records: Sequence[Record]) -> dict:
    """Aggregate single-stream metrics: tokens/s is useful tokens over the summed request latencies."""
    tokens = sum(r.tokens for r in records)
    forwards = sum(r.forwards for r in records)
    seconds = sum(r.latency_s for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    per_task: dict[str, list[bool]] = {}
    for r in records:
        per_task.setdefault(r.task, []).append(r.correct)
    return {
        "requests": len(records),
        "accuracy": sum(r.correct for r in records) / len(records) if records else 0.0,
        "task_accuracy": {t: sum(v) / len(v) for t, v in per_task.items()},
        "useful_tokens": tokens,
        "forwards": forwards,
        "tokens_per_forward": tokens / forwards if forwards else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "chars_per_second": sum(r.chars for r in records) / seconds if seconds else 0.0,
        "ttft_s_mean": statistics.fmean(ttfts) if ttfts else None,
        "ttft_s_p50": percentile(ttfts, 50) if ttfts else None,
        "latency_s_mean": seconds / len(records) if records else 0.0,
        "latency_s_p50": percentile([r.latency_s for r in records], 50),
        "seconds": seconds,
    }
