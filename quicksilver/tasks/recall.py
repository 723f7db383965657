"""Copy and look-up drills over random strings: the skill under tool arguments, JSON values and retrieval.

The suite's failures at small scale are mostly copying errors ("Chloe Khan" answered as "Chloe Kim", "x3" as
20): names and numbers there come from short lists, so a prior guess is often right and the training signal for
copying stays weak. Here every value is random (made-up words, digit strings, codes), so only copying from the
context gets it right. A training drill: it is not part of the default eval suite (``in_suite = False``), but
``quicksilver eval --tasks recall`` measures it on held-out seeds and phrasings.
"""

from __future__ import annotations

import json
import random

from quicksilver.tasks.base import Example, Split, Task, clean_output, history_turns, pick, system_turn, user_turn

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "kl", "sh", "ch")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "k", "l", "x", "th")


def made_up_word(rng: random.Random) -> str:
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
    return word.capitalize() if rng.random() < 0.4 else word


def random_value(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return made_up_word(rng)
    if kind < 0.55:
        return f"{made_up_word(rng).capitalize()} {made_up_word(rng).capitalize()}"
    if kind < 0.8:
        return str(rng.randint(0, 10 ** rng.randint(1, 7)))
    letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(rng.randint(1, 3)))
    return f"{letters}{rng.choice(('', '-'))}{rng.randint(10, 99999)}"


_REPEAT = (
    "Repeat exactly: {s}",
    "Copy this text verbatim: {s}",
    "Say this back to me word for word: {s}",
    "Echo the following, unchanged.\n{s}",
    "Please write out exactly what follows: {s}",
    "Type this again without changing anything: {s}",
    "Reproduce the string below exactly.\n{s}",
    "Return this text as it is: {s}",
)
_LOOKUP = (
    "{records}\n\nWhat is the value for {key}?",
    "Here are some records:\n{records}\nGive me the value of {key}.",
    "{records}\n\nLook up {key} and reply with its value only.",
    "Using this table:\n{records}\nwhat does {key} map to?",
    "Records:\n{records}\nWhich value belongs to {key}?",
    "{records}\nFind {key}. Answer with the value.",
    "From the list below, return the value stored under {key}.\n{records}",
    "Table:\n{records}\n{key} = ?",
)
_TO_JSON = (
    "Turn this into a JSON object with the keys {keys}:\n{fields}",
    "Write these fields as JSON ({keys}).\n{fields}",
    "{fields}\nReturn a JSON object with keys {keys}.",
    "Convert to JSON with keys {keys}: {fields}",
    "Make a JSON object ({keys}) from:\n{fields}",
    "Put the following into JSON using the keys {keys}.\n{fields}",
    "{fields}\nAs JSON, please (keys: {keys}).",
    "JSON for this record, keys {keys}:\n{fields}",
)
_FIELD_NAMES = ("name", "code", "city", "owner", "label", "id", "tag", "model", "note", "ref", "count", "size")
_SEPARATORS = (": ", " = ", " -> ", " is ")


class Recall(Task):
    name = "recall"
    description = "copy random strings, look up a key among records, or write given fields as JSON (a drill)"
    in_suite = False

    def generate(self, rng: random.Random, split: Split) -> Example:
        kind = rng.choice(("repeat", "lookup", "json"))
        messages = system_turn(rng, split) + history_turns(rng, split)
        if kind == "repeat":
            joiner = rng.choice((" ", ", ", " ", "; ", "\n"))
            answer = joiner.join(random_value(rng) for _ in range(rng.randint(1, 8)))
            text = pick(rng, _REPEAT, split).format(s=answer)
        elif kind == "lookup":
            keys = list(dict.fromkeys(made_up_word(rng) for _ in range(rng.randint(2, 8))))
            values = [random_value(rng) for _ in keys]
            sep = rng.choice(_SEPARATORS)
            records = "\n".join(f"{k}{sep}{v}" for k, v in zip(keys, values, strict=True))
            index = rng.randrange(len(keys))
            answer = values[index]
            text = pick(rng, _LOOKUP, split).format(records=records, key=keys[index])
        else:
            names = rng.sample(_FIELD_NAMES, rng.randint(2, 5))
            values = {n: random_value(rng) for n in names}
            sep = rng.choice(_SEPARATORS[:2])
            fields = "\n".join(f"{n}{sep}{v}" for n, v in values.items())
            answer = json.dumps(values)
            text = pick(rng, _TO_JSON, split).format(keys=", ".join(names), fields=fields)
        messages.append(user_turn(rng, split, text))
        return Example(self.name, messages, {"role": "assistant", "content": answer}, answer, meta={"kind": kind})

    def verify(self, example: Example, output: str) -> bool:
        got = clean_output(output)
        if example.meta.get("kind") == "json":
            try:
                return json.loads(got) == json.loads(example.answer)
            except ValueError:
                return False
        return got == example.answer
