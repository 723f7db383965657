"""JSON extraction with composed phrasings: a training drill for the ``json`` task's held-out wordings.

The ``json`` task states each record in one of eight fixed sentences (six for training, two held out). On held-out
seeds the shipped models extract 99 of 100 records right when the sentence is a training one and 67-73 when it is
a held-out one (session 33): they learnt where each field sits in six sentences, not how a field is stated. This
drill states the same records in sentences composed anew for every example: each field has several ways of being
mentioned (a clause, or a label before the value), the fields come in random order, in prose or in one of several
list layouts, and the request around the text is composed the same way. Half of the values are made up, so only
copying from the text gets them right.

Every list of pieces is split like the other tasks' phrasings (``split_items``), so ``quicksilver eval --tasks
json_varied`` scores held-out pieces. None of the pieces was taken from the ``json`` task's held-out sentences or
requests; ``tests/test_tasks.py`` checks that no composed text reproduces one of them.
"""

from __future__ import annotations

import json
import random
from typing import Any

from quicksilver.tasks.base import (
    Example,
    Split,
    Task,
    check_split,
    history_turns,
    pick,
    split_items,
    system_turn,
    user_turn,
)
from quicksilver.tasks.json_extraction import _JSON_SYSTEMS, RECORDS, JsonExtraction, Record
from quicksilver.tasks.recall import made_up_word

# How a field is mentioned in prose ("{v}" is the value) and the labels it takes in a list. Booleans have a
# clause per value instead. The record's first field is the subject of a prose sentence.
_CLAUSES: dict[str, tuple[str, ...]] = {
    "age": ("aged {v}", "{v} years old", "who is {v}", "age {v}", "{v} years of age", "at the age of {v}",
            "now {v}", "{v} this year"),
    "city": ("based in {v}", "from {v}", "who lives in {v}", "in {v}", "resident of {v}", "located in {v}",
             "who calls {v} home", "settled in {v}"),
    "price": ("priced at {v} dollars", "tagged {v} dollars", "costing {v} dollars", "at {v} USD", "selling at {v}",
              "with a price of {v}", "listed for {v} dollars", "at a price of {v}"),
    "date": ("on {v}", "dated {v}", "scheduled for {v}", "happening {v}", "planned for {v}", "booked on {v}",
             "taking place on {v}", "set on {v}"),
    "attendees": ("with {v} attendees", "for {v} people", "{v} guests invited", "seating {v}",
                  "{v} participants", "headcount {v}", "{v} people registered", "expecting {v}"),
    "author": ("by {v}", "written by {v}", "from the author {v}", "penned by {v}", "authored by {v}",
               "a work of {v}", "credited to {v}", "the work of {v}"),
    "year": ("published in {v}", "from {v}", "released {v}", "out in {v}", "printed in {v}", "first issued in {v}",
             "dating from {v}", "appearing in {v}"),
    "job": ("working as a {v}", "employed as a {v}", "a {v} by trade", "job {v}", "in the role of {v}",
            "taken on as {v}", "position {v}", "who is a {v}"),
    "salary": ("earning {v}", "paid {v} a year", "salary {v}", "on {v} per year", "making {v} annually",
               "with pay of {v}", "annual pay {v}", "compensated {v}"),
    "item": ("for the {v}", "item {v}", "product {v}", "buying {v}", "the article {v}", "wanting {v}",
             "goods: {v}", "ordering {v}"),
    "quantity": ("quantity {v}", "{v} of them", "{v} pieces", "count {v}", "amount {v}", "{v} in total",
                 "qty {v}", "number ordered {v}"),
    "color": ("in {v}", "colour {v}", "color {v}", "finish {v}", "in the {v} version", "shade {v}",
              "{v} coloured", "the {v} one"),
}
_BOOL_CLAUSES: dict[str, tuple[tuple[str, str], ...]] = {  # (true, false)
    "in_stock": (("in stock", "out of stock"), ("available now", "sold out"), ("ready to ship", "not available"),
                 ("on the shelf", "currently unavailable"), ("stocked", "not stocked"), ("available", "unavailable"),
                 ("in inventory", "missing from inventory"), ("can be bought today", "cannot be bought today")),
    "remote": (("works remotely", "works in the office"), ("remote", "on site"), ("from home", "at the office"),
               ("working from home", "office based"), ("fully remote", "not remote"), ("home office", "in person"),
               ("remote worker", "office worker"), ("telecommuting", "commuting in")),
}
_LABELS: dict[str, tuple[str, ...]] = {
    "name": ("name", "full name", "person", "who", "employee", "contact", "staff member", "individual"),
    "age": ("age", "years", "age in years", "how old"),
    "city": ("city", "location", "lives in", "based in", "residence", "town"),
    "product": ("product", "item", "article", "goods"),
    "price": ("price", "cost", "price in dollars", "amount"),
    "in_stock": ("stock", "availability", "status", "inventory"),
    "event": ("event", "what", "occasion", "activity"),
    "date": ("date", "when", "day", "scheduled"),
    "attendees": ("attendees", "people", "guests", "headcount"),
    "title": ("title", "book", "book title", "work"),
    "author": ("author", "writer", "by", "written by"),
    "year": ("year", "published", "publication year", "released"),
    "job": ("job", "role", "position", "occupation"),
    "salary": ("salary", "pay", "yearly pay", "annual salary"),
    "remote": ("remote", "work mode", "location type", "workplace"),
    "order_id": ("order id", "order", "reference", "order code"),
    "item": ("item", "product", "article", "goods"),
    "quantity": ("quantity", "qty", "count", "how many"),
    "color": ("color", "colour", "shade", "finish"),
}
# list layouts: (between label and value, between fields, before the first field)
_LAYOUTS: tuple[tuple[str, str, str], ...] = (
    (": ", "\n", ""), (" = ", ", ", ""), (": ", "; ", ""), (" - ", "\n", "- "), (": ", " | ", ""),
    ("=", " ", ""), (": ", ", ", ""), (" -> ", "\n", ""), (":", "\n* ", "* "), (" is ", "; ", ""),
    (": ", " / ", ""), (" = ", "\n", ""),
)
_CONNECTORS = (", ", " and ", ", ", "; ", " - ", ", ")
# the request around the text: an instruction, where the schema goes, how the text is introduced
_INSTRUCTIONS = (
    "Extract a JSON object from this.", "Pull the fields out as JSON.", "Please produce JSON for the record below.",
    "Convert the record to JSON.", "Return the record as one JSON object.", "I need JSON from this text.",
    "Write a JSON object with these facts.", "Make JSON out of this.", "Structure this as JSON.",
    "Output the data below in JSON.", "Can you JSON-ify this?", "Encode these details as a JSON object.",
)
_SCHEMA_LEADS = ("Schema: ", "Use the schema ", "The JSON must match ", "Follow this schema: ", "JSON Schema: ",
                 "Format: ", "Valid under: ", "Target schema: ")
