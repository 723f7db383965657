"""How many tokens do two tokenizers make of the same answers? The reference answers of the suite's first N
held-out prompts per task (the bench reads the first 10), encoded by each model folder's tokenizer.

    python benchmarks/answer_tokens.py OLD_FOLDER NEW_FOLDER [--per-task 10]

Token rates (useful tokens/s, tokens per forward) of models with different tokenizers differ by this ratio for the
same text; the bench's chars/s column does not.
"""

from __future__ import annotations

import argparse

from quicksilver.evaluate import eval_examples
from quicksilver.tasks import SUITE, render
from quicksilver.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--per-task", type=int, default=10)
    args = ap.parse_args()
    old, new = Tokenizer.load(args.old), Tokenizer.load(args.new)
    counts = [0, 0]
    for task in SUITE:
        for example in eval_examples(task, args.per_task):
            _, answer = render(example, old)
            counts[0] += len(old.encode(answer))
            counts[1] += len(new.encode(answer))
    print(f"{counts[0]} -> {counts[1]} tokens ({counts[1] / counts[0]:.3f}x) over {args.per_task} prompts per task")


if __name__ == "__main__":
    main()
