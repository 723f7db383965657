"""Agent steps: one turn of an episode with the agent's own tools (``quicksilver.agent``), so the model learns
the loop it runs in: call a tool with the right arguments, read the observation, answer from it.

Each example is an episode cut at one assistant turn: the context holds the task and every earlier call with its
observation, and the target is the next turn, either the next tool call or the final answer. The tools are
offered with exactly the schemas the agent sends, and the observations are what the tools return (the calculator
is run; the file, search and Python observations use the tools' output formats).

Graded exactly: a call must name the right tool with arguments that mean the same (the calculator's expression
must evaluate to the reference value; a search query must name the thing asked about; Python code is run and
must print the reference value); a final answer must state the key value and call nothing.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from quicksilver.rag.chat import format_sources
from quicksilver.tasks.base import Example, Split, Task, check_split, clean_output, pick, system_turn, user_turn
from quicksilver.tasks.retrieval import _FACTS, NOT_FOUND_ANSWERS, _entity, _facts, is_not_found
from quicksilver.tasks.tool_use import mentions, parse_tool_calls
from quicksilver.tokenizer import TOOL_CALLS


def tool_schema(name: str) -> dict[str, Any]:
    """The OpenAI schema the agent offers for tool ``name`` (without needing a folder or an index)."""
    from quicksilver.agent import tools as agent_tools

    if name == "calculator":
        return agent_tools.calculator_tool().spec()
    if name == "run_python":
        return agent_tools.python_tool().spec()
    if name == "search_documents":
        from quicksilver.rag.chat import SEARCH_TOOL

        return SEARCH_TOOL
    description = {"read_file": agent_tools.READ_FILE_DESCRIPTION, "list_files": agent_tools.LIST_FILES_DESCRIPTION}
    return {"type": "function",
            "function": {"name": name, "description": description[name], "parameters": agent_tools.PATH_SCHEMA}}


@dataclass
class Episode:
    ask: str  # the user's task
    tools: list[str]  # tool names offered
    steps: list[tuple[dict[str, Any], str]]  # (call {"name", "arguments"}, observation) in order
    answer_text: str  # the final answer
    key: str | None  # the value the final answer must state (None: a "not in the documents" answer)


# ------------------------------------------------------------------------------------------- calculator
_CALC_ASKS = (
    "What is {expr}? Use the calculator.",
    "Calculate {expr}.",
    "Compute {expr} with the calculator tool.",
    "Work out {expr}.",
    "I need the value of {expr}.",
    "Use the calculator: {expr}",
    "How much is {expr}?",
    "Evaluate {expr} for me.",
    "Please find {expr} using the calculator tool.",
    "What does {expr} come to?",
    "Can you calculate {expr}?",
    "Get me the result of {expr}.",
)
_CALC_ANSWERS = ("{expr} = {v}.", "The result is {v}.", "{v}", "It comes to {v}.", "The answer is {v}.")


def _expression(rng: random.Random) -> str:
    kind = rng.randrange(6)
    a, b, c = rng.randint(12, 9999), rng.randint(2, 999), rng.randint(2, 60)
    if kind == 0:
        return f"{a} * {b}"
    if kind == 1:
        return f"{a} + {b} + {c}"
    if kind == 2:
        return f"{a} - {b}"
    if kind == 3:
        return f"({a} + {b}) * {c}"
    if kind == 4:
        return f"{b * c} / {c}"
    return f"{c} ** {rng.randint(2, 4)}"


def calculate(expression: str) -> str:
    """What the agent's calculator tool returns for ``expression``."""
    from quicksilver.agent.tools import calculator_tool

    return calculator_tool()({"expression": expression})


def _calculator_episode(rng: random.Random, split: Split) -> Episode:
    expr = _expression(rng)
    value = calculate(expr)
    return Episode(pick(rng, _CALC_ASKS, split).format(expr=expr), ["calculator"],
                   [({"name": "calculator", "arguments": {"expression": expr}}, value)],
                   rng.choice(_CALC_ANSWERS).format(expr=expr, v=value), value)


