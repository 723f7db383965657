"""Arithmetic expressions and multi-step word problems, answered with a few short steps then ``Answer: N``."""

from __future__ import annotations

import random
import re

from quicksilver.tasks.base import Example, Split, Task, check_split, history_turns, pick, system_turn, user_turn

_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*(-?\d+)", re.I)
_INT = re.compile(r"-?\d+")


def final_integer(text: str) -> int | None:
    """The integer after the last 'Answer:' marker, or else the last integer in the text."""
    marked = _ANSWER.findall(text)
    if marked:
        return int(marked[-1])
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def worked_sum(a: int, b: int) -> str:
    """``a + b`` worked column by column for two non-negative numbers below 100: "46 + 48: ones 6 + 8 = 14,
    carry 1; tens 4 + 4 + 1 = 9; sum 94."

    Why: numbers are BPE chunks here ("139" is " 13" + "9"), so a one-line "a + b = c" asks the model to recall
    one of ~10,000 sums; the session-33 default and twin got 0 and 2 of 27 held-out ones right. Column by column,
    each step is a one-digit fact (a hundred of them) and the sum is the tens result followed by the ones digit."""
    if not (0 <= a < 100 and 0 <= b < 100):
        raise ValueError(f"worked_sum takes numbers 0..99, got {a} and {b}")
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    tens_step = f"{a // 10} + {b // 10} + 1 = {tens}" if carry else f"{a // 10} + {b // 10} = {tens}"
    carry_note = f", carry {carry}" if carry else ""
    return f"{a} + {b}: ones {a % 10} + {b % 10} = {ones}{carry_note}; tens {tens_step}; sum {a + b}."


def _verify_int(example: Example, output: str) -> bool:
    from quicksilver.tasks.base import clean_output

    return final_integer(clean_output(output)) == example.answer


_EXPR_ASKS = (
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e}",
    "{e} = ?",
    "Work out {e}.",
    "Please evaluate {e}.",
    "How much is {e}?",
    "Evaluate {e}",
    "Can you solve {e} for me?",
    "What does {e} equal?",
    "Find the value of {e}.",
    "quick math: {e}",
    "Solve: {e}",
    "I need the result of {e}.",
    "Give me {e}.",
    "what's {e}",
)

_MATH_SYSTEMS = (
    "You are a math tutor. Show short steps, then the answer.",
    "Solve arithmetic step by step and finish with 'Answer: <number>'.",
    "You are a calculator that explains its steps briefly.",
    "Show your working in a few steps.",
)


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class Arithmetic(Task):
    name = "arithmetic"
    description = "integer expressions with + - * and parentheses, answered step by step"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        n_ops = rng.choice((1, 2, 2, 3))
        nums = [rng.randint(2, 99) for _ in range(n_ops + 1)]
        ops = [rng.choice("+-*") for _ in range(n_ops)]
        # keep products small so every step stays short
        for i, op in enumerate(ops):
            if op == "*":
                nums[i + 1] = rng.randint(2, 12)
        expr = str(nums[0])
        value = nums[0]
        steps = []
        for op, b in zip(ops, nums[1:], strict=True):
            new = _apply(op, value, b)
            steps.append(f"{value} {op} {b} = {new}")
            # left-to-right evaluation: a product of a compound prefix needs parentheses
            expr = f"({expr}) {op} {b}" if op == "*" and " " in expr else f"{expr} {op} {b}"
            value = new
        ask = pick(rng, _EXPR_ASKS, split).format(e=expr)
        answer = "\n".join(steps) + f"\nAnswer: {value}" if len(steps) > 1 else f"{steps[0]}\nAnswer: {value}"
        messages = system_turn(rng, split, _MATH_SYSTEMS) + history_turns(rng, split)
        messages.append(user_turn(rng, split, ask))
        return Example(self.name, messages, {"role": "assistant", "content": answer}, value)

    def verify(self, example: Example, output: str) -> bool:
        return _verify_int(example, output)


