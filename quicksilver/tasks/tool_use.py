"""Tool use: pick the right tool from a list, fill its arguments from the request, then answer from the result.

Two graded tasks share one generator:

* ``tool_call``  — the assistant turn is ``<|tool_calls|>[{"name": ..., "arguments": {...}}]`` exactly as the
  chat template renders ``tool_calls``; graded by parsing the JSON after the marker (name + arguments exact).
* ``tool_answer`` — the conversation already holds the call and the ``tool`` turn with its JSON result; the
  assistant answers in words; graded by checking the result's key values appear in the answer.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quicksilver.tasks.arithmetic import final_integer, worked_sum
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
from quicksilver.tokenizer import TOOL_CALLS

CITIES = (
    "Paris",
    "Tokyo",
    "Berlin",
    "Lima",
    "Cairo",
    "Oslo",
    "Madrid",
    "Toronto",
    "Sydney",
    "Nairobi",
    "Denver",
    "Seoul",
    "Dublin",
    "Rome",
    "Boston",
    "Mumbai",
    "Lisbon",
    "Prague",
    "Austin",
    "Quito",
    "Hanoi",
    "Vienna",
)
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "INR", "AUD", "SEK", "MXN")
SYMBOLS = ("AAPL", "MSFT", "GOOG", "AMZN", "TSLA", "NVDA", "IBM", "ORCL", "INTC", "META", "NFLX", "SAP")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear")
PEOPLE = ("alice", "bob", "carol", "dan", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar")
DOMAINS = ("example.com", "mail.org", "work.net", "acme.io")
SUBJECTS = (
    "Budget review",
    "Lunch on Friday",
    "Project update",
    "Meeting notes",
    "Holiday plans",
    "Invoice 42",
    "Team dinner",
    "Quarterly report",
    "Welcome aboard",
    "Server outage",
    "New schedule",
    "Thank you",
)
LANGUAGES = ("Spanish", "French", "German", "Italian", "Japanese", "Portuguese", "Dutch", "Korean")
PHRASES = (
    "good morning",
    "thank you very much",
    "where is the station",
    "I love this city",
    "see you tomorrow",
    "how much does it cost",
    "the weather is nice",
    "happy birthday",
    "I am hungry",
    "good night",
)
TASKS_TODO = (
    "call mom",
    "buy milk",
    "water the plants",
    "send the report",
    "book a dentist appointment",
    "pay the rent",
    "walk the dog",
    "take my medicine",
    "check the oven",
    "renew my passport",
)
RESTAURANTS = ("Luigi", "The Green Fork", "Sakura", "Casa Blanca", "Blue Door", "Spice Route", "Le Petit")
WORDS = ("ephemeral", "ubiquitous", "serendipity", "laconic", "gregarious", "pragmatic", "meticulous", "verbose")
DEFINITIONS = {
    "ephemeral": "lasting a very short time",
    "ubiquitous": "present everywhere",
    "serendipity": "a happy accident",
    "laconic": "using very few words",
    "gregarious": "fond of company",
    "pragmatic": "dealing with things sensibly",
    "meticulous": "very careful and precise",
    "verbose": "using more words than needed",
}


def _clock(rng: random.Random) -> str:
    return f"{rng.randint(6, 21):02d}:{rng.choice((0, 15, 30, 45)):02d}"


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    properties: dict[str, dict[str, Any]]
    required: tuple[str, ...]
    make_args: Callable[[random.Random], dict[str, Any]]  # arguments in schema order
    asks: tuple[str, ...]  # user phrasings, formatted with the arguments
    make_result: Callable[[random.Random, dict[str, Any]], dict[str, Any]]
    answers: tuple[str, ...]  # final-answer phrasings, formatted with arguments + result
    key_fields: tuple[str, ...]  # result fields the final answer must state

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {"type": "object", "properties": self.properties, "required": list(self.required)},
            },
        }


def _weather_args(rng: random.Random) -> dict[str, Any]:
    args: dict[str, Any] = {"city": rng.choice(CITIES)}
    if rng.random() < 0.3:
        args["unit"] = rng.choice(("celsius", "fahrenheit"))
    return args


def _unit_text(args: dict[str, Any]) -> str:
    return f" in {args['unit']}" if "unit" in args else ""


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "get_weather",
        "Current weather for a city",
        {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ("city",),
        _weather_args,
        (
            "What's the weather in {city}{unit_text}?",
            "How warm is it in {city} right now{unit_text}?",
            "Weather for {city}{unit_text}, please.",
            "Tell me the current weather in {city}{unit_text}.",
            "Is it cold in {city} today{unit_text}?",
            "Check the weather in {city}{unit_text}.",
            "I am flying to {city}. What is the weather there{unit_text}?",
            "Need the {city} weather{unit_text}.",
            "weather {city}{unit_text}",
            "Could you look up today's weather for {city}{unit_text}?",
            "How is the weather looking in {city}{unit_text}?",
            "Do I need a jacket in {city}? Check the weather{unit_text}.",
        ),
        lambda rng, a: {"city": a["city"], "temperature": rng.randint(-5, 35), "condition": rng.choice(CONDITIONS)},
        (
            "It is {temperature} degrees and {condition} in {city}.",
            "{city}: {temperature} degrees, {condition}.",
            "Right now {city} is {condition} at {temperature} degrees.",
        ),
        ("temperature", "condition"),
    ),
    ToolSpec(
        "convert_currency",
        "Convert an amount between currencies",
        {"amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
        ("amount", "from_currency", "to_currency"),
        lambda rng: dict(
            zip(
                ("amount", "from_currency", "to_currency"),
                (rng.choice((rng.randint(1, 999), rng.randint(1, 9999))), *rng.sample(CURRENCIES, 2)),
                strict=True,
            )
        ),
        (
            "How much is {amount} {from_currency} in {to_currency}?",
            "Convert {amount} {from_currency} to {to_currency}.",
            "{amount} {from_currency} to {to_currency} please",
            "What do {amount} {from_currency} come to in {to_currency}?",
            "I have {amount} {from_currency}. How many {to_currency} is that?",
            "Change {amount} {from_currency} into {to_currency}.",
            "exchange {amount} {from_currency} -> {to_currency}",
            "What is {amount} {from_currency} worth in {to_currency}?",
        ),
        lambda rng, a: {"result": round(a["amount"] * rng.uniform(0.2, 5), 2), "currency": a["to_currency"]},
        (
            "{amount} {from_currency} is {result} {to_currency}.",
            "That comes to {result} {to_currency}.",
            "You would get {result} {to_currency}.",
        ),
        ("result",),
    ),
    ToolSpec(
        "set_timer",
        "Start a countdown timer",
        {"minutes": {"type": "integer"}},
        ("minutes",),
        lambda rng: {"minutes": rng.choice((rng.randint(1, 15), rng.randint(16, 120)))},
        (
            "Set a timer for {minutes} minutes.",
            "Timer, {minutes} minutes.",
            "Start a {minutes} minute timer.",
            "Can you time {minutes} minutes for me?",
            "Please count down {minutes} minutes.",
            "I need a timer of {minutes} minutes.",
            "Remind me when {minutes} minutes have passed.",
            "Set an alarm to go off in {minutes} minutes.",
        ),
        lambda rng, a: {"status": "started", "minutes": a["minutes"]},
        (
            "Your {minutes} minute timer has started.",
            "Done, timer set for {minutes} minutes.",
            "The timer is running: {minutes} minutes.",
        ),
        ("minutes",),
    ),
    ToolSpec(
        "send_email",
        "Send an email",
        {"to": {"type": "string"}, "subject": {"type": "string"}},
        ("to", "subject"),
        lambda rng: {"to": f"{rng.choice(PEOPLE)}@{rng.choice(DOMAINS)}", "subject": rng.choice(SUBJECTS)},
        (
            "Send an email to {to} with the subject {subject}.",
            "Email {to}, subject: {subject}",
            "Write to {to}. Subject line: {subject}",
            "Please send {to} an email titled {subject}",
            "Could you email {to}? Use the subject {subject}",
            "Mail {to} with subject {subject}",
            "Drop {to} an email, subject {subject}",
            "New email to {to}, subject {subject}",
        ),
        lambda rng, a: {"status": "sent", "id": rng.randint(1000, 9999)},
        ("Email sent to {to}.", "Done, your email to {to} was sent.", "I sent the email to {to}."),
        ("status",),
    ),
    ToolSpec(
        "get_stock_price",
        "Latest stock price for a ticker symbol",
        {"symbol": {"type": "string"}},
        ("symbol",),
        lambda rng: {"symbol": rng.choice(SYMBOLS)},
        (
            "What is {symbol} trading at?",
            "Stock price of {symbol}?",
            "How much is one {symbol} share now?",
            "Check the {symbol} stock price.",
            "Give me the latest price for {symbol}.",
            "{symbol} quote please",
            "Where is {symbol} trading today?",
            "Look up the share price of {symbol}.",
        ),
        lambda rng, a: {"symbol": a["symbol"], "price": round(rng.uniform(5, 900), 2)},
        ("{symbol} is at {price} dollars.", "One {symbol} share costs {price} dollars.", "{symbol}: {price} USD."),
        ("price",),
    ),
    ToolSpec(
        "translate",
        "Translate text into another language",
        {"text": {"type": "string"}, "target_language": {"type": "string"}},
        ("text", "target_language"),
        lambda rng: {"text": rng.choice(PHRASES), "target_language": rng.choice(LANGUAGES)},
        (
            "Translate {text} into {target_language}.",
            "How do you say {text} in {target_language}?",
            "{target_language} for: {text}",
            "Please translate this to {target_language}: {text}",
            "What is {text} in {target_language}?",
            "Say {text} in {target_language}.",
            "Can you put {text} into {target_language}?",
            "I need {text} translated to {target_language}.",
        ),
        lambda rng, a: {"translation": f"[{a['target_language'][:2].lower()}] {a['text']}"},
        ("In {target_language}: {translation}", "The translation is {translation}.", "{translation}"),
        ("translation",),
    ),
    ToolSpec(
        "create_reminder",
        "Create a reminder at a time (HH:MM)",
        {"task": {"type": "string"}, "time": {"type": "string"}},
        ("task", "time"),
        lambda rng: {"task": rng.choice(TASKS_TODO), "time": _clock(rng)},
        (
            "Remind me to {task} at {time}.",
            "Set a reminder at {time} to {task}.",
            "At {time}, remind me to {task}.",
            "Can you remind me to {task} at {time}?",
            "Reminder: {task} at {time}",
            "Don't let me forget to {task} at {time}.",
            "Please add a reminder to {task} for {time}.",
            "I have to {task} at {time}, remind me.",
        ),
        lambda rng, a: {"status": "created", "time": a["time"]},
        ("I will remind you to {task} at {time}.", "Reminder set for {time}.", "OK, reminder at {time} to {task}."),
        ("time",),
    ),
    ToolSpec(
        "get_time",
        "Current local time in a city",
        {"city": {"type": "string"}},
        ("city",),
        lambda rng: {"city": rng.choice(CITIES)},
        (
            "What time is it in {city}?",
            "Current time in {city}?",
            "Tell me the local time in {city}.",
            "What's the time in {city} right now?",
            "Is it late in {city}? What time is it there?",
            "Clock check: {city}",
            "I want to call someone in {city}. What time is it there?",
            "What hour is it in {city}?",
        ),
        lambda rng, a: {"city": a["city"], "time": _clock(rng)},
        ("It is {time} in {city}.", "The local time in {city} is {time}.", "{city}: {time}."),
        ("time",),
    ),
    ToolSpec(
        "book_table",
        "Book a restaurant table",
        {"restaurant": {"type": "string"}, "people": {"type": "integer"}, "time": {"type": "string"}},
        ("restaurant", "people", "time"),
        lambda rng: {"restaurant": rng.choice(RESTAURANTS), "people": rng.randint(1, 10), "time": _clock(rng)},
        (
            "Book a table for {people} at {restaurant} at {time}.",
            "Reserve {restaurant} for {people} people at {time}.",
            "Table for {people} at {restaurant}, {time}.",
            "Can you get us a table at {restaurant} at {time}? We are {people}.",
            "I want to eat at {restaurant} at {time} with {people} people.",
            "Please make a reservation at {restaurant}: {people} guests, {time}.",
            "{people} people, {restaurant}, {time}. Book it.",
            "Get me a booking at {restaurant} for {people} at {time}.",
        ),
        lambda rng, a: {"status": "confirmed", "code": f"R{rng.randint(100, 999)}"},
        (
            "Booked! Your confirmation code is {code}.",
            "Your table is confirmed, code {code}.",
            "Reservation confirmed ({code}).",
        ),
        ("code",),
    ),
    ToolSpec(
        "define_word",
        "Dictionary definition of an English word",
        {"word": {"type": "string"}},
        ("word",),
        lambda rng: {"word": rng.choice(WORDS)},
        (
            "What does {word} mean?",
            "Define {word}.",
            "Meaning of {word}?",
            "Look up {word} in the dictionary.",
            "What is the definition of {word}?",
            "I keep seeing the word {word}. What does it mean?",
            "Explain the word {word}.",
            "{word} definition please",
        ),
        lambda rng, a: {"word": a["word"], "definition": DEFINITIONS[a["word"]]},
        ("{word} means {definition}.", "It means {definition}.", "Definition: {definition}."),
        ("definition",),
    ),
)
# More wordings per tool (appended, so every 4th one overall is still held out for eval).
_MORE_ASKS: dict[str, tuple[str, ...]] = {
    "get_weather": (
        "Forecast check for {city}{unit_text}?",
        "Should I pack sunglasses for {city}? What's it like there{unit_text}?",
        "Current conditions in {city}{unit_text}",
        "Tell me how the weather is in {city}{unit_text}.",
    ),
    "convert_currency": (
        "If I change {amount} {from_currency} to {to_currency}, what do I get?",
        "{from_currency} {amount} in {to_currency}?",
        "Convert this: {amount} {from_currency}, target currency {to_currency}.",
        "Rate question: {amount} {from_currency} into {to_currency}.",
    ),
    "set_timer": (
        "Timer for {minutes} minutes please.",
        "Count {minutes} minutes for me.",
        "Start counting down {minutes} minutes.",
        "Let me know in {minutes} minutes.",
    ),
    "send_email": (
        "Email to {to} - subject {subject}",
        "Shoot an email to {to} with subject {subject}",
        "Compose an email for {to}, the subject is {subject}",
        "Send mail: to {to}, subject {subject}",
    ),
    "get_stock_price": (
        "How is {symbol} doing on the market?",
        "Price of {symbol} stock right now?",
        "Fetch the {symbol} share price.",
        "What does {symbol} cost per share?",
    ),
    "translate": (
        "Translate to {target_language}: {text}",
        "Turn {text} into {target_language}.",
        "In {target_language}, how would I say {text}?",
        "{text} - translate that into {target_language}.",
    ),
    "create_reminder": (
        "Remind me at {time} to {task}.",
        "Please remind me to {task}, time {time}.",
        "Make a reminder for {time}: {task}",
        "I need a reminder at {time} to {task}.",
    ),
    "get_time": (
        "Local time in {city}?",
        "Time check for {city}.",
        "Do you know what time it is in {city}?",
        "What is the current time in {city}?",
    ),
    "book_table": (
        "Reserve a table at {restaurant} for {people} at {time}.",
        "Book {restaurant}, {people} people, at {time}.",
        "We need a table for {people} at {restaurant} around {time}.",
        "Can I book {restaurant} at {time} for {people}?",
    ),
    "define_word": (
        "Whats the meaning of {word}?",
        "Tell me what {word} means.",
        "Dictionary lookup: {word}",
        "Could you define the word {word}?",
    ),
}
TOOLS = tuple(dataclasses.replace(t, asks=t.asks + _MORE_ASKS.get(t.name, ())) for t in TOOLS)
TOOLS_BY_NAME = {t.name: t for t in TOOLS}

_TOOL_SYSTEMS = (
    "Use a tool when it helps answer the user.",
    "You are an assistant with access to tools. Call them when needed.",
    "You can call functions. Pick the right one and fill in its arguments.",
    "Call tools to get live information.",
)


def _exchange(rng: random.Random, split: Split, spec: ToolSpec) -> tuple[str, dict, dict]:
    """(user request, arguments, tool result) for one use of ``spec``."""
    args = spec.make_args(rng)
    ask = pick(rng, spec.asks, split).format(**args, unit_text=_unit_text(args))
    return ask, args, spec.make_result(rng, args)


def _earlier_tool_turns(rng: random.Random, split: Split, spec: ToolSpec) -> list[dict]:
    """A finished earlier tool exchange: request, call, result, answer (multi-turn tool chats)."""
    ask, args, result = _exchange(rng, split, spec)
    return [
        user_turn(rng, split, ask),
        {"role": "assistant", "content": "", "tool_calls": [{"name": spec.name, "arguments": args}]},
        {"role": "tool", "content": json.dumps(result)},
        {"role": "assistant", "content": rng.choice(spec.answers).format(**{**args, **result})},
    ]


def _scenario(rng: random.Random, split: Split) -> tuple[list[dict], list[dict], ToolSpec, dict, dict]:
    """(messages up to the user turn, tool list, chosen tool, arguments, tool result)."""
    spec = rng.choice(TOOLS)
    others = [t for t in TOOLS if t is not spec]
    offered = [spec, *rng.sample(others, rng.choice((0, 1, 1, 2)))]  # short lists: 256-token budget
    rng.shuffle(offered)
    messages = system_turn(rng, split, _TOOL_SYSTEMS, p_none=0.4)
    if rng.random() < 0.15:  # the chat already used a tool (maybe the same one) for an earlier request
        messages += _earlier_tool_turns(rng, split, rng.choice(offered))
    else:
        messages += history_turns(rng, split)
    ask, args, result = _exchange(rng, split, spec)
    messages.append(user_turn(rng, split, ask))
    return messages, [t.schema() for t in offered], spec, args, result


def parse_tool_calls(text: str) -> list[dict] | None:
    """The JSON list after ``<|tool_calls|>`` in raw model output, or None if absent or malformed."""
    if TOOL_CALLS not in text:
        return None
    from quicksilver.tasks.base import first_json_value

    calls = first_json_value(text.split(TOOL_CALLS, 1)[1], "[")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        return None
    return calls


_NO_TOOL_ASKS = (
    "What is {a} + {b}?",
    "Quick one: {a} plus {b}?",
    "Add {a} and {b} for me.",
    "How much is {a} + {b}?",
    "Sum of {a} and {b}?",
    "{a} + {b} = ?",
    "What do {a} and {b} add up to?",
    "Please add {a} to {b}.",
)
NO_TOOL_RATE = 0.1  # share of tool_call examples where no offered tool fits and the assistant answers directly


def sum_without_call(task: str, messages: list[dict], a: int, b: int, tools: list[dict] | None) -> Example:
    """An example whose right answer calls no tool and works out ``a + b`` (graded by ``ToolCall.verify``)."""
    return Example(task, messages, {"role": "assistant", "content": worked_sum(a, b)}, {"no_call": a + b}, tools)


class ToolCall(Task):
    name = "tool_call"
    description = "choose a tool from a list and fill its arguments (exact JSON match), or answer without one"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        messages, tools, spec, args, _ = _scenario(rng, split)
        if rng.random() < NO_TOOL_RATE:  # nothing in the tool list helps: answer in words, call nothing
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            messages[-1] = {"role": "user", "content": pick(rng, _NO_TOOL_ASKS, split).format(a=a, b=b)}
            return sum_without_call(self.name, messages, a, b, tools)
        call = [{"name": spec.name, "arguments": args}]
        return Example(self.name, messages, {"role": "assistant", "content": "", "tool_calls": call}, call, tools)

    def verify(self, example: Example, output: str) -> bool:
        if isinstance(example.answer, dict):  # no tool fits: no call, and the right number
            text = clean_output(output)
            return TOOL_CALLS not in text and final_integer(text) == example.answer["no_call"]
        calls = parse_tool_calls(clean_output(output))
        if calls is None or len(calls) != len(example.answer):
            return False
        return all(
            c.get("name") == ref["name"] and c.get("arguments") == ref["arguments"]
            for c, ref in zip(calls, example.answer, strict=True)
        )


class ToolAnswer(Task):
    name = "tool_answer"
    description = "answer the user from a tool's JSON result (key values must appear)"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        messages, tools, spec, args, result = _scenario(rng, split)
        messages = [
            *messages,
            {"role": "assistant", "content": "", "tool_calls": [{"name": spec.name, "arguments": args}]},
            {"role": "tool", "content": json.dumps(result)},
        ]
        text = rng.choice(spec.answers).format(**{**args, **result})
        keys = [str(result[k]) for k in spec.key_fields]
        return Example(self.name, messages, {"role": "assistant", "content": text}, keys, tools)

    def verify(self, example: Example, output: str) -> bool:
        text = clean_output(output)
        return TOOL_CALLS not in text and all(mentions(text, k) for k in example.answer)


def mentions(text: str, value: str) -> bool:
    """``value`` appears in ``text`` as a whole item: "20" is not found in "120", "20.5" or "-20", "ok" not in
    "okay"."""
    pattern = r"(?<![\w.\-])" + re.escape(value) + r"(?!\.?\d)(?![A-Za-z])"
    return re.search(pattern, text, re.I) is not None