# ------------------------------------------------------------------------------------------- files
_FILE_THEMES = (  # (file names, unit, items)
    (("warehouse_count.txt", "stock.txt", "inventory.txt", "depot_stock.md"), "crates",
     ("apples", "pears", "plums", "cherries", "lemons", "melons")),
    (("garden_log.txt", "plants.md", "allotment.txt"), "plants", ("tomatoes", "beans", "peppers", "leeks", "kale")),
    (("parts_list.txt", "workshop.txt", "hardware.md"), "boxes", ("bolts", "screws", "washers", "nails", "hinges")),
    (("library_shelf.txt", "books.md", "reading_room.txt"), "books", ("novels", "atlases", "poems", "comics")),
    (("pantry.txt", "kitchen_stock.md", "larder.txt"), "jars", ("honey", "jam", "pickles", "olives", "mustard")),
)
_FILE_ASKS = (
    "How many {unit} of {item} are there? The count is in {file}.",
    "Read {file} and tell me how many {unit} of {item} it lists.",
    "Open {file}: how many {unit} of {item}?",
    "Check {file} for the number of {unit} of {item}.",
    "According to {file}, how many {unit} of {item} do we have?",
    "What count of {item} is recorded in {file}?",
    "Look in {file} and find how many {unit} of {item} there are.",
    "The file {file} has a stock count. How many {unit} of {item}?",
)
_FILE_ANSWERS = ("There are {v} {unit} of {item}.", "{v} {unit}.", "{file} lists {v} {unit} of {item}.", "{v}")
_TITLES = ("count of", "stock taken on", "checked on", "list of")
_MONTHS = ("January", "March", "May", "July", "September", "November")


def _file_episode(rng: random.Random, split: Split) -> Episode:
    names, unit, items = rng.choice(_FILE_THEMES)
    file = rng.choice(names)
    listed = rng.sample(items, rng.randint(2, min(4, len(items))))
    counts = {i: rng.randint(2, 400) for i in listed}
    title = f"{file.split('.')[0].replace('_', ' ').capitalize()}, {rng.choice(_TITLES)} {rng.randint(1, 28)} " \
            f"{rng.choice(_MONTHS)}"
    content = title + "\n" + "\n".join(f"{i}: {n} {unit}" for i, n in counts.items()) + "\n"
    item = rng.choice(listed)
    value = str(counts[item])
    ask = pick(rng, _FILE_ASKS, split).format(unit=unit, item=item, file=file)
    text = rng.choice(_FILE_ANSWERS).format(v=value, unit=unit, item=item, file=file)
    return Episode(ask, ["read_file"], [({"name": "read_file", "arguments": {"path": file}}, content)], text, value)


# ------------------------------------------------------------------------------------------- search
_SEARCH_ASKS = (
    "According to the documents, {q}",
    "Search the documents: {q}",
    "Look it up in the documents. {q}",
    "Use the document search to answer: {q}",
    "{q} Check the documents.",
    "Find out from the documents: {q}",
    "From the indexed documents, {q}",
    "{q} Search the notes for it.",
)
_SEARCH_ANSWERS = ("{a}.", "The answer is {a}.", "According to the documents, {a}.", "{a}")
_QUERY_WORDS = {"river": "river", "founded": "founded", "population": "population", "food": "food",
                "founder": "founder", "flag": "flag"}
_EXTENSIONS = (".md", ".txt", ".html")