# Word problems: (story template, steps) built from small pieces. Each story names the quantities so
# the solution can be written as explicit steps.
_NAMES = ("Sam", "Mia", "Ravi", "Lena", "Omar", "Zoe", "Ken", "Ana", "Tom", "Ivy", "Luis", "Nora", "Eli", "Ada")
_ITEMS = ("apples", "books", "stickers", "marbles", "coins", "pencils", "cookies", "stamps", "cards", "shells")


def _story_buy_give(rng: random.Random) -> tuple[str, list[str], int, str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    c = rng.randint(1, a + b - 1)
    text = f"{name} has {a} {item}. {name} gets {b} more and then gives away {c}."
    return text, [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"], a + b - c, name, item


def _story_boxes(rng: random.Random) -> tuple[str, list[str], int, str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    boxes, per, extra = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 30)
    text = f"{name} buys {boxes} boxes with {per} {item} in each box, and already had {extra} {item}."
    steps = [f"{boxes} * {per} = {boxes * per}", f"{boxes * per} + {extra} = {boxes * per + extra}"]
    return text, steps, boxes * per + extra, name, item


def _story_share(rng: random.Random) -> tuple[str, list[str], int, str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    friends, each = rng.randint(2, 8), rng.randint(2, 12)
    keep = rng.randint(1, 20)
    total = friends * each + keep
    text = f"{name} had {total} {item}, kept {keep} and shared the rest equally among {friends} friends."
    return text, [f"{total} - {keep} = {total - keep}", f"{total - keep} / {friends} = {each}"], each, name, item


def _story_price(rng: random.Random) -> tuple[str, list[str], int, str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    n, price = rng.randint(2, 9), rng.randint(2, 15)
    paid = n * price + rng.randint(0, 40)
    change = paid - n * price
    text = f"{name} buys {n} {item} at {price} dollars each and pays with {paid} dollars."
    return text, [f"{n} * {price} = {n * price}", f"{paid} - {n * price} = {change}"], change, name, item


def _story_three(rng: random.Random) -> tuple[str, list[str], int, str, str]:
    a_name, b_name = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, more, less = rng.randint(3, 40), rng.randint(2, 20), rng.randint(1, 10)
    b = a + more
    text = f"{a_name} has {a} {item}. {b_name} has {more} more than {a_name}. Then {b_name} loses {less}."
    return text, [f"{a} + {more} = {b}", f"{b} - {less} = {b - less}"], b - less, b_name, item


_STORIES = (_story_buy_give, _story_boxes, _story_share, _story_price, _story_three)
_QUESTIONS = {
    _story_buy_give: ("How many {item} does {name} have now?", "How many {item} are left?"),
    _story_boxes: ("How many {item} does {name} have in total?", "What is the total number of {item}?"),
    _story_share: ("How many {item} does each friend get?", "How many {item} per friend?"),
    _story_price: ("How much change does {name} get?", "How many dollars come back as change?"),
    _story_three: ("How many {item} does {name} have now?", "How many {item} does {name} end with?"),
}
_WP_FRAMES = (
    "{story} {q}",
    "Word problem: {story} {q}",
    "{story}\n{q} Show your steps.",
    "Solve this: {story} {q}",
    "Here is a puzzle for you. {story} {q}",
    "{q} Context: {story}",
    "Help me with my homework. {story} {q}",
    "{story} {q} Think step by step.",
    "My kid asked me this: {story} {q}",
    "{story} So, {q}",
    "Math question. {story} {q} Explain briefly.",
    "Riddle me this: {story} {q}",
)


class WordProblem(Task):
    name = "word_problem"
    description = "two-step word problems with short reasoning and a final integer"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        story_fn = rng.choice(_STORIES)
        story, steps, value, name, item = story_fn(rng)
        q = rng.choice(_QUESTIONS[story_fn]).format(name=name, item=item)
        ask = pick(rng, _WP_FRAMES, split).format(story=story, q=q)
        answer = "\n".join(steps) + f"\nAnswer: {value}"
        messages = system_turn(rng, split, _MATH_SYSTEMS) + history_turns(rng, split)
        messages.append(user_turn(rng, split, ask))
        return Example(self.name, messages, {"role": "assistant", "content": answer}, value)

    def verify(self, example: Example, output: str) -> bool:
        return _verify_int(example, output)
