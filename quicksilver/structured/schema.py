"""JSON Schema -> skeleton: fixed text (braces, quoted keys, punctuation) and bounded value slots.

Text is laid out the way ``json.dumps`` writes it with default separators (``", "`` and ``": "``), which
is also how the chat template's ``tojson`` renders tool calls, so pinned text tokenizes like training
data. Strategy for the parts a skeleton cannot leave open (documented, deterministic):

* every listed property is emitted, in schema order; an optional one with a simple value (string, number,
  enum...) that follows a written property is one slot holding either nothing or ``, "key": value``, so the
  model decides whether to state it; other optional ones are always written (keys pinned); an optional property
  we cannot enforce (or a recursive one) is left out;
* an array whose item count is fixed (minItems == maxItems) is pinned item by item; otherwise it is one
  slot whose automaton counts items (minItems/maxItems respected) - for object items the model then
  writes the keys itself (forced by the automaton); items that need their own counter (length-bounded
  strings, nested arrays) fall back to ``max(minItems, 1)`` pinned items;
* ``anyOf``/``type`` lists become one slot the model chooses in (objects included, as above); a oneOf
  must have alternatives that start differently (so exactly one matches);
* ``format`` date/time/date-time/uuid/email/ipv4 and ``pattern`` are enforced (ASCII strings); anything
  that cannot be guaranteed (multipleOf, not, if/then/else, lookaround...) raises
  :class:`UnsupportedSchema` naming the keyword.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import jsonschema

from quicksilver.structured.automata import MAX_COUNT
from quicksilver.structured.regex import FORMATS, compile_pattern


class UnsupportedSchema(ValueError):
    """The schema uses a feature the constrained decoder cannot enforce (the server answers 400)."""


class SchemaTooLarge(UnsupportedSchema):
    """A value too large to enforce (a length or item count past the bounds, an automaton too large): refused up
    front, before the work or memory it would take is spent. Like any value that cannot be enforced, an optional
    property or an alternative of this kind is left out; a required one refuses the schema."""


class SchemaOverBudget(SchemaTooLarge):
    """The schema as a whole is too large (too many sub-schemas or values): refused, never left out in part."""


@dataclass(frozen=True)
class Slot:
    spec: tuple  # value automaton spec (see quicksilver.structured.values)
    budget: int  # default number of canvas tokens
    flexible: bool  # may be shrunk or grown to fit the canvas (strings, arrays)


Piece = str | Slot

# keywords with no effect on what we generate (annotations) or that our generation always satisfies
_IGNORED = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "additionalProperties", "unevaluatedProperties", "required", "strict", "nullable", "$defs",
    "definitions", "properties", "items", "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems",
    "maxItems", "prefixItems", "uniqueItems", "minProperties", "maxProperties", "format", "contentEncoding",
    "contentMediaType", "$anchor", "name",
}
_UNSUPPORTED = {
    "patternProperties": "patternProperties", "multipleOf": "multipleOf",
    "not": "not", "if": "if/then/else", "then": "if/then/else", "else": "if/then/else",
    "dependentRequired": "dependentRequired", "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies", "contains": "contains", "propertyNames": "propertyNames",
    "unevaluatedItems": "unevaluatedItems", "additionalItems": "additionalItems", "$dynamicRef": "$dynamicRef",
}
STRING_TOKENS = 16  # default tokens for a string value (S3 uses 16 as well)
NUMBER_TOKENS = 8
ARRAY_ITEMS = 3  # default item budget for arrays of simple values
_MAX_DEPTH = 12
# Bounds on the work a schema may ask for, checked while it is compiled (before any automaton is built), so a
# schema too large to enforce is refused in well under a second instead of building for minutes or exhausting
# memory. Generous: a tool's arguments or an answer's fields are tens of values, not hundreds.
MAX_SCHEMA_NODES = 2048  # sub-schemas compiled (each $ref expansion counts: no exponential blow-up)
MAX_SLOTS = 256  # value slots in one skeleton (each gets its own automaton and at least one canvas token)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class SchemaCompiler:
    def __init__(self, root: dict, strict: bool = True):
        if not isinstance(root, dict):
            raise UnsupportedSchema("the schema must be a JSON object")
        self.root = root
        self.strict = strict
        self._active: list[str] = []  # $refs being expanded (recursion check)
        self._nodes = 0  # sub-schemas compiled so far (bounded by MAX_SCHEMA_NODES)
        try:
            jsonschema.validators.validator_for(root).check_schema(root)
        except jsonschema.SchemaError as exc:
            raise UnsupportedSchema(f"invalid JSON schema: {exc.message}") from None

    # -- helpers ----------------------------------------------------------------------------------------
    def resolve(self, schema: Any, depth: int) -> Any:
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise UnsupportedSchema(f"only local $ref is supported (got {ref!r})")
            target: Any = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise UnsupportedSchema(f"$ref {ref!r} does not resolve")
                target = target[part]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **rest} if isinstance(target, dict) and rest else target
            seen += 1
            if seen > _MAX_DEPTH:
                raise UnsupportedSchema("recursive $ref")
        return schema

    def check_keywords(self, schema: dict) -> None:
        for key in schema:
            if key in _UNSUPPORTED:
                raise UnsupportedSchema(f"JSON schema keyword {key!r} ({_UNSUPPORTED[key]}) is not supported "
                                        "by constrained decoding")
        fmt = schema.get("format")
        if fmt is not None and self.strict and (fmt not in FORMATS or "pattern" in schema):
            raise UnsupportedSchema(f"string format {fmt!r} cannot be enforced in strict mode"
                                    + (" together with a pattern" if fmt in FORMATS else ""))

    # -- entry -----------------------------------------------------------------------------------------
    def compile(self) -> list[Piece]:
        pieces = _merge(self.value(self.root, 0))
        slots = sum(isinstance(p, Slot) for p in pieces)
        if slots > MAX_SLOTS:
            raise SchemaOverBudget(f"the schema has {slots} values to fill, more than the {MAX_SLOTS} that can be "
                                 "enforced")
        return pieces

    def value(self, schema: Any, depth: int) -> list[Piece]:
        if depth > _MAX_DEPTH:
            raise UnsupportedSchema(f"schema nesting deeper than {_MAX_DEPTH} levels (recursive schema?)")
        self._nodes += 1
        if self._nodes > MAX_SCHEMA_NODES:
            raise SchemaOverBudget(f"the schema expands to more than {MAX_SCHEMA_NODES} sub-schemas")
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if ref is None:
            return self._value(schema, depth)
        if ref in self._active:
            # a recursive $ref: optional properties that recurse are left out by object(); required ones fail
            raise UnsupportedSchema(f"recursive $ref {ref!r} in a required position")
        self._active.append(ref)
        try:
            return self._value(schema, depth)
        finally:
            self._active.pop()

    def _value(self, schema: Any, depth: int) -> list[Piece]:
        schema = self.resolve(schema, depth)
        if schema is True or schema == {}:
            return [Slot(("union", (("qstring",), _num(False), ("literals", ("true", "false", "null")))),
                         STRING_TOKENS, True)]
        if schema is False:
            raise UnsupportedSchema("a 'false' schema accepts no value")
        if not isinstance(schema, dict):
            raise UnsupportedSchema(f"schema must be an object, got {type(schema).__name__}")
        self.check_keywords(schema)
        if "allOf" in schema:
            parts = schema["allOf"]
            if len(parts) != 1:
                raise UnsupportedSchema("allOf with more than one schema is not supported")
            merged = {**{k: v for k, v in schema.items() if k != "allOf"}, **self.resolve(parts[0], depth)}
            return self.value(merged, depth + 1)
        if "const" in schema:
            return [dumps(schema["const"])]
        if "enum" in schema:
            return self.enum(schema)
        alts = self.alternatives(schema)
        if alts is not None:
            return self.choice(alts, depth, one_of="oneOf" in schema)
        types = schema.get("type")
        if isinstance(types, list):  # ("nullable" is OpenAPI, not JSON Schema: ignored, null never emitted)
            options = list(types)
            base = {k: v for k, v in schema.items() if k != "type"}
            return self.choice([{**base, "type": t} for t in options], depth, one_of=False)
        if types is None:  # infer from keywords
            if "properties" in schema:
                types = "object"
            elif "items" in schema or "prefixItems" in schema:
                types = "array"
            else:
                return self.value(True, depth)
        match types:
            case "object":
                return self.object(schema, depth)
            case "array":
                return self.array(schema, depth)
            case "string":
                return ['"', self.string_slot(schema), '"']
            case "number" | "integer":
                return [self.number_slot(schema, types == "integer")]
            case "boolean":
                return [Slot(("literals", ("true", "false")), 2, False)]
            case "null":
                return ["null"]
        raise UnsupportedSchema(f"unknown type {types!r}")

    def enum(self, schema: dict) -> list[Piece]:
        rest = {k: v for k, v in schema.items() if k != "enum"}
        values = []
        for v in schema["enum"]:
            try:
                jsonschema.validate(v, rest) if rest else None
            except jsonschema.ValidationError:
                continue
            values.append(v)
        if not values:
            raise UnsupportedSchema("enum has no value that satisfies the rest of its schema")
        texts = tuple(dict.fromkeys(dumps(v) for v in values))
        if len(texts) == 1:
            return [texts[0]]
        return [Slot(("literals", texts), 0, False)]

    @staticmethod
    def alternatives(schema: dict) -> list | None:
        for key in ("anyOf", "oneOf"):
            if key in schema:
                base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                return [{**base, **alt} if isinstance(alt, dict) else alt for alt in schema[key]]
        return None

    def choice(self, alts: list, depth: int, one_of: bool) -> list[Piece]:
        """A slot over simple alternatives, or the first structured alternative."""
        compiled = []
        error: UnsupportedSchema | None = None
        for alt in alts:  # alternatives we cannot enforce are dropped (one valid branch is enough)
            try:
                compiled.append(self.value(alt, depth + 1))
            except SchemaOverBudget:
                raise  # the whole schema is refused, not one branch
            except UnsupportedSchema as exc:
                error = error or exc
        if error is not None and (one_of or not compiled):
            raise error  # oneOf: a dropped branch might still match what we write
        simple: list[tuple] = []
        structured = None
        for pieces in compiled:
            spec = _as_simple(pieces)
            if spec is None:
                structured = structured or pieces
                spec = _flatten(pieces)
            if spec is None or (one_of and structured is not None and len(compiled) > 1):
                if one_of and len(compiled) > 1:
                    raise UnsupportedSchema("oneOf with object or array alternatives is not supported")
                return structured  # deterministic: the first object/array alternative, skeleton pinned
            simple.append(spec)
        if len(simple) == 1:
            return compiled[0]
        simple = [_quoted(s) for s in simple]
        if one_of and not _first_bytes_disjoint(simple):
            raise UnsupportedSchema("oneOf between values of the same JSON type is not supported (use anyOf)")
        budget = max(_budget_of(p) for p in compiled)
        return [Slot(("union", tuple(simple)), max(budget, NUMBER_TOKENS), True)]

    def object(self, schema: dict, depth: int) -> list[Piece]:
        props = schema.get("properties") or {}
        required = list(schema.get("required") or [])
        missing = [r for r in required if r not in props]
        if missing:
            raise UnsupportedSchema(f"required properties {missing} are not listed in 'properties'")
        names = list(props)
        max_props = schema.get("maxProperties")
        if max_props is not None and len(names) > max_props:
            names = [n for n in names if n in required]
            names += [n for n in props if n not in names][: max(0, max_props - len(names))]
            if len(names) > max_props:
                raise UnsupportedSchema("maxProperties is smaller than the number of required properties")
        if schema.get("minProperties", 0) > len(names):
            raise UnsupportedSchema("minProperties needs properties that are not listed")
        pieces: list[Piece] = ["{"]
        emitted = 0
        for name in names:
            try:
                value = self.value(props[name], depth + 1)
            except SchemaOverBudget:
                raise
            except UnsupportedSchema:
                if name in required:
                    raise
                continue  # an optional property we cannot enforce is left out (still valid)
            spec = _as_simple(value) if name not in required and emitted else None
            if spec is not None and not _counted(spec) and schema.get("minProperties", 0) <= emitted:
                # an optional simple value after a written one: the model writes it or leaves it out (one slot
                # holding nothing or `, "key": value`), so a call need not state an argument nobody asked for
                key = ", " + dumps(name) + ": "
                pieces.append(Slot(("union", (("literals", ("",)), ("seq", (("lit", key), spec)))),
                                   _budget_of(value) + max(1, len(key) // 3), True))
                continue
            pieces.append((", " if emitted else "") + dumps(name) + ": ")
            pieces.extend(value)
            emitted += 1
        if emitted < schema.get("minProperties", 0):
            raise UnsupportedSchema("minProperties needs optional properties that cannot be enforced")
        pieces.append("}")
        return pieces

    def array(self, schema: dict, depth: int) -> list[Piece]:
        min_items = int(schema.get("minItems", 0))
        max_items = schema.get("maxItems")
        prefix = schema.get("prefixItems")
        items = schema.get("items", True)
        if prefix is not None:
            n = len(prefix) if items is False else max(len(prefix), min_items)
            if max_items is not None:
                n = min(n, max_items)
            if n < min_items:
                raise UnsupportedSchema("prefixItems with items: false cannot reach minItems")
            schemas = [prefix[i] if i < len(prefix) else items for i in range(n)]
            return self._fixed_items(schemas, depth)
        if max_items is not None and max_items < min_items:
            raise UnsupportedSchema("maxItems < minItems")
        max_items = _within_count(min_items, max_items, "minItems")
        try:
            item_pieces = self.value(items, depth + 1)
        except SchemaOverBudget:
            raise
        except UnsupportedSchema:
            if min_items == 0:
                return ["[]"]  # no item we can write: the empty array is still valid
            raise
        spec = _as_simple(item_pieces)
        if spec is None and min_items != max_items:
            # object/array items, count not fixed: one automaton for all items (if no part needs a counter)
            spec = _flatten(item_pieces)
        if spec is not None and not _counted(spec) and not schema.get("uniqueItems"):
            per_item = _budget_of(item_pieces) + 2
            shown = max(min_items, min(ARRAY_ITEMS, max_items if max_items is not None else ARRAY_ITEMS))
            slot = Slot(("array", _quoted(spec), min_items, max_items), max(1, shown) * per_item, True)
            return ["[", slot, "]"]
        n = max(min_items, 1)
        if max_items is not None:
            n = min(n, max_items)
        if schema.get("uniqueItems") and n > 1:
            raise UnsupportedSchema("uniqueItems with minItems > 1 cannot be guaranteed")
        return self._fixed_items([items] * n, depth)

    def _fixed_items(self, schemas: list, depth: int) -> list[Piece]:
        pieces: list[Piece] = ["["]
        for i, s in enumerate(schemas):
            if i:
                pieces.append(", ")
            pieces.extend(self.value(s, depth + 1))
        pieces.append("]")
        return pieces

    def string_slot(self, schema: dict) -> Slot:
        lo = int(schema.get("minLength", 0))
        hi = schema.get("maxLength")
        if hi is not None and hi < lo:
            raise UnsupportedSchema("maxLength < minLength")
        hi = _within_count(lo, hi, "minLength")
        pattern = schema.get("pattern")
        if pattern is None and schema.get("format") in FORMATS:  # known formats are enforced as patterns
            pattern = FORMATS[schema["format"]]
        if pattern is not None:
            try:
                compile_pattern(pattern)
            except ValueError as exc:
                raise UnsupportedSchema(f"pattern {pattern!r}: {exc}") from None
        budget = STRING_TOKENS if hi is None else max(1, min(STRING_TOKENS, int(hi)))
        spec = ("string", lo, None if hi is None else int(hi), pattern)
        _require_value(spec, "string with these length/pattern constraints")
        return Slot(spec, max(budget, lo), True)

    def number_slot(self, schema: dict, integer: bool) -> Slot:
        def bound(key: str) -> tuple[str | None, bool]:
            v = schema.get(key)
            if isinstance(v, bool):  # draft-4 style boolean exclusives
                return None, False
            return (None if v is None else str(Decimal(str(v)))), False

        lo, _ = bound("minimum")
        hi, _ = bound("maximum")
        lo_x = hi_x = False
        ex_lo, ex_hi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(ex_lo, bool) or isinstance(ex_hi, bool):
            lo_x, hi_x = bool(ex_lo), bool(ex_hi)
        else:
            if ex_lo is not None and (lo is None or Decimal(str(ex_lo)) >= Decimal(lo)):
                lo, lo_x = str(Decimal(str(ex_lo))), True
            if ex_hi is not None and (hi is None or Decimal(str(ex_hi)) <= Decimal(hi)):
                hi, hi_x = str(Decimal(str(ex_hi))), True
        spec = ("number", integer, lo, hi, lo_x, hi_x)
        _require_value(spec, f"{'integer' if integer else 'number'} in this range")
        digits = max((len(b.split(".")[0]) for b in (lo, hi) if b is not None), default=0)
        return Slot(spec, max(NUMBER_TOKENS, digits + 4), True)


def _within_count(lo: int, hi: Any, keyword: str) -> int | None:
    """The upper bound to enforce for a counted value (string length, item count): a minimum past
    :data:`MAX_COUNT` is refused; a maximum past it is lowered to it (every value written still satisfies the
    schema, as the generated strings being a subset of what it allows already is)."""
    if lo > MAX_COUNT:
        raise SchemaTooLarge(f"{keyword} {lo} is too large to enforce (at most {MAX_COUNT})")
    return None if hi is None else min(int(hi), MAX_COUNT)


def _num(integer: bool) -> tuple:
    return ("number", integer, None, None, False, False)


def _as_simple(pieces: list[Piece]) -> tuple | None:
    """The value spec of a compiled simple value (including its quotes), None for objects/arrays."""
    if len(pieces) == 1 and isinstance(pieces[0], Slot):
        return pieces[0].spec
    if len(pieces) == 1 and isinstance(pieces[0], str):
        text = pieces[0]
        if text.startswith("{") or text.startswith("["):
            return None
        return ("literals", (text,))
    if len(pieces) == 3 and pieces[0] == '"' and pieces[2] == '"' and isinstance(pieces[1], Slot):
        spec = pieces[1].spec
        return ("qstring",) if spec[1:] == (0, None, None) else ("qstring", *spec[1:])
    return None


def _quoted(spec: tuple) -> tuple:
    """The spec of a simple value as a whole JSON value (strings with their quotes)."""
    if spec[0] == "string":
        return ("qstring",) if spec[1:] == (0, None, None) else ("qstring", *spec[1:])
    if spec[0] == "union":
        return ("union", tuple(_quoted(s) for s in spec[1]))
    return spec


def _counted(spec: tuple) -> bool:
    if spec[0] in ("string", "qstring"):
        return len(spec) > 1 and (spec[1] > 0 or spec[2] is not None)
    if spec[0] == "union":
        return any(_counted(s) for s in spec[1])
    return False


def _budget_of(pieces: list[Piece]) -> int:
    return sum(p.budget if isinstance(p, Slot) else max(1, len(p) // 3) for p in pieces)


def _flatten(pieces: list[Piece]) -> tuple | None:
    """A compiled object/array as one ("seq", ...) value spec, or None if a part needs its own counter."""
    parts: list[tuple] = []
    for p in _merge(list(pieces)):
        if isinstance(p, str):
            parts.append(("lit", p))
        elif _counted(p.spec) or p.spec[0] == "array":
            return None
        else:
            parts.append(p.spec)
    return ("seq", tuple(parts))


def _merge(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] = out[-1] + p
        elif p != "":
            out.append(p)
    return out


def _first_bytes_disjoint(specs: list[tuple]) -> bool:
    from quicksilver.structured.values import build, first_bytes

    seen: set[int] = set()
    for spec in specs:
        auto = build(spec)
        firsts = first_bytes(auto) if auto is not None else set()
        if firsts & seen:
            return False
        seen |= firsts
    return True


def _require_value(spec: tuple, what: str) -> None:
    """UnsupportedSchema now (at compile time, so optional properties can be left out) if no value exists."""
    problem = _value_problem(spec)
    if problem == "none":
        raise UnsupportedSchema(f"no {what} exists")
    if problem is not None:  # its automaton would be too large
        raise SchemaTooLarge(f"{what}: {problem}")


@functools.lru_cache(maxsize=256)
def _value_problem(spec: tuple) -> str | None:
    """None if some value of ``spec`` exists; "none" if none does; else why its automaton is too large to enforce
    (a schema with many values of the same kind checks each kind once)."""
    from quicksilver.structured.automata import TooManyStates, check_counter, enumerate_states
    from quicksilver.structured.values import build

    auto = build(spec)
    if auto is None:
        return "none"
    try:
        check_counter(auto)
        states, nxt, inc = enumerate_states(auto)
    except TooManyStates as exc:
        return str(exc)
    # shortest accepted byte string with an acceptable count: BFS over (state, count) up to the bounds
    cap = (auto.count_max if auto.count_max is not None else auto.count_min) if auto.counted else 0
    seen = {(0, 0)}
    frontier = [(0, 0)]
    while frontier:
        nxt_frontier = []
        for s, c in frontier:
            if auto.accept(states[s]) and (not auto.counted or c >= auto.count_min):
                return None
            for b in range(256):
                t = int(nxt[s, b])
                if t < 0:
                    continue
                c2 = c + int(inc[s, b]) if auto.counted else 0
                if auto.count_max is not None and c2 > auto.count_max:
                    continue
                key = (t, min(c2, cap))
                if key not in seen:
                    seen.add(key)
                    nxt_frontier.append(key)
        frontier = nxt_frontier
    return "none"
