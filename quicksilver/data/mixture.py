"""The training mixture: verifiable task chats plus prompt-less natural text / code chunks.

Sample ``i`` of a stream depends only on ``(seed, i)`` (``random.Random(f"{seed}:{i}")``), so a stream can be
resumed at any index in O(1) and two processes reading the same index agree.
"""

from __future__ import annotations

import json
import multiprocessing
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from quicksilver.tokenizer import Tokenizer

MAX_LEN = 256  # prompt + response tokens; longer samples are regenerated

# Default weights. Task names come from quicksilver.tasks.TASKS; "text" and "code_text" are prompt-less chunks
# of the offline corpus (prose and Python source); "fim_code" is fill-in-the-middle on real Python source.
# Tool calls and JSON weigh most: the product needs them.
DEFAULT_MIX: dict[str, float] = {
    "tool_call": 0.16,
    "tool_answer": 0.06,
    "json": 0.14,
    "arithmetic": 0.07,
    "word_problem": 0.07,
    "countdown": 0.06,
    "sudoku": 0.06,
    "retrieval": 0.07,
    "code": 0.05,
    "infill": 0.04,
    "text": 0.14,
    "code_text": 0.05,
    "fim_code": 0.03,
}
CORPUS_KINDS = ("text", "code_text", "fim_code")
# pre-tokenised samples from a file (``load_samples``), e.g. a model's own answers to task prompts
FILE_KIND = "samples"
COPY_TOKENS = (8, 80)
INDUCTION_WORDS = (3, 10)  # distinct words per sample
INDUCTION_TOKENS = (48, 192)
TEXT_SOURCES = {"python_docs": 0.4, "docstrings": 0.2, "gcide": 0.2, "fortunes": 0.2}
CODE_SOURCES = {"stdlib_code": 1.0}
CHUNK_CHARS = 1600  # enough characters for ~256 tokens of prose with a 4k BPE
# Text chunks get a random length: varied lengths, and task answers (short) are not swamped by prose in the
# learned tokens (a 256-token chunk teaches as many tokens as ~10 task answers).
TEXT_TOKENS = (64, 256)


@dataclass
class Sample:
    prompt_ids: list[int]  # clean context, never noised; [] for plain text
    response_ids: list[int]  # tokens to learn; chat responses end with the EOS id
    source: str = ""  # task name or corpus source, for per-source statistics


def resolve_mix(mix: dict[str, float] | None) -> dict[str, float]:
    """Validate a mixture (unknown names -> ValueError); drop zero weights; names not available are dropped
    from the default mixture only."""
    from quicksilver.tasks import TASKS

    known = set(TASKS) | set(CORPUS_KINDS) | set(SYNTHETIC_KINDS) | {FILE_KIND}
    if mix is None:
        mix = {k: v for k, v in DEFAULT_MIX.items() if k in known}
    unknown = sorted(set(mix) - known)
    if unknown:
        raise ValueError(f"unknown mixture entries {unknown} (known: {sorted(known)})")
    if any(v < 0 for v in mix.values()):
        raise ValueError("mixture weights must be >= 0")
    mix = {k: float(v) for k, v in mix.items() if v > 0}
    if not mix:
        raise ValueError("mixture is empty")
    return mix


