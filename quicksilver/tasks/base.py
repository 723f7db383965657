"""The pieces every task family shares: the Example record, the Task interface, phrasing splits, rendering.

A task generates an :class:`Example` from a ``random.Random`` and a split ("train" or "eval") and verifies a
model's output programmatically. Train and eval differ in seeds AND in wording: every list of phrasings is
split by index so that some templates (and system prompts) only ever appear in the held-out eval split.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from quicksilver.tokenizer import EOS, PAD, RAINBOW_PADS, Tokenizer

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")
T = TypeVar("T")

# every HOLDOUT-th phrasing (index % HOLDOUT == HOLDOUT - 1) is reserved for the eval split
HOLDOUT = 4


@dataclass
class Example:
    """One task instance: the context to condition on, the target to produce, and what ``verify`` checks."""

    task: str
    messages: list[dict[str, Any]]  # chat context (system/user/assistant/tool turns) before the target turn
    target: dict[str, Any] | str  # chat: the assistant message; raw: the completion text
    answer: Any  # the reference the task's verifier compares against
    tools: list[dict[str, Any]] | None = None  # OpenAI function-format tool list, shown in the system turn
    raw_prompt: str | None = None  # non-chat prompt (e.g. infilling); then ``messages`` is empty
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return self.raw_prompt is None


class Task:
    """A task family: ``generate(rng, split)`` makes an Example, ``verify(example, output)`` grades it."""

    name: str = ""
    description: str = ""
    in_suite: bool = True  # False for training drills: not in the default eval suite (still evaluable by name)

    def generate(self, rng: random.Random, split: Split) -> Example:
        raise NotImplementedError

    def verify(self, example: Example, output: str) -> bool:
        raise NotImplementedError


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")


def split_items(items: Sequence[T], split: Split) -> list[T]:
    """The phrasings a split may use: eval gets every HOLDOUT-th item, train all the others."""
    check_split(split)
    held = [x for i, x in enumerate(items) if i % HOLDOUT == HOLDOUT - 1]
    kept = [x for i, x in enumerate(items) if i % HOLDOUT != HOLDOUT - 1]
    return held if split == "eval" else kept


def pick(rng: random.Random, items: Sequence[T], split: Split) -> T:
    return rng.choice(split_items(items, split))


# Generic system prompts; tasks add their own. ``None`` (no system turn) is common too.
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are Quicksilver, a fast and precise assistant.",
    "Answer concisely.",
    "You are a careful assistant. Be accurate and brief.",
    "You are a friendly AI helper. Keep answers short.",
    "Respond to the user as accurately as you can.",
    "You are an assistant that gives exact answers.",
    "Be helpful, correct and to the point.",
    "You are a knowledgeable assistant.",
    "Keep your replies short and correct.",
    "You are a smart assistant who never rambles.",
    "Help the user with their request.",
)


def system_turn(rng: random.Random, split: Split, extra: Sequence[str] = (), p_none: float = 0.3) -> list[dict]:
    """Zero or one system message, drawn from the generic prompts plus task-specific ones."""
    if rng.random() < p_none:
        return []
    pool = list(SYSTEM_PROMPTS) + list(extra)
    return [{"role": "system", "content": pick(rng, pool, split)}]


# Short earlier exchanges prepended to some conversations so the model sees multi-turn chats.
SMALL_TALK: tuple[tuple[str, str], ...] = (
    ("Hi!", "Hello! How can I help you today?"),
    ("Good morning.", "Good morning! What can I do for you?"),
    ("Thanks for the help earlier.", "You are welcome. What else do you need?"),
    ("Are you there?", "Yes, I am here. How can I help?"),
    ("Hello, I have a question.", "Sure, go ahead."),
    ("hey", "Hey! What do you need?"),
    ("Can you help me with something?", "Of course. What is it?"),
    ("I need a hand.", "Happy to help. What do you need?"),
    ("Hi there, quick question.", "Sure, ask away."),
    ("Good evening!", "Good evening! How can I help?"),
    ("Yo, you awake?", "Always. What can I do for you?"),
    ("Hello again.", "Hello! What can I help with this time?"),
)


_QUICK_MATH = (
    "What is {a} + {b}?",
    "{a} plus {b}?",
    "Add {a} and {b}.",
    "Quick: {a} + {b}",
    "What's {a} + {b}?",
    "Sum {a} and {b}.",
    "{a} + {b} = ?",
    "Can you add {a} and {b}?",
)


def history_turns(rng: random.Random, split: Split, p: float = 0.2) -> list[dict]:
    """With probability ``p``, an earlier user/assistant exchange (multi-turn context): small talk or a
    quick sum, so the model learns to answer the LAST user turn."""
    if rng.random() >= p:
        return []
    if rng.random() < 0.6:
        user, assistant = pick(rng, SMALL_TALK, split)
    else:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        user, assistant = pick(rng, _QUICK_MATH, split).format(a=a, b=b), f"{a} + {b} = {a + b}."
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


# Openers people put in front of a request; some are held out for eval like every other phrasing list.
OPENERS: tuple[str, ...] = (
    "Please help: ",
    "Hey, ",
    "Quick question. ",
    "Hi! ",
    "I was wondering: ",
    "Can you help? ",
    "Hello. ",
    "Ok so ",
    "Question: ",
    "Urgent: ",
    "Hi, I need this: ",
    "Help me out. ",
)


def user_turn(rng: random.Random, split: Split, text: str) -> dict[str, str]:
    """A user message with light surface variation (an opener, a dropped final punctuation mark) so the model
    does not tie a task to one exact wording. Values inside the text are never touched."""
    if rng.random() < 0.25:
        text = pick(rng, OPENERS, split) + text
    if rng.random() < 0.2 and text[-1:] in ".?!":
        text = text[:-1]
    return {"role": "user", "content": text}


def render_prompt(example: Example, tokenizer: Tokenizer) -> str:
    """Just the prompt (what a model is given at eval time); works with any chat template."""
    if not example.is_chat:
        return example.raw_prompt or ""
    return tokenizer.apply_chat_template(example.messages, tools=example.tools, add_generation_prompt=True)


def render(example: Example, tokenizer: Tokenizer) -> tuple[str, str]:
    """(prompt text, response text) exactly as the chat template renders them; the response ends with EOS."""
    if not example.is_chat:
        assert isinstance(example.target, str)
        return example.raw_prompt or "", example.target + EOS
    prompt = tokenizer.apply_chat_template(example.messages, tools=example.tools, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(
        [*example.messages, example.target], tools=example.tools, add_generation_prompt=False
    )
    if not full.startswith(prompt):  # a template that rewrites earlier turns cannot be split this way
        raise ValueError("chat template does not render the prompt as a prefix of the full conversation")
    return prompt, full[len(prompt) :]


_SPECIALS_TO_DROP = (PAD, *RAINBOW_PADS)


def clean_output(text: str, strip: bool = True) -> str:
    """Model output -> the answer text: cut at the first EOS, drop padding tokens, strip whitespace
    (``strip=False`` keeps leading indentation, which matters for code infilling)."""
    text = text.split(EOS, 1)[0]
    for tok in _SPECIALS_TO_DROP:
        text = text.replace(tok, "")
    return text.strip() if strip else text.rstrip()


def strip_fences(text: str) -> str:
    """Remove a surrounding Markdown code fence if there is one."""
    m = re.search(r"```[a-zA-Z]*\n(.*?)```", text, re.S)
    return m.group(1) if m else text


def first_json_value(text: str, opener: str = "{") -> Any:
    """Parse the first JSON value that starts with ``opener`` in ``text`` (None if there is none)."""
    import json

    decoder = json.JSONDecoder()
    start = text.find(opener)
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text[start:])
            return value
        except json.JSONDecodeError:
            start = text.find(opener, start + 1)
    return None
