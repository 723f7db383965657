"""Retrieval QA over given passages about invented places, people and products (so the answer can only come
from the passages), including questions the passages do not answer; and a training drill with passages as a
search returns them (:class:`RetrievalNear`)."""

from __future__ import annotations

import random
import re

from quicksilver.tasks.base import (
    Example,
    Split,
    Task,
    check_split,
    clean_output,
    history_turns,
    pick,
    system_turn,
    user_turn,
)

_SYLLABLES = ("var", "nol", "ket", "ami", "dor", "bel", "sun", "tor", "ela", "mir", "kas", "ond", "ru", "vel", "zan")
_RIVERS = ("Esk", "Marrow", "Tell", "Oxbow", "Silver", "Lune", "Brack", "Wend")
_FOODS = ("fish stew", "plum cake", "barley bread", "goat cheese", "honey buns", "smoked eel", "apple pie")
_FOUNDERS = ("Ida Brandt", "Olof Marsh", "Kemi Ade", "Piet Varga", "Lin Zhou", "Rosa Keel", "Tomas Irwin")
_COLORS = ("green", "amber", "violet", "grey", "scarlet", "teal")

# fact key -> (passage sentence, question phrasings, answer function)
_FACTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "river": (
        "{e} lies on the river {river}.",
        (
            "Which river does {e} lie on?",
            "What river runs through {e}?",
            "Name the river at {e}.",
            "On which river is {e}?",
        ),
    ),
    "founded": (
        "{e} was founded in {founded}.",
        (
            "When was {e} founded?",
            "In what year was {e} founded?",
            "What is the founding year of {e}?",
            "How old is {e}? Give the founding year.",
        ),
    ),
    "population": (
        "About {population} people live in {e}.",
        (
            "How many people live in {e}?",
            "What is the population of {e}?",
            "Roughly how many residents does {e} have?",
            "How big is the population of {e}?",
        ),
    ),
    "food": (
        "{e} is famous for its {food}.",
        (
            "What food is {e} known for?",
            "What is {e} famous for eating?",
            "Which dish is {e} known for?",
            "What should I eat in {e}?",
        ),
    ),
    "founder": (
        "{e} was founded by {founder}.",
        (
            "Who founded {e}?",
            "Who was the founder of {e}?",
            "Name the person who founded {e}.",
            "Which person started {e}?",
        ),
    ),
    "flag": (
        "The flag of {e} is {flag}.",
        (
            "What colour is the flag of {e}?",
            "What color is {e}'s flag?",
            "Describe the flag colour of {e}.",
            "Which colour does {e} use on its flag?",
        ),
    ),
}
_ASKS = (
    "Use the passages to answer.\n\n{passages}\n\nQuestion: {q}",
    "{passages}\n\nBased only on the text above: {q}",
    "Passages:\n{passages}\n\n{q}",
    "Read these and answer the question.\n{passages}\nQ: {q}",
    "Context:\n{passages}\n\nAnswer from the context. {q}",
    "{q}\n\nHere is what I found:\n{passages}",
    "Documents:\n{passages}\nUsing the documents, {q}",
    "I have some notes:\n{passages}\n{q} Answer only from the notes.",
    "Sources:\n{passages}\n\nQuestion: {q}",
    "{passages}\n\n{q} Use only these passages.",
    "Answer using the snippets below.\n{passages}\n{q}",
    "Given these facts:\n{passages}\nWhat is the answer? {q}",
)
_RAG_SYSTEMS = (
    "Answer only from the provided passages. If they do not contain the answer, say so.",
    "You answer questions using retrieved documents.",
    "Use the given context. Do not make things up.",
    "You are a research assistant. Cite nothing, just answer from the text.",
)
NOT_FOUND_ANSWERS = (
    "The passages do not say.",
    "That is not in the passages.",
    "The passages do not mention this.",
)
_NOT_FOUND = re.compile(
    r"\b(not|no|nothing|doesn't|don't)\b.{0,40}\b(passages?|text|context|documents?|notes|mention|say|said|given)\b",
    re.I | re.S,
)
_ANSWERS = ("{a}.", "{a}", "The answer is {a}.", "According to the passages, {a}.")


def is_not_found(text: str) -> bool:
    return bool(_NOT_FOUND.search(text))


def _entity(rng: random.Random) -> str:
    return "".join(rng.sample(_SYLLABLES, rng.choice((2, 3)))).capitalize()


def _facts(rng: random.Random) -> dict[str, str]:
    return {
        "river": rng.choice(_RIVERS),
        "founded": str(rng.randint(1100, 1990)),
        "population": str(rng.randint(2, 90) * 100),
        "food": rng.choice(_FOODS),
        "founder": rng.choice(_FOUNDERS),
        "flag": rng.choice(_COLORS),
    }