def load_samples(path: str | Path) -> list[Sample]:
    """Samples from a JSON-lines file of ``{"prompt_ids": [...], "response_ids": [...], "source": ...}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: samples file not found")
    samples = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                sample = Sample([int(t) for t in row["prompt_ids"]], [int(t) for t in row["response_ids"]],
                                str(row.get("source", FILE_KIND)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a sample ({exc})") from None
            if not sample.response_ids:
                raise ValueError(f"{path}:{n}: empty response")
            samples.append(sample)
    if not samples:
        raise ValueError(f"{path}: no samples")
    return samples


def _weighted(rng: random.Random, weights: dict[str, float]) -> str:
    names = sorted(weights)  # sorted: the choice must not depend on dict order
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def text_chunk(rng: random.Random, docs: list[str], chars: int = CHUNK_CHARS) -> str:
    """A random window of ``chars`` characters, starting at a line start, joining documents if needed."""
    index = rng.randrange(len(docs))
    doc = docs[index]
    start = rng.randrange(max(1, len(doc) - chars // 2)) if len(doc) > chars // 2 else 0
    if start:
        nl = doc.find("\n", start)
        start = nl + 1 if 0 <= nl < start + 200 else start
    text = doc[start : start + chars]
    while len(text) < chars:  # short documents (quotes, definitions): continue with the next ones
        index = (index + 1) % len(docs)
        text += "\n\n" + docs[index][: chars - len(text)]
    return text


def fim_split(rng: random.Random, code: str) -> tuple[str, str, str]:
    """(prefix, middle, suffix) at line boundaries; the middle is 1-4 whole lines."""
    lines = code.split("\n")
    start = rng.randrange(1, max(2, len(lines) - 1))
    end = min(len(lines), start + rng.randint(1, 4))
    prefix = "\n".join(lines[:start]) + "\n"
    middle = "\n".join(lines[start:end])
    suffix = ("\n" + "\n".join(lines[end:])) if end < len(lines) else ""
    return prefix, middle, suffix


def _corpus_sample(rng: random.Random, tokenizer: Tokenizer, kind: str, max_len: int) -> Sample | None:
    from quicksilver.data.corpus import load_corpus

    corpus = load_corpus()
    pool = TEXT_SOURCES if kind == "text" else CODE_SOURCES
    weights = {k: v for k, v in pool.items() if corpus.get(k)}
    if not weights:
        return None
    source = _weighted(rng, weights)
    if kind == "fim_code":
        from quicksilver.tasks.infilling import fim_prompt

        for _ in range(10):
            prefix, middle, suffix = fim_split(rng, text_chunk(rng, corpus[source], chars=700))
            if not middle.strip():
                continue
            prompt_ids = tokenizer.encode(fim_prompt(prefix, suffix))
            response_ids = tokenizer.encode(middle) + [tokenizer.eos_id]
            if len(prompt_ids) + len(response_ids) <= max_len:
                return Sample(prompt_ids, response_ids, f"fim:{source}")
        return None
    ids = tokenizer.encode(text_chunk(rng, corpus[source]))[: min(max_len, rng.randint(*TEXT_TOKENS))]
    return Sample([], ids, source)


def ordinary_first_id(tokenizer: Tokenizer) -> int:
    """First id the drills draw from: byte tokens (ids below the first merge) are fragments of UTF-8 characters."""
    first = max(tokenizer.special_ids, default=-1) + 1
    return first + 256 if tokenizer.vocab_size - first > 512 else first  # a real BPE: skip the byte tokens


def copy_sample(rng: random.Random, tokenizer: Tokenizer) -> Sample:
    """Random tokens as the prompt, the same tokens (then EOS) as the answer.

    Why: the shipped models learned every task format yet could not copy from their context (teacher-forced
    loss on a repeated run of random tokens no lower than on its first occurrence; MODEL_CARD.md, session 18),
    since task values come from short lists a prior can guess. A random run leaves nothing to guess, so only a
    copy circuit lowers the loss. In session 18 this drill gave the twin one within ~1,000 steps, and that
    circuit also predicted recurring made-up words at unrelated offsets (benchmarks/copy_probe.py).
    """
    first = ordinary_first_id(tokenizer)
    run = [rng.randrange(first, tokenizer.vocab_size) for _ in range(rng.randint(*COPY_TOKENS))]
    return Sample(run, run + [tokenizer.eos_id], "copy")


def induction_sample(rng: random.Random, tokenizer: Tokenizer) -> Sample:
    """Prompt-less text over a few made-up "words" (runs of 1-4 random tokens), each used several times.

    After a word's first token, only an induction circuit (find the earlier occurrence of this token, emit what
    followed it) predicts the rest of the word, and the words recur at unrelated offsets, so a fixed "copy from
    n positions back" cannot solve it. In session 18, 1,500 steps of it at half the mixture did not give the
    shipped twin that circuit (the ``copy`` drill did); it stays for training from scratch.
    """
    first = ordinary_first_id(tokenizer)
    words = [[rng.randrange(first, tokenizer.vocab_size) for _ in range(rng.randint(1, 4))]
             for _ in range(rng.randint(*INDUCTION_WORDS))]
    length = rng.randint(*INDUCTION_TOKENS)
    ids: list[int] = []
    while len(ids) < length:
        ids += rng.choice(words)
    return Sample([], ids[:length], "induction")


# drills made from random tokens: "copy" (a run answered by itself), "induction" (made-up words that recur)
SYNTHETIC: dict[str, Callable[[random.Random, Tokenizer], Sample]] = {
    "copy": copy_sample, "induction": induction_sample,
}
SYNTHETIC_KINDS = tuple(SYNTHETIC)


def task_sample(rng: random.Random, tokenizer: Tokenizer, name: str, split: str = "train") -> Sample:
    from quicksilver.tasks import TASKS, render

    prompt, response = render(TASKS[name].generate(rng, split), tokenizer)
    return Sample(tokenizer.encode(prompt), tokenizer.encode(response), name)


def sample_at(
    tokenizer: Tokenizer, seed: int, index: int, mix: dict[str, float], max_len: int = MAX_LEN,
    samples: Sequence[Sample] | None = None,
) -> Sample:
    """Sample ``index`` of the stream: a function of (seed, index) only (given the corpus, ``samples`` and code)."""
    rng = random.Random(f"{seed}:{index}")
    name = _weighted(rng, mix)
    if name == FILE_KIND:
        if not samples:
            raise ValueError(f"the mixture names {FILE_KIND!r} but no samples file was given (data.samples)")
        return samples[rng.randrange(len(samples))]
    if name in SYNTHETIC:
        return SYNTHETIC[name](rng, tokenizer)
    if name in CORPUS_KINDS:
        sample = _corpus_sample(rng, tokenizer, name, max_len)
        if sample is not None:
            return sample
        # corpus absent on this machine: fall back to the tasks of the mixture
        tasks = {k: v for k, v in mix.items() if k not in (*CORPUS_KINDS, *SYNTHETIC_KINDS, FILE_KIND)}
        if not tasks:
            raise RuntimeError("the mixture has only corpus entries and none gave a sample (corpus absent?)")
        name = _weighted(rng, tasks)
    for _ in range(50):  # regenerate the same task until it fits, so the mixture weights hold
        sample = task_sample(rng, tokenizer, name)
        if len(sample.prompt_ids) + len(sample.response_ids) <= max_len:
            return sample
    raise RuntimeError(f"task {name!r} could not produce a sample of at most {max_len} tokens")


def training_stream(
    tokenizer: Tokenizer, seed: int, start: int = 0, mix: dict[str, float] | None = None, max_len: int = MAX_LEN,
    samples: Sequence[Sample] | None = None,
) -> Iterator[Sample]:
    """Infinite, deterministic stream of training samples; resuming at ``start`` costs nothing."""
    weights = resolve_mix(mix)
    index = start
    while True:
        yield sample_at(tokenizer, seed, index, weights, max_len, samples)
        index += 1


# -- the same stream, made by several processes ------------------------------------------------------------

_worker_args: tuple | None = None  # (tokenizer, seed, weights, max_len, samples), set in each worker process


def _init_worker(tokenizer_json: str, tokenizer_config: dict, seed: int, weights: dict[str, float],
                 max_len: int, samples: Sequence[Sample] | None) -> None:
    import os
    import signal
    import threading

    from tokenizers import Tokenizer as HFTokenizer

    # Ctrl-C and SIGTERM are the trainer's to handle (it checkpoints, then closes the pool); a worker that took them
    # would crash the trainer's wait for its chunk. And a worker must not outlive a trainer that was killed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(0)), daemon=True).start()
    global _worker_args
    _worker_args = (Tokenizer(HFTokenizer.from_str(tokenizer_json), tokenizer_config), seed, weights, max_len,
                    samples)


def _samples(start: int, count: int) -> list[Sample]:
    tokenizer, seed, weights, max_len, samples = _worker_args
    return [sample_at(tokenizer, seed, i, weights, max_len, samples) for i in range(start, start + count)]


def parallel_training_stream(
    tokenizer: Tokenizer, seed: int, start: int = 0, mix: dict[str, float] | None = None, max_len: int = MAX_LEN,
    workers: int = 2, chunk: int = 128, samples: Sequence[Sample] | None = None,
) -> Iterator[Sample]:
    """:func:`training_stream`, sample for sample, made by ``workers`` processes that each render and tokenise
    ``chunk`` consecutive samples at a time, at most two chunks per worker ahead of the reader. Workers are
    spawned (not forked: the parent holds OpenMP and tokenizer threads), so the calling program needs the usual
    ``if __name__ == "__main__"`` guard; they stop when the stream is closed or the parent dies."""
    weights = resolve_mix(mix)
    pool = ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
        initargs=(tokenizer.backend.to_str(), tokenizer.config, seed, weights, max_len, samples),
    )
    pending: deque = deque()
    next_start = start
    try:
        while True:
            while len(pending) < 2 * workers:
                pending.append(pool.submit(_samples, next_start, chunk))
                next_start += chunk
            yield from pending.popleft().result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
