"""Open agent steps: the agent's tools with arguments that must be copied, and episodes that chain two tools.

``agent_step`` draws its arguments from small closed sets (five themes of file names, operands below 10,000,
search topics from six retrieval facts), so a small model can score there by recalling a set member instead of
copying from the task. On tasks outside those sets (``examples/agent_tasks.json``) the shipped models invented
file names ("parts_list.txt" for "stock_note.txt") and search entities. Here every argument comes from an open
set and has to be read off the task or an earlier observation:

* calculator: operands of 1 to 6 digits, written with symbols or words ("times", "divided by");
* read_file: file names made of words and made-up syllables, stock lists in several layouts;
* search_documents: documents about made-up places and buildings with several numeric facts each; the query
  must name the whole entity;
* chains: look a number up (search or file), then call the calculator with it, then answer with the result.

The graders are ``agent_step``'s: a call must name the right tool with arguments that mean the same, a final
answer must state the value and call nothing.
"""

from __future__ import annotations

import random
import re
import textwrap
from typing import Any

from quicksilver.rag.chat import format_sources
from quicksilver.tasks.agent_steps import AgentStep, Episode, calculate
from quicksilver.tasks.base import Split, pick
from quicksilver.tasks.retrieval import NOT_FOUND_ANSWERS

_SYLLABLES = ("ar", "bel", "cor", "dan", "ed", "fen", "gar", "hol", "is", "jor", "kes", "lan", "mor", "nes", "ol",
              "pen", "quin", "ros", "sal", "tal", "ul", "ven", "wick", "yar", "zel", "brin", "cal", "dre", "hart",
              "lis", "mar", "tor", "vik", "ston", "ley", "ham", "rid", "bourne")


def made_up_word(rng: random.Random, parts: tuple[int, ...] = (2, 3)) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice(parts)))


# ------------------------------------------------------------------------------------------- calculator
# how a task writes each operator; every fourth is held out for the eval split, like the other phrasings
_OP_WORDS = {"*": ("times", "*", "multiplied by", "×"), "+": ("plus", "+", "added to", "together with"),
             "-": ("minus", "-", "less", "take away"), "/": ("divided by", "/", "over", "÷")}
_CALC_ASKS = (
    "What is {text}? Use the calculator.",
    "Use the calculator to work out {text}.",
    "Calculate {text} with the calculator tool.",
    "What do you get for {text}?",
    "Find the value of {text}.",
    "How much is {text}? Use the tool.",
    "Please compute {text}.",
    "I need {text} worked out.",
    "{text} = ? Use the calculator.",
    "Could you evaluate {text} for me?",
    "Tell me what {text} equals.",
    "Run {text} through the calculator.",
)
_CALC_ANSWERS = ("{text} = {v}.", "The result is {v}.", "{v}", "It is {v}.", "The answer is {v}.")