def _search_episode(rng: random.Random, split: Split) -> Episode:
    entity = _entity(rng)
    facts = _facts(rng)
    keys = rng.sample(sorted(_FACTS), 3)
    answerable = rng.random() < 0.85
    key = rng.choice(keys) if answerable else rng.choice([k for k in sorted(_FACTS) if k not in keys])
    passage = " ".join(_FACTS[k][0].format(e=entity, **facts) for k in keys)
    hits = [(entity.lower() + rng.choice(_EXTENSIONS), passage)]
    if rng.random() < 0.25:  # a second, unrelated hit
        other = _entity(rng)
        other_facts = _facts(rng)
        hits.append((other.lower() + rng.choice(_EXTENSIONS),
                     " ".join(_FACTS[k][0].format(e=other, **other_facts) for k in rng.sample(sorted(_FACTS), 2))))
        rng.shuffle(hits)
    # the search tool's own formatting, so the observation is what the agent sees
    observation = format_sources([{"id": i, "path": name, "lines": [1, rng.randint(2, 9)], "text": text}
                                  for i, (name, text) in enumerate(hits, 1)])
    q = pick(rng, _FACTS[key][1], split).format(e=entity)
    template = pick(rng, _SEARCH_ASKS, split)
    ask = template.format(q=q if template.startswith("{q}") else q[0].lower() + q[1:])
    query = f"{entity} {_QUERY_WORDS[key]}"
    call = {"name": "search_documents", "arguments": {"query": query}}
    if answerable:
        value = facts[key]
        return Episode(ask, ["search_documents"], [(call, observation)],
                       rng.choice(_SEARCH_ANSWERS).format(a=value), value)
    return Episode(ask, ["search_documents"], [(call, observation)], rng.choice(NOT_FOUND_ANSWERS), None)


# ------------------------------------------------------------------------------------------- python
def _is_prime(k: int) -> bool:
    return k > 1 and all(k % d for d in range(2, math.isqrt(k) + 1))


def _fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


