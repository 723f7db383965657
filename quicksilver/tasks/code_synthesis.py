"""Short code synthesis: write a tiny Python function from a description; graded by running asserts on
random inputs in a separate, isolated interpreter (``python -I``) with a timeout."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quicksilver.tasks.base import (
    Example,
    Split,
    Task,
    check_split,
    clean_output,
    history_turns,
    pick,
    strip_fences,
    system_turn,
    user_turn,
)

RUN_TIMEOUT_S = 5.0
MEMORY_LIMIT = 1 << 30  # bytes of address space for the child interpreter


@dataclass(frozen=True)
class FunctionSpec:
    names: tuple[str, ...]
    params: str  # parameter list as written in the def line
    doc: str  # what the function does, formatted with the constants
    body: str  # reference body (indented 4), formatted with the constants
    consts: Callable[[random.Random], dict[str, Any]]
    reference: Callable[..., Any]  # (consts, *args) -> expected result
    inputs: Callable[[random.Random], tuple]


def _ints(rng: random.Random, n: int = 5) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(0, n))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiou xyz") for _ in range(rng.randint(0, 9)))


SPECS: tuple[FunctionSpec, ...] = (
    FunctionSpec(
        ("add_k", "plus_k", "shift"),
        "x",
        "returns x plus {k}",
        "    return x + {k}",
        lambda r: {"k": r.randint(1, 20)},
        lambda c, x: x + c["k"],
        lambda r: (r.randint(-50, 50),),
    ),
    FunctionSpec(
        ("scale", "times_k", "multiply_all"),
        "xs",
        "returns a list with every element of xs multiplied by {k}",
        "    return [v * {k} for v in xs]",
        lambda r: {"k": r.randint(2, 9)},
        lambda c, xs: [v * c["k"] for v in xs],
        lambda r: (_ints(r),),
    ),
    FunctionSpec(
        ("count_char", "occurrences", "char_count"),
        "s",
        "returns how many times the letter {ch} appears in s",
        "    return s.count({ch!r})",
        lambda r: {"ch": r.choice("aeiouxyz")},
        lambda c, s: s.count(c["ch"]),
        lambda r: (_word(r),),
    ),
    FunctionSpec(
        ("reverse", "backwards", "flip"),
        "s",
        "returns the string s reversed",
        "    return s[::-1]",
        lambda r: {},
        lambda c, s: s[::-1],
        lambda r: (_word(r),),
    ),
    FunctionSpec(
        ("largest", "biggest", "max_value"),
        "xs",
        "returns the largest number in the non-empty list xs",
        "    return max(xs)",
        lambda r: {},
        lambda c, xs: max(xs),
        lambda r: ([r.randint(-9, 99) for _ in range(r.randint(1, 6))],),
    ),
    FunctionSpec(
        ("is_multiple", "divisible", "multiple_of_k"),
        "n",
        "returns True if n is divisible by {k}, else False",
        "    return n % {k} == 0",
        lambda r: {"k": r.randint(2, 9)},
        lambda c, n: n % c["k"] == 0,
        lambda r: (r.randint(-40, 40),),
    ),
    FunctionSpec(
        ("above", "greater_than", "keep_big"),
        "xs",
        "returns the elements of xs that are greater than {k}, in order",
        "    return [v for v in xs if v > {k}]",
        lambda r: {"k": r.randint(-5, 10)},
        lambda c, xs: [v for v in xs if v > c["k"]],
        lambda r: (_ints(r, 7),),
    ),
    FunctionSpec(
        ("sum_squares", "square_sum", "sos"),
        "xs",
        "returns the sum of the squares of the numbers in xs",
        "    return sum(v * v for v in xs)",
        lambda r: {},
        lambda c, xs: sum(v * v for v in xs),
        lambda r: (_ints(r),),
    ),
    FunctionSpec(
        ("factorial", "fact", "product_to_n"),
        "n",
        "returns n factorial (n >= 0)",
        "    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result",
        lambda r: {},
        lambda c, n: __import__("math").factorial(n),
        lambda r: (r.randint(0, 10),),
    ),
    FunctionSpec(
        ("clamp", "limit", "bound"),
        "x",
        "returns x limited to the range {lo} to {hi}",
        "    return max({lo}, min({hi}, x))",
        lambda r: {"lo": (lo := r.randint(-10, 5)), "hi": lo + r.randint(1, 20)},
        lambda c, x: max(c["lo"], min(c["hi"], x)),
        lambda r: (r.randint(-30, 30),),
    ),
    FunctionSpec(
        ("count_vowels", "vowels", "num_vowels"),
        "s",
        "returns the number of vowels (a, e, i, o, u) in s",
        "    return sum(1 for ch in s if ch in 'aeiou')",
        lambda r: {},
        lambda c, s: sum(1 for ch in s if ch in "aeiou"),
        lambda r: (_word(r),),
    ),
    FunctionSpec(
        ("first_n", "head", "take"),
        "xs",
        "returns the first {k} elements of xs",
        "    return xs[:{k}]",
        lambda r: {"k": r.randint(1, 4)},
        lambda c, xs: xs[: c["k"]],
        lambda r: (_ints(r, 7),),
    ),
    FunctionSpec(
        ("repeat", "times", "echo"),
        "s",
        "returns s repeated {k} times",
        "    return s * {k}",
        lambda r: {"k": r.randint(2, 5)},
        lambda c, s: s * c["k"],
        lambda r: (_word(r),),
    ),
    FunctionSpec(
        ("evens", "even_only", "keep_even"),
        "xs",
        "returns the even numbers of xs, in order",
        "    return [v for v in xs if v % 2 == 0]",
        lambda r: {},
        lambda c, xs: [v for v in xs if v % 2 == 0],
        lambda r: (_ints(r, 7),),
    ),
    FunctionSpec(
        ("fib", "fibonacci", "nth_fib"),
        "n",
        "returns the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1",
        "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        lambda r: {},
        lambda c, n: _fib(n),
        lambda r: (r.randint(0, 20),),
    ),
    FunctionSpec(
        ("distance", "abs_diff", "gap"),
        "a, b",
        "returns the absolute difference of a and b",
        "    return abs(a - b)",
        lambda r: {},
        lambda c, a, b: abs(a - b),
        lambda r: (r.randint(-50, 50), r.randint(-50, 50)),
    ),
)


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


_ASKS = (
    "Write a Python function `{sig}` that {doc}.",
    "Implement {sig} in Python. It {doc}.",
    "I need a Python function named {name} taking ({params}) that {doc}.",
    "Python: define {sig}, which {doc}.",
    "Can you code a function {sig} that {doc}?",
    "Give me Python code for {sig}: it {doc}.",
    "Create a function {sig}. It should do this: it {doc}.",
    "Please write {sig}; the function {doc}. Only the code.",
    "Code {sig} in Python; it {doc}.",
    "Write {sig}. Spec: it {doc}.",
    "Python function please: {sig}, which {doc}.",
    "Need a quick Python helper {sig} that {doc}.",
)
_CODE_SYSTEMS = (
    "You are a Python expert. Reply with code only.",
    "Write clean, correct Python.",
    "You are a coding assistant.",
    "Return just the function, no explanation.",
)


def make_instance(rng: random.Random) -> tuple[FunctionSpec, str, dict[str, Any], list[str]]:
    """(spec, function name, constants, assert lines checking the function on random inputs)."""
    spec = rng.choice(SPECS)
    name = rng.choice(spec.names)
    consts = spec.consts(rng)
    tests = []
    for _ in range(5):
        args = spec.inputs(rng)
        expected = spec.reference(consts, *args)
        tests.append(f"assert {name}({', '.join(map(repr, args))}) == {expected!r}")
    return spec, name, consts, tests


def _limit_resources() -> None:  # runs in the child before exec: caps memory and CPU time of model-written code
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_CPU, (int(RUN_TIMEOUT_S) + 1, int(RUN_TIMEOUT_S) + 1))


def run_tests(code: str, tests: list[str], timeout: float = RUN_TIMEOUT_S) -> bool:
    """True if ``code`` followed by the asserts exits cleanly in an isolated interpreter (``-I``: no user site,
    no environment variables, no script folder on the path) run in a scratch folder, within ``timeout``."""
    program = code + "\n\n" + "\n".join(tests) + "\n"
    with tempfile.TemporaryDirectory(prefix="qs-code-") as scratch:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", program],
                capture_output=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                cwd=scratch,
                preexec_fn=_limit_resources if os.name == "posix" else None,
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


class CodeSynthesis(Task):
    name = "code"
    description = "write a tiny Python function; graded by running asserts in a subprocess"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        spec, name, consts, tests = make_instance(rng)
        doc = spec.doc.format(**consts)
        sig = f"{name}({spec.params})"
        ask = pick(rng, _ASKS, split).format(sig=sig, name=name, params=spec.params, doc=doc)
        code = f"def {sig}:\n" + spec.body.format(**consts)
        messages = system_turn(rng, split, _CODE_SYSTEMS) + history_turns(rng, split, p=0.1)
        messages.append(user_turn(rng, split, ask))
        return Example(self.name, messages, {"role": "assistant", "content": code}, {"tests": tests})

    def verify(self, example: Example, output: str) -> bool:
        return run_tests(strip_fences(clean_output(output)), example.answer["tests"])