def _operand(rng: random.Random) -> int:
    return rng.randint(10 ** (d := rng.randint(1, 6)) // 10, 10**d - 1)


def _calculation(rng: random.Random, split: Split) -> tuple[str, str]:
    """(how the task writes it, the expression the calculator is given)."""
    op = rng.choice("*+-/")
    a, b = _operand(rng), _operand(rng)
    if op == "/":  # divisions that come out whole, as a task would ask them
        b = rng.randint(2, 999)
        a = b * rng.randint(2, 9999)
    word = pick(rng, _OP_WORDS[op], split)
    return f"{a} {word} {b}", f"{a} {op} {b}"


def _calculator_episode(rng: random.Random, split: Split) -> Episode:
    text, expr = _calculation(rng, split)
    value = calculate(expr)
    return Episode(pick(rng, _CALC_ASKS, split).format(text=text), ["calculator"],
                   [({"name": "calculator", "arguments": {"expression": expr}}, value)],
                   rng.choice(_CALC_ANSWERS).format(text=text, v=value), value)


# ------------------------------------------------------------------------------------------- files
_FILE_WORDS = ("stock", "note", "count", "list", "log", "shed", "barn", "store", "depot", "cellar", "shelf", "order",
               "audit", "tally", "supply", "yard", "kiosk", "pantry", "van", "week", "friday", "north", "back", "old")
_EXTENSIONS = (".txt", ".md", ".csv", ".log", ".txt")
_UNITS = ("crates", "boxes", "jars", "bags", "packs", "bottles", "rolls", "sacks", "tins", "trays", "cases")
_ITEMS = ("apples", "pears", "plums", "lemons", "onions", "carrots", "potatoes", "bolts", "screws", "nails",
          "hinges", "candles", "matches", "batteries", "envelopes", "pencils", "notebooks", "soap", "rice", "flour",
          "sugar", "beans", "lentils", "oats", "tea", "coffee", "honey", "olives", "gloves", "towels", "bulbs",
          "fuses", "tape", "glue", "paint", "seeds", "nuts", "raisins", "salt", "vinegar")
_FILE_ASKS = (
    "How many {unit} of {item} does {file} list?",
    "Read {file}: how many {unit} of {item} are there?",
    "Look up the {item} in {file}. How many {unit}?",
    "The file {file} has the counts. How many {unit} of {item}?",
    "Open {file} and tell me the number of {unit} of {item}.",
    "What is the count of {item} in {file}?",
    "Check {file}: how many {item} do we have?",
    "Find the number of {unit} of {item} recorded in {file}.",
)
_FILE_ANSWERS = ("There are {v} {unit} of {item}.", "{v} {unit}.", "{file} lists {v} {unit} of {item}.", "{v}")


_MONTHS = ("January", "February", "April", "June", "August", "October", "December")


def _file_name(rng: random.Random) -> str:
    words = [rng.choice(_FILE_WORDS) if rng.random() < 0.6 else made_up_word(rng) for _ in range(rng.randint(1, 3))]
    return "_".join(words) + rng.choice(_EXTENSIONS)


def _stock_file(rng: random.Random) -> tuple[str, str, dict[str, int], str]:
    """(file name, its text, counts by item, their unit)."""
    file = _file_name(rng)
    unit = rng.choice(_UNITS)
    counts = {i: rng.randint(2, 999) for i in rng.sample(_ITEMS, rng.randint(2, 5))}
    layout = rng.randrange(4)
    if layout == 0:
        lines = [f"{i}: {n} {unit}" for i, n in counts.items()]
    elif layout == 1:
        lines = [f"- {i} - {n} {unit}" for i, n in counts.items()]
    elif layout == 2:
        lines = [f"{n} {unit} of {i}" for i, n in counts.items()]
    else:
        lines = ["item,count"] + [f"{i},{n}" for i, n in counts.items()]
    title = f"{made_up_word(rng).capitalize()} {rng.choice(('stores', 'warehouse', 'depot', 'shop', 'co-op'))}, " \
            f"{unit} counted on {rng.randint(1, 28)} {rng.choice(_MONTHS)}"
    return file, title + "\n" + "\n".join(lines) + "\n", counts, unit


def _file_episode(rng: random.Random, split: Split) -> Episode:
    file, content, counts, unit = _stock_file(rng)
    item = rng.choice(sorted(counts))
    value = str(counts[item])
    ask = pick(rng, _FILE_ASKS, split).format(unit=unit, item=item, file=file)
    text = rng.choice(_FILE_ANSWERS).format(v=value, unit=unit, item=item, file=file)
    return Episode(ask, ["read_file"], [({"name": "read_file", "arguments": {"path": file}}, content)], text, value)


# ------------------------------------------------------------------------------------------- search
_PLACE_WORDS = ("Point", "Ridge", "Hill", "Bay", "Cross", "Vale", "Moor", "Ford", "Field", "Harbour", "Marsh",
                "Head", "Green", "Water", "Gate", "Down")
_KINDS = ("Lighthouse", "Field Station", "Bridge", "Observatory", "Library", "Museum", "Mill", "Dam", "Tower",
          "Market Hall", "Station", "Hostel", "Water Tower", "School", "Boathouse", "Theatre", "Chapel", "Depot")
_COUNT_NOUNS = ("solar panels", "rooms", "seats", "beds", "steps", "windows", "boats", "telescopes", "bells",
                "turbines", "lamps", "desks", "arches", "platforms")
_PEOPLE = ("Ada Penrose", "Bram Oduya", "Clara Wendt", "Dmitri Hale", "Esme Varga", "Felix Amani", "Greta Lund",
           "Hugo Brennan", "Iris Tamm", "Jonas Reyes", "Kira Moss", "Leon Sato")
# fact key -> (sentences a document states it in, questions, the word a query adds to the entity)
_SEARCH_FACTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "built": (("{e} was built in {built}.", "Work on {e} finished in {built}.", "{e} dates from {built}."),
              ("In which year was {e} built?", "When was {e} built?", "What year was {e} finished?",
               "How old is {e}: in what year was it built?", "Which year did the builders finish {e}?",
               "Give the year {e} was built."),
              "built"),
    "height": (("{e} is {height} metres tall.", "{e} rises {height} metres.", "The height of {e} is {height} metres."),
               ("How tall is {e}?", "What is the height of {e}?", "How many metres high is {e}?",
                "How high does {e} rise?", "Give the height of {e} in metres.", "What height is {e}?"),
               "height"),
    "count": (("{e} has {count} {noun}.", "There are {count} {noun} at {e}.", "{e} counts {count} {noun}."),
              ("How many {noun} does {e} have?", "What is the number of {noun} at {e}?",
               "How many {noun} are there at {e}?", "Count the {noun} of {e}: how many?",
               "Tell me how many {noun} {e} has.", "What number of {noun} does {e} have?"),
              "{noun}"),
    "designer": (("{e} was designed by {designer}.", "The architect of {e} was {designer}.",
                  "{designer} drew the plans for {e}."),
                 ("Who designed {e}?", "Who was the architect of {e}?", "Which architect drew {e}?",
                  "Name the designer of {e}.", "Whose design is {e}?", "Who planned {e}?"),
                 "designer"),
}
_FILLER = ("It is open to visitors on weekdays.", "A small cafe stands beside the entrance.",
           "The site is run by a volunteer trust.", "Repairs were last made after a storm.",
           "Guided tours leave from the main door at ten.", "The nearest bus stop is a short walk away.")
