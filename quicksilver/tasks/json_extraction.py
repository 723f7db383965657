"""JSON extraction: a JSON Schema and a short text are given; the answer is one JSON object that validates
against the schema and whose fields equal the facts in the text."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from quicksilver.tasks.base import (
    Example,
    Split,
    Task,
    check_split,
    clean_output,
    first_json_value,
    history_turns,
    pick,
    strip_fences,
    system_turn,
    user_turn,
)
from quicksilver.tasks.tool_use import CITIES

_FIRST = (
    "Anna",
    "Ben",
    "Chloe",
    "David",
    "Emma",
    "Felix",
    "Grace",
    "Hugo",
    "Iris",
    "Jack",
    "Kara",
    "Leo",
    "Maya",
    "Noah",
    "Olga",
    "Pablo",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Will",
    "Yara",
    "Zane",
)
_LAST = ("Smith", "Garcia", "Chen", "Novak", "Okafor", "Silva", "Berg", "Kim", "Rossi", "Meyer", "Khan", "Dubois")
_PRODUCTS = (
    "desk lamp",
    "water bottle",
    "backpack",
    "keyboard",
    "coffee mug",
    "notebook",
    "headphones",
    "umbrella",
    "phone case",
    "office chair",
    "yoga mat",
    "toaster",
)
_COLORS = ("red", "blue", "green", "black", "white", "grey", "yellow")
_EVENTS = ("team meeting", "book club", "yoga class", "code review", "birthday party", "budget call", "workshop")
_TITLES = (
    "The Silent River",
    "Paper Moons",
    "A Winter Garden",
    "Iron and Salt",
    "The Last Lighthouse",
    "Small Hours",
    "Northern Lines",
    "Glass Houses",
    "The Quiet Field",
    "Seven Doors",
)
_JOBS = ("teacher", "engineer", "nurse", "chef", "pilot", "designer", "farmer", "lawyer", "painter", "baker")


@dataclass(frozen=True)
class Record:
    kind: str
    schema: dict[str, Any]
    make: Callable[[random.Random], dict[str, Any]]
    texts: tuple[str, ...]  # phrasings of the facts, formatted with the record's fields


def _obj(props: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


RECORDS: tuple[Record, ...] = (
    Record(
        "person",
        _obj({"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}),
        lambda rng: {
            "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "age": rng.randint(18, 90),
            "city": rng.choice(CITIES),
        },
        (
            "{name} is {age} years old and lives in {city}.",
            "Meet {name}, {age}, from {city}.",
            "{name} ({age}) moved to {city} last year.",
            "Living in {city}, {name} turned {age} this spring.",
            "Our new member {name} is {age} and based in {city}.",
            "{city} resident {name}, aged {age}, joined today.",
            "At {age}, {name} still loves life in {city}.",
            "Name: {name}. Age: {age}. Home town: {city}.",
        ),
    ),
    Record(
        "product",
        _obj({"product": {"type": "string"}, "price": {"type": "number"}, "in_stock": {"type": "boolean"}}),
        lambda rng: {
            "product": rng.choice(_PRODUCTS),
            "price": round(rng.randint(1, 300) + rng.choice((0, 0.5, 0.99)), 2),
            "in_stock": rng.random() < 0.5,
        },
        (
            "The {product} costs {price} dollars and is {stock_text}.",
            "{product}: {price} USD, {stock_text}.",
            "Our {product} sells for {price} dollars; currently {stock_text}.",
            "Price check: the {product} is {price} dollars and it is {stock_text}.",
            "You can get the {product} for {price} dollars. Status: {stock_text}.",
            "{stock_text} - {product}, priced at {price} dollars.",
            "The shop lists the {product} at {price} dollars ({stock_text}).",
            "A {product} for {price} dollars, {stock_text}.",
        ),
    ),
    Record(
        "event",
        _obj({"event": {"type": "string"}, "date": {"type": "string"}, "attendees": {"type": "integer"}}),
        lambda rng: {
            "event": rng.choice(_EVENTS),
            "date": f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            "attendees": rng.randint(2, 60),
        },
        (
            "The {event} on {date} will have {attendees} attendees.",
            "{attendees} people signed up for the {event} on {date}.",
            "On {date} we hold the {event}; {attendees} are coming.",
            "Reminder: {event}, {date}, {attendees} guests.",
            "We expect {attendees} guests at the {event} ({date}).",
            "{date}: {event} with {attendees} participants.",
            "The {event} is set for {date}, and {attendees} people will attend.",
            "Join the {event} on {date} with {attendees} others.",
        ),
    ),
    Record(
        "book",
        _obj({"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}}),
        lambda rng: {
            "title": rng.choice(_TITLES),
            "author": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "year": rng.randint(1900, 2024),
        },
        (
            "{title} was written by {author} in {year}.",
            "In {year}, {author} published {title}.",
            "{author} wrote {title} ({year}).",
            "The novel {title} by {author} first appeared in {year}.",
            "{title}, a {year} book from {author}.",
            "Published {year}: {title}, by {author}.",
            "Everyone is reading {title}, which {author} released in {year}.",
            "Author {author}; title {title}; year {year}.",
        ),
    ),
    Record(
        "employee",
        _obj(
            {
                "name": {"type": "string"},
                "job": {"type": "string"},
                "salary": {"type": "integer"},
                "remote": {"type": "boolean"},
            }
        ),
        lambda rng: {
            "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "job": rng.choice(_JOBS),
            "salary": rng.randint(20, 150) * 1000,
            "remote": rng.random() < 0.5,
        },
        (
            "{name} works as a {job}, earns {salary} a year and {remote_text}.",
            "Our {job} {name} makes {salary} per year; {remote_text}.",
            "{name}, {job}, salary {salary}, {remote_text}.",
            "Hired: {name} as {job} at {salary}. Note: {remote_text}.",
            "{name} is a {job} with a salary of {salary} who {remote_text}.",
            "As a {job}, {name} is paid {salary} and {remote_text}.",
            "Staff record - {name}: {job}, {salary}; {remote_text}.",
            "{name} joined as {job} ({salary} yearly) and {remote_text}.",
        ),
    ),
    Record(
        "order",
        _obj(
            {
                "order_id": {"type": "string"},
                "item": {"type": "string"},
                "quantity": {"type": "integer"},
                "color": {"type": "string", "enum": list(_COLORS)},
            }
        ),
        lambda rng: {
            "order_id": f"A{rng.randint(1000, 9999)}",
            "item": rng.choice(_PRODUCTS),
            "quantity": rng.randint(1, 20),
            "color": rng.choice(_COLORS),
        },
        (
            "Order {order_id}: {quantity} {color} {item}.",
            "Please ship {quantity} {item} in {color} (order {order_id}).",
            "I ordered {quantity} {color} {item}, order number {order_id}.",
            "Order number {order_id} is for {quantity} units of the {item} in {color}.",
            "{quantity} x {item}, colour {color}, ref {order_id}.",
            "Ref {order_id}: the customer wants {quantity} {color} {item}.",
            "We received order {order_id} for {quantity} {item}, all {color}.",
            "{order_id} - {item} ({color}) x{quantity}",
        ),
    ),
)

_ASKS = (
    "Extract the data from the text as JSON matching this schema.\nSchema: {schema}\nText: {text}",
    "Text: {text}\nReturn a JSON object that follows this schema: {schema}",
    "Fill this JSON schema from the text.\n{schema}\n{text}",
    "Read the text and output only JSON.\nSchema: {schema}\nText: {text}",
    "{text}\n\nConvert the above into JSON using the schema {schema}",
    "Schema:\n{schema}\nInput: {text}\nJSON:",
    "Please parse this into structured data ({schema}): {text}",
    "Give me a JSON object for: {text}\nIt must validate against {schema}",
    "Turn this text into JSON. Schema: {schema}\n{text}",
    "{text}\nI need that as a JSON object ({schema}).",
    "Structured output please. Schema {schema}. Source text: {text}",
    "Map the following onto the schema {schema} and reply with the JSON.\n{text}",
)
_JSON_SYSTEMS = (
    "You extract structured data. Reply with JSON only.",
    "Output valid JSON that matches the schema. No extra text.",
    "You are a data extraction engine.",
    "Return only a JSON object.",
)


def _text_slots(record: dict[str, Any]) -> dict[str, Any]:
    slots = dict(record)
    if "in_stock" in record:
        slots["stock_text"] = "in stock" if record["in_stock"] else "out of stock"
    if "remote" in record:
        slots["remote_text"] = "works remotely" if record["remote"] else "works in the office"
    return slots


class JsonExtraction(Task):
    name = "json"
    description = "extract a JSON object matching a given schema from a short text"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        rec = rng.choice(RECORDS)
        values = rec.make(rng)
        text = pick(rng, rec.texts, split).format(**_text_slots(values))
        schema_text = json.dumps(rec.schema)
        ask = pick(rng, _ASKS, split).format(schema=schema_text, text=text)
        messages = system_turn(rng, split, _JSON_SYSTEMS) + history_turns(rng, split)
        messages.append(user_turn(rng, split, ask))
        return Example(
            self.name,
            messages,
            {"role": "assistant", "content": json.dumps(values)},
            {"schema": rec.schema, "value": values},
        )

    def verify(self, example: Example, output: str) -> bool:
        value = first_json_value(strip_fences(clean_output(output)), "{")
        if not isinstance(value, dict):
            return False
        try:
            jsonschema.validate(value, example.answer["schema"])
        except jsonschema.ValidationError:
            return False
        return value == example.answer["value"]
