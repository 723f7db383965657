"""Infilling (fill in the middle): a raw, non-chat prompt ``<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>``; the
model writes the missing middle. Graded functionally: prefix + middle + suffix must pass the asserts."""

from __future__ import annotations

import random

from quicksilver.tasks.base import Example, Split, Task, check_split, clean_output
from quicksilver.tasks.code_synthesis import make_instance, run_tests
from quicksilver.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX


def fim_prompt(prefix: str, suffix: str) -> str:
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


class Infilling(Task):
    name = "infill"
    description = "fill in a missing function body line between a prefix and a suffix (FIM tokens)"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        spec, name, consts, tests = make_instance(rng)
        doc = spec.doc.format(**consts)
        lines = spec.body.format(**consts).split("\n")
        cut = rng.randrange(len(lines))  # the missing line
        # the docstring says what to write; held-out eval uses a comment instead of a docstring
        header = f"def {name}({spec.params}):\n"
        header += f'    """{doc[0].upper() + doc[1:]}."""\n' if split == "train" else f"    # {doc}\n"
        prefix = header + "".join(line + "\n" for line in lines[:cut])
        middle = lines[cut]
        shown = tests[: rng.randint(0, 2)]  # some asserts after the function, as real files have
        suffix = "".join("\n" + line for line in lines[cut + 1 :]) + "\n" + "".join(f"\n{t}" for t in shown)
        return Example(
            self.name,
            [],
            middle,
            {"prefix": prefix, "suffix": suffix, "tests": tests},
            raw_prompt=fim_prompt(prefix, suffix),
        )

    def verify(self, example: Example, output: str) -> bool:
        middle = clean_output(output, strip=False)  # the indentation is part of the answer
        program = example.answer["prefix"] + middle + example.answer["suffix"]
        return run_tests(program, example.answer["tests"])
