"""Train the project's BPE on corpus text plus rendered task samples (fast: about a minute on 2 cores)."""

from __future__ import annotations

import random
from collections.abc import Iterator

from quicksilver.tokenizer import SPECIAL_TOKENS, Tokenizer, train_bpe

TOKENIZER_SEED = 1234
CORPUS_CHARS_PER_SOURCE = 1_500_000
TASK_EXAMPLES_PER_TASK = 1500


def _strip_specials(text: str) -> str:
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, "\n")
    return text


def tokenizer_texts(
    corpus_chars: int = CORPUS_CHARS_PER_SOURCE, task_examples: int = TASK_EXAMPLES_PER_TASK
) -> Iterator[str]:
    """Deterministic training texts: the start of each corpus source, then train-split task renderings."""
    from quicksilver.data.corpus import load_corpus
    from quicksilver.tasks import SUITE, TASKS, render
    from quicksilver.testing import tiny_tokenizer

    for docs in (load_corpus() if corpus_chars > 0 else {}).values():
        used = 0
        for doc in docs:
            yield doc
            used += len(doc)
            if used >= corpus_chars:
                break
    renderer = tiny_tokenizer()  # only its chat template is used to render the text
    for name in sorted(SUITE):  # the suite the shipped tokenizer was built from (drills came later)
        task = TASKS[name]
        rng = random.Random(f"tokenizer:{TOKENIZER_SEED}:{name}")
        for _ in range(task_examples):
            prompt, response = render(task.generate(rng, "train"), renderer)
            yield _strip_specials(prompt + response)


def build_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    """A byte-level BPE (special tokens first: mask=0, eos=1, pad=2) for the training mixture. Digit runs are
    split from their neighbours before the merges are learnt (``split_digit_runs``); the shipped tokenizer's merges
    were learnt before that split existed, and session 41 added the split to its pre-tokenizer only."""
    return train_bpe(tokenizer_texts(), vocab_size)
