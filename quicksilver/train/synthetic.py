"""Toy Sample streams (copy / reverse chats and plain patterned text) for tests and smoke runs.

Deterministic like the real stream: Sample i depends only on (seed, i), so a stream can restart anywhere.
Uses the tiny test tokenizer, so nothing here needs the corpus.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from quicksilver.tokenizer import Tokenizer


@dataclass
class ToySample:
    prompt_ids: list[int]
    response_ids: list[int]


def toy_stream(tokenizer: Tokenizer, seed: int, start: int = 0, mix: dict | None = None) -> Iterator[ToySample]:
    user, assistant, eos = (tokenizer.token_id(t) for t in ("<|user|>", "<|assistant|>", "<|eos|>"))
    copy_id, rev_id = tokenizer.encode("copy")[0], tokenizer.encode("reverse")[0]
    alphabet = list(range(40, 72))  # ordinary BPE tokens of the tiny tokenizer
    i = start
    while True:
        rng = random.Random(seed * 1_000_003 + i)
        kind = rng.random()
        seq = [rng.choice(alphabet) for _ in range(rng.randint(3, 12))]
        if kind < 0.4:
            yield ToySample([user, copy_id, *seq, eos, assistant], [*seq, eos])
        elif kind < 0.8:
            yield ToySample([user, rev_id, *seq, eos, assistant], [*reversed(seq), eos])
        else:  # plain text: an arithmetic progression of tokens, no prompt
            a, d = rng.choice(alphabet), rng.randint(1, 3)
            yield ToySample([], [alphabet[(a - alphabet[0] + d * k) % len(alphabet)] for k in range(20)] + [eos])
        i += 1


TOY_RECIPE: dict = {
    "name": "toy",
    "objective": "block",
    "model": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "block_size": 8, "max_position_embeddings": 256},
    "data": {"source": "synthetic", "seq_len": 64},
    "train": {"batch_size": 4, "max_steps": 40, "lr": 3e-3, "warmup_steps": 3, "checkpoint_every": 100,
              "threads": 1},
}


def toy_recipe(objective: str = "block", **train_overrides):
    """A seconds-long recipe on the toy stream (tests, smoke runs)."""
    from quicksilver.train.recipe import Recipe

    return Recipe.from_dict({**TOY_RECIPE, "objective": objective,
                             "train": {**TOY_RECIPE["train"], **train_overrides}})