_TEXT_LEADS = ("Text: ", "", "Record: ", "Details: ", "Input:\n", "Here it is: ", "Data: ", "Source: ")


def _made_up_values(rng: random.Random, values: dict[str, Any]) -> dict[str, Any]:
    """The same record with made-up strings (enum fields and non-strings kept): only copying gets them right."""
    out = dict(values)
    for key, value in values.items():
        if not isinstance(value, str) or key in ("color", "date"):
            continue
        if key == "order_id":
            out[key] = f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randint(100, 99999)}"
        elif key in ("name", "author", "title"):
            words = rng.randint(2, 3 if key == "title" else 2)
            out[key] = " ".join(made_up_word(rng).capitalize() for _ in range(words))
        else:
            out[key] = made_up_word(rng)
    return out


def _mention(rng: random.Random, key: str, value: Any, split: Split) -> str:
    if key in _BOOL_CLAUSES:
        return pick(rng, _BOOL_CLAUSES[key], split)[0 if value else 1]
    return pick(rng, _CLAUSES[key], split).format(v=value)


def _bool_word(rng: random.Random, key: str, value: bool, split: Split) -> str:
    if rng.random() < 0.3:
        return rng.choice(("yes", "true")) if value else rng.choice(("no", "false"))
    return _mention(rng, key, value, split)


# Shorthand: values without labels, each field marked (or not) the way notes and order slips mark it. Every
# record has at most one number, so an unlabelled number is still unambiguous. No mark puts a value in round
# brackets or writes "x{v}": those pieces belong to held-out ``json`` sentences, so they stay unseen.
_MARKS: dict[str, tuple[str, ...]] = {
    "age": ("{v}y", "{v} yrs", "age {v}", "{v} yo", "{v}", "{v} years"),
    "price": ("${v}", "{v} USD", "@ {v}", "USD {v}", "{v}$", "{v} dollars", "[{v} $]", "cost {v}"),
    "attendees": ("{v} ppl", "{v} pax", "n={v}", "{v} people", "{v} seats", "{v} heads"),
    "year": ("[{v}]", "{v}", "yr {v}", "{v} ed.", "c. {v}", "/{v}"),
    "salary": ("{v}/yr", "${v}", "{v} pa", "{v} per annum", "{v} gross", "{v} a year"),
    "quantity": ("{v} pcs", "qty {v}", "{v}x", "{v} units", "* {v}", "n={v}", "{v} ea", "{v} off"),
    "color": ("[{v}]", "{v}", "/{v}/", "in {v}", "<{v}>", "{v} finish", "colour: {v}", "{v}-coloured"),
    "order_id": ("{v}", "#{v}", "ref {v}", "{v}:", "no. {v}", "[{v}]"),
    "title": ('"{v}"', "{v}", "'{v}'", "<{v}>", "*{v}*", "{v}"),
    "date": ("{v}", "@ {v}", "on {v}", "{v}", "date {v}", "[{v}]"),
}
_SHORT_BOOLS: dict[str, tuple[tuple[str, str], ...]] = {  # (true, false)
    "in_stock": (("in stock", "OOS"), ("avail.", "n/a"), ("stocked", "none left"), ("yes stock", "no stock"),
                 ("available", "sold out"), ("on hand", "backordered")),
    "remote": (("remote", "onsite"), ("WFH", "office"), ("remote ok", "in office"), ("home-based", "office-based"),
               ("100% remote", "on-site only"), ("remote", "in person")),
}
_SHORT_SEPS = (" - ", " | ", ", ", " / ", "; ", " · ", " -- ", "  ", " :: ", " + ", ",", " > ")