_SEARCH_ASKS = (
    "According to the documents, {q}",
    "Search the documents: {q}",
    "{q} Look it up in the documents.",
    "Use the document search. {q}",
    "Find out from the indexed files: {q}",
    "{q} The answer is somewhere in the documents.",
    "From the notes: {q}",
    "Please search for this: {q}",
)
_SEARCH_ANSWERS = ("{a}.", "The answer is {a}.", "According to the documents, {a}.", "{a}", "It is {a}.")


def _entity_name(rng: random.Random) -> str:
    return f"{made_up_word(rng).capitalize()} {rng.choice(_PLACE_WORDS)} {rng.choice(_KINDS)}"


def _entity_facts(rng: random.Random) -> dict[str, str]:
    return {"built": str(rng.randint(1650, 2015)), "height": str(rng.randint(4, 120)),
            "count": str(rng.randint(3, 900)), "noun": rng.choice(_COUNT_NOUNS), "designer": rng.choice(_PEOPLE)}


def _document(rng: random.Random, entity: str, facts: dict[str, str], keys: list[str],
              split: Split | None = None) -> str:
    sentences = []
    for i, k in enumerate(keys):
        template = rng.choice(_SEARCH_FACTS[k][0])
        # after the first sentence, one that opens with the entity may say "It" instead
        subject = "It" if i > 0 and template.startswith("{e}") and rng.random() < 0.5 else entity
        sentences.append(template.format(e=subject, **facts))
    sentences.insert(rng.randint(1, len(sentences)), rng.choice(_FILLER))
    if split == "train" and rng.random() < 0.5:  # (train only, so the eval split's documents stay as they were)
        return _as_extracted_page(rng, entity, sentences)
    return f"# {entity}\n\n" + " ".join(sentences)


def _as_extracted_page(rng: random.Random, entity: str, sentences: list[str]) -> str:
    """The text an index holds for a web page or a wrapped text file: a bare title line, paragraphs of one or
    two sentences, lines wrapped where the source wrapped them."""
    paragraphs, i = [], 0
    while i < len(sentences):
        n = rng.choice((1, 2, 2))
        paragraphs.append(" ".join(sentences[i : i + n]))
        i += n
    width = rng.randint(60, 110)
    body = "\n\n".join(textwrap.fill(p, width) for p in paragraphs)
    return f"{entity}\n\n{body}"


def _hit(rng: random.Random, entity: str, text: str, number: int) -> dict[str, Any]:
    """One search result about ``entity``, as the search tool lists its sources (rag.chat.format_sources)."""
    slug = re.sub(r"[^a-z]+", "_", entity.lower()).strip("_")
    return {"id": number, "path": slug + rng.choice((".md", ".txt", ".html")), "lines": [1, text.count("\n") + 1],
            "text": text}