# (asks, code template, value function, range of n)
_PYTHON_JOBS: tuple[tuple[tuple[str, ...], str, Any, tuple[int, int]], ...] = (
    (("Use Python to count the primes below {n}.", "How many prime numbers are smaller than {n}? Run Python.",
      "Write and run Python that counts the primes under {n}.", "Count the primes less than {n} with Python."),
     "print(sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) for k in range(2, {n})))",
     lambda n: sum(_is_prime(k) for k in range(2, n)), (20, 5000)),
    (("Use Python to add up the integers from 1 to {n}.", "Run Python to get the sum 1 + 2 + ... + {n}.",
      "What is the sum of all whole numbers from 1 to {n}? Use Python.", "Sum 1 to {n} in Python."),
     "print(sum(range(1, {n} + 1)))", lambda n: n * (n + 1) // 2, (10, 100000)),
    (("Use Python to compute the factorial of {n}.", "Run Python and print {n} factorial.",
      "What is {n}!? Compute it in Python.", "Factorial of {n}, please, with Python."),
     "import math\nprint(math.factorial({n}))", math.factorial, (3, 20)),
    (("Use Python to find how many digits 2 ** {n} has.", "How many digits are in 2 to the power {n}? Use Python.",
      "Run Python: count the digits of 2 ** {n}.", "Number of decimal digits of 2 ** {n}? Run code."),
     "print(len(str(2 ** {n})))", lambda n: len(str(2**n)), (10, 3000)),
    (("Use Python to get Fibonacci number {n} (F(0) = 0).", "Compute F({n}) of the Fibonacci sequence with Python.",
      "Run Python to find the {n}th Fibonacci number, starting from F(0) = 0.",
      "Fibonacci number {n} (F(0) = 0)? Use code."),
     "a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, a + b\nprint(a)", _fibonacci, (5, 60)),
    (("Use Python to add up the squares from 1 to {n}.", "Sum of k * k for k from 1 to {n}? Run Python.",
      "Run Python to compute 1^2 + 2^2 + ... + {n}^2.", "Compute the sum of squares up to {n} in Python."),
     "print(sum(k * k for k in range(1, {n} + 1)))", lambda n: n * (n + 1) * (2 * n + 1) // 6, (5, 2000)),
)
_PYTHON_ANSWERS = ("The program printed {v}.", "{v}", "The answer is {v}.", "It is {v}.")


def _python_episode(rng: random.Random, split: Split) -> Episode:
    asks, code, value_of, (lo, hi) = rng.choice(_PYTHON_JOBS)
    n = rng.randint(lo, hi)
    value = str(value_of(n))
    observation = f"exit status 0\nstdout:\n{value}\n"
    return Episode(pick(rng, asks, split).format(n=n), ["run_python"],
                   [({"name": "run_python", "arguments": {"code": code.format(n=n)}}, observation)],
                   rng.choice(_PYTHON_ANSWERS).format(v=value), value)


_AGENT_SYSTEMS = (
    "You can use tools. Call one when you need it, then answer.",
    "Use the tools to solve the task, then give the final answer.",
    "You are an agent with tools. Answer once you have what you need.",
    "Solve tasks with tools when needed.",
)


class AgentStep(Task):
    name = "agent_step"
    description = "the next turn of an agent episode with the agent's tools: the right call, or the final answer"
    episodes = (_calculator_episode, _file_episode, _search_episode, _python_episode)

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        from quicksilver.agent.loop import SYSTEM_PROMPT

        episode = rng.choice(self.episodes)(rng, split)
        if rng.random() < 0.5:  # the prompt the agent itself sends
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        else:
            messages = system_turn(rng, split, _AGENT_SYSTEMS, p_none=0.3)
        messages.append(user_turn(rng, split, episode.ask))
        cut = rng.randint(0, len(episode.steps))  # which assistant turn is the target
        for call, observation in episode.steps[:cut]:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append({"role": "tool", "content": observation})
        tools = [tool_schema(n) for n in episode.tools]
        if cut < len(episode.steps):
            call = episode.steps[cut][0]
            target = {"role": "assistant", "content": "", "tool_calls": [call]}
            answer: dict[str, Any] = {"call": call, "value": episode.steps[cut][1]}
        else:
            target = {"role": "assistant", "content": episode.answer_text}
            answer = {"final": episode.key}
        return Example(self.name, messages, target, answer, tools)

    def verify(self, example: Example, output: str) -> bool:
        text = clean_output(output)
        if "final" in example.answer:
            if TOOL_CALLS in text:
                return False
            key = example.answer["final"]
            return is_not_found(text) if key is None else mentions(text, key) and not is_not_found(text)
        calls = parse_tool_calls(text)
        if not calls or len(calls) != 1 or not isinstance(calls[0].get("arguments"), dict):
            return False
        return same_call(calls[0], example.answer["call"], example.answer["value"])


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def same_call(call: dict[str, Any], reference: dict[str, Any], observation: str) -> bool:
    """Does ``call`` do what ``reference`` does? Arguments are compared by meaning where text may differ."""
    name, args, want = call.get("name"), call["arguments"], reference["arguments"]
    if name != reference["name"]:
        return False
    if name == "calculator":
        # the same value from the task's own operands: a call that only writes the result (or a number it made
        # up) does not use the tool
        expression = args.get("expression")
        if not isinstance(expression, str) or calculate(expression) != observation:
            return False
        used = Counter(_NUMBER.findall(expression))
        return all(used[n] >= k for n, k in Counter(_NUMBER.findall(want["expression"])).items())
    if name == "search_documents":
        # the query must name the entity: every capitalised word of the reference query (its proper name)
        query = args.get("query")
        names = [w for w in want["query"].split() if w[:1].isupper()]
        return isinstance(query, str) and all(re.search(rf"\b{re.escape(w)}\b", query, re.I) for w in names)
    if name == "run_python":
        from quicksilver.agent.tools import run_python

        code = args.get("code")
        return isinstance(code, str) and run_python(code, timeout=10.0).strip() == observation.strip()
    return json.dumps(args, sort_keys=True) == json.dumps(want, sort_keys=True)