def _numbered_passages(rng: random.Random, names: list[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """One passage per name, "[i] " and three of its facts, and the facts each passage states ({name: {key: value}})."""
    passages, known = [], {}
    for i, e in enumerate(names):
        facts = _facts(rng)
        keys = rng.sample(sorted(_FACTS), 3)
        passages.append(f"[{i + 1}] " + " ".join(_FACTS[k][0].format(e=e, **facts) for k in keys))
        known[e] = {k: facts[k] for k in keys}
    return passages, known


class RetrievalQA(Task):
    name = "retrieval"
    description = "answer from given passages, or say the passages do not contain the answer"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        names: list[str] = []
        while len(names) < rng.randint(2, 3):
            n = _entity(rng)
            if n not in names:
                names.append(n)
        passages, known = _numbered_passages(rng, names)
        answerable = rng.random() < 0.75
        if answerable:
            e = rng.choice(names)
            key = rng.choice(sorted(known[e]))
            answer = known[e][key]
        else:  # ask about a fact no passage gives for that entity (or an entity that is absent)
            e = rng.choice(names) if rng.random() < 0.6 else _entity(rng)
            missing = [k for k in sorted(_FACTS) if k not in known.get(e, {})]
            key = rng.choice(missing)
            answer = None
        q = pick(rng, _FACTS[key][1], split).format(e=e)
        ask = pick(rng, _ASKS, split).format(passages="\n".join(passages), q=q)
        messages = system_turn(rng, split, _RAG_SYSTEMS, p_none=0.2) + history_turns(rng, split, p=0.1)
        messages.append(user_turn(rng, split, ask))
        text = rng.choice(_ANSWERS).format(a=answer) if answer else rng.choice(NOT_FOUND_ANSWERS)
        return Example(self.name, messages, {"role": "assistant", "content": text}, answer)

    def verify(self, example: Example, output: str) -> bool:
        text = clean_output(output)
        if example.answer is None:
            return is_not_found(text)
        words = re.findall(r"[\w']+", text.lower())
        want = re.findall(r"[\w']+", example.answer.lower())
        found = any(words[i : i + len(want)] == want for i in range(len(words) - len(want) + 1))
        return found and not is_not_found(text)


class RetrievalNear(RetrievalQA):
    """Training drill: passages as the RAG path hands them over. A search for a made-up name brings back passages
    about names that look alike (a question about "Nolbel" retrieves "Nolvar" and "Nolmir"), one to five of them,
    and the shipped models took their facts (docs/rag.md, session 43). Here most passages are about such
    neighbours; the answer comes from the passage about the asked name itself, or, when no passage is about it
    or it lacks the fact, the passages do not say. Half the prompts use augment_messages' layout, half the suite
    task's training wordings."""

    name = "retrieval_near"
    description = "answer from retrieved passages about look-alike names, or say they do not contain the answer"
    in_suite = False

    def generate(self, rng: random.Random, split: Split) -> Example:
        from quicksilver.rag.chat import PASSAGES_HEADER  # the layout augment_messages writes

        check_split(split)
        syllables = rng.sample(_SYLLABLES, rng.choice((2, 3)))
        asked = "".join(syllables).capitalize()
        count = rng.randint(1, 5)
        names = [asked] if rng.random() < 0.8 else []  # else: only neighbours came back
        while len(names) < count:
            name = _look_alike(rng, syllables)
            if name != asked and name not in names:
                names.append(name)
        rng.shuffle(names)
        passages, known = _numbered_passages(rng, names)
        if asked in known and rng.random() < 0.85:
            key = rng.choice(sorted(known[asked]))
            answer: str | None = known[asked][key]
        else:
            key = rng.choice([k for k in sorted(_FACTS) if k not in known.get(asked, {})])
            answer = None
        q = pick(rng, _FACTS[key][1], split).format(e=asked)
        if rng.random() < 0.5:
            ask = f"{PASSAGES_HEADER}" + "\n".join(passages) + f"\n\n{q}"
        else:
            ask = pick(rng, _ASKS, split).format(passages="\n".join(passages), q=q)
        messages = system_turn(rng, split, _RAG_SYSTEMS, p_none=0.3) + history_turns(rng, split, p=0.1)
        messages.append(user_turn(rng, split, ask))
        text = rng.choice(_ANSWERS).format(a=answer) if answer else rng.choice(NOT_FOUND_ANSWERS)
        return Example(self.name, messages, {"role": "assistant", "content": text}, answer,
                       meta={"asked": asked, "names": names})


def _look_alike(rng: random.Random, syllables: list[str]) -> str:
    """A made-up name sharing the first (mostly) or last syllable of ``syllables``' name."""
    others = [s for s in _SYLLABLES if s not in syllables]
    if rng.random() < 0.7:
        parts = [syllables[0], *rng.sample(others, rng.choice((1, 2)))]
    else:
        parts = [*rng.sample(others, rng.choice((1, 2))), syllables[-1]]
    return "".join(parts).capitalize()