def _search_step(rng: random.Random, entity: str, facts: dict[str, str], key: str, answerable: bool = True,
                 short: bool = False, split: Split | None = None) -> tuple[dict[str, Any], str]:
    """The search call for ``key`` of ``entity`` and what the search returns (one or two hits; ``short``: one hit
    with one other fact, so that a chained episode still fits a 512-token row)."""
    others = [k for k in _SEARCH_FACTS if k != key]
    keys = ([key] if answerable else []) + rng.sample(others, 1 if short else rng.randint(1, 2))
    rng.shuffle(keys)
    hits = [(entity, _document(rng, entity, facts, keys, split))]
    if not short and rng.random() < 0.3:  # an unrelated second hit
        other = _entity_name(rng)
        hits.append((other, _document(rng, other, _entity_facts(rng), rng.sample(sorted(_SEARCH_FACTS), 2), split)))
        rng.shuffle(hits)
    observation = format_sources([_hit(rng, name, text, i) for i, (name, text) in enumerate(hits, 1)])
    query = f"{entity} {_SEARCH_FACTS[key][2].format(**facts)}"
    return {"name": "search_documents", "arguments": {"query": query}}, observation


def _search_episode(rng: random.Random, split: Split) -> Episode:
    entity, facts = _entity_name(rng), _entity_facts(rng)
    key = rng.choice(sorted(_SEARCH_FACTS))
    answerable = rng.random() < 0.9
    step = _search_step(rng, entity, facts, key, answerable, split=split)
    q = pick(rng, _SEARCH_FACTS[key][1], split).format(e=entity, **facts)
    template = pick(rng, _SEARCH_ASKS, split)
    ask = template.format(q=q if template.startswith("{q}") else q[0].lower() + q[1:])
    if not answerable:
        return Episode(ask, ["search_documents"], [step], rng.choice(NOT_FOUND_ANSWERS), None)
    value = facts[key]
    return Episode(ask, ["search_documents"], [step], rng.choice(_SEARCH_ANSWERS).format(a=value), value)


# ------------------------------------------------------------------------------------------- chains
_THEN = {"*": ("multiply it by {k}", "multiply that number by {k}", "multiply the count by {k}", "times it by {k}"),
         "+": ("add {k} to it", "add {k} to that number", "add {k} to the count", "increase it by {k}"),
         "-": ("subtract {k} from it", "take {k} away from it", "subtract {k} from the count", "reduce it by {k}")}
_CHAIN_SEARCH_ASKS = (
    "Find how many {noun} {e} has, then use the calculator to {then}.",
    "Look up the number of {noun} at {e} in the documents and {then} with the calculator.",
    "Search for how many {noun} {e} has. Then {then}.",
    "How many {noun} does {e} have? Then {then}, using the calculator.",
)
_CHAIN_FILE_ASKS = (
    "Read {file}, then use the calculator to add the {a} and the {b}.",
    "In {file}, how many {a} and {b} are there together? Use the calculator.",
    "Open {file} and add up the {a} and {b} with the calculator.",
    "What is the total of {a} plus {b} in {file}? Read it, then calculate.",
)
_CHAIN_ANSWERS = ("The result is {v}.", "{v}", "That makes {v}.", "The answer is {v}.")


def _chain_search_episode(rng: random.Random, split: Split) -> Episode:
    entity, facts = _entity_name(rng), _entity_facts(rng)
    search = _search_step(rng, entity, facts, "count", short=True, split=split)
    op = rng.choice("*+-")
    k = rng.randint(2, 999)
    expr = f"{facts['count']} {op} {k}"
    value = calculate(expr)
    then = pick(rng, _THEN[op], split).format(k=k)
    ask = pick(rng, _CHAIN_SEARCH_ASKS, split).format(noun=facts["noun"], e=entity, then=then)
    return Episode(ask, ["search_documents", "calculator"],
                   [search, ({"name": "calculator", "arguments": {"expression": expr}}, value)],
                   rng.choice(_CHAIN_ANSWERS).format(v=value), value)


def _chain_file_episode(rng: random.Random, split: Split) -> Episode:
    file, content, counts, _ = _stock_file(rng)
    a, b = rng.sample(sorted(counts), 2)
    expr = f"{counts[a]} + {counts[b]}"
    value = calculate(expr)
    ask = pick(rng, _CHAIN_FILE_ASKS, split).format(file=file, a=a, b=b)
    return Episode(ask, ["read_file", "calculator"],
                   [({"name": "read_file", "arguments": {"path": file}}, content),
                    ({"name": "calculator", "arguments": {"expression": expr}}, value)],
                   rng.choice(_CHAIN_ANSWERS).format(v=value), value)


class AgentOpen(AgentStep):
    name = "agent_open"
    description = "the next turn of an agent episode whose arguments must be copied: open-set names and numbers, " \
                  "two-tool chains"
    # outside the suite, so the suite's figures stay comparable across sessions: evaluate with --tasks agent_open
    in_suite = False
    episodes = (_calculator_episode, _file_episode, _search_episode, _chain_search_episode, _chain_file_episode)