def compose_shorthand(rng: random.Random, values: dict[str, Any], split: Split) -> str:
    """The record as a terse note: marked values in random order, one separator or a mix of them."""
    keys = list(values)
    rng.shuffle(keys)
    parts = []
    for k in keys:
        v = values[k]
        if k in _SHORT_BOOLS:
            parts.append(pick(rng, _SHORT_BOOLS[k], split)[0 if v else 1])
        elif k in _MARKS and rng.random() < 0.8:
            parts.append(pick(rng, _MARKS[k], split).format(v=v))
        else:
            parts.append(str(v))
    seps = split_items(_SHORT_SEPS, split)
    sep = rng.choice(seps)
    text = parts[0]
    for part in parts[1:]:
        text += (rng.choice(seps) if rng.random() < 0.3 else sep) + part
    return text


def compose_text(rng: random.Random, record: Record, values: dict[str, Any], split: Split) -> str:
    """The record's facts in a newly composed sentence, list or shorthand note; every value appears verbatim."""
    keys = list(values)
    if rng.random() < 0.25:  # session 36: terse notes, most of the held-out `json` errors were one such form
        return compose_shorthand(rng, values, split)
    if rng.random() < 0.5:  # prose: the first field is the subject, the others clauses in random order
        subject, rest = keys[0], keys[1:]
        rng.shuffle(rest)
        clauses = [_mention(rng, k, values[k], split) for k in rest]
        front = ""
        if clauses and rng.random() < 0.3:  # one clause before the subject: "Based in Oslo, Ana Ruiz, aged 40"
            first = clauses.pop(0)
            front = first[0].upper() + first[1:] + ", "
        text = front + str(values[subject])
        for i, clause in enumerate(clauses):
            text += (", " if i == 0 else pick(rng, _CONNECTORS, split)) + clause
        return text + rng.choice((".", ".", ""))
    rng.shuffle(keys)
    between, sep, lead = pick(rng, _LAYOUTS, split)
    case = rng.choice((str.lower, str.capitalize, str.capitalize, str.upper))
    fields = []
    for k in keys:
        v = _bool_word(rng, k, values[k], split) if k in _BOOL_CLAUSES else values[k]
        fields.append(f"{case(pick(rng, _LABELS[k], split))}{between}{v}")
    return lead + sep.join(fields)


def compose_request(rng: random.Random, schema_text: str, text: str, split: Split) -> str:
    instruction = pick(rng, _INSTRUCTIONS, split)
    schema = pick(rng, _SCHEMA_LEADS, split) + schema_text
    body = pick(rng, _TEXT_LEADS, split) + text
    parts = [instruction, schema, body]
    if rng.random() < 0.5:  # schema after the text as often as before it
        parts = [instruction, body, schema]
    if rng.random() < 0.3:  # the instruction last
        parts = parts[1:] + parts[:1]
    return "\n".join(parts)


class JsonVaried(Task):
    name = "json_varied"
    description = "JSON extraction from records stated in freshly composed wordings (a drill for unseen phrasings)"
    in_suite = False

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        record = rng.choice(RECORDS)
        values = record.make(rng)
        if rng.random() < 0.5:
            values = _made_up_values(rng, values)
        text = compose_text(rng, record, values, split)
        schema_text = json.dumps(record.schema)
        messages = system_turn(rng, split, _JSON_SYSTEMS) + history_turns(rng, split)
        messages.append(user_turn(rng, split, compose_request(rng, schema_text, text, split)))
        return Example(self.name, messages, {"role": "assistant", "content": json.dumps(values)},
                       {"schema": record.schema, "value": values})

    verify = JsonExtraction.verify
