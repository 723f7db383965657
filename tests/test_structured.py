"""Structured output and tool calls: whatever a random model emits, the answer is valid."""

from __future__ import annotations

import json
import random
from decimal import Decimal

import jsonschema
import pytest
import torch

from quicksilver.decoding import Decoder
from quicksilver.sampling import SamplingParams
from quicksilver.structured import (
    UnsupportedSchema,
    auto_tool_constraint,
    constrained_text,
    json_object_constraint,
    json_schema_constraint,
    parse_tool_calls,
    tool_call_constraint,
)
from quicksilver.structured import values as V
from quicksilver.testing import tiny_model, tiny_tokenizer
from quicksilver.tokenizer import TOOL_CALLS

MODES = ["block_causal", "bidirectional", "causal"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def decoders(tok):
    return {mode: Decoder(tiny_model(mode, seed=3), tok) for mode in MODES}


SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
            "age": {"type": "integer", "minimum": -20, "maximum": 130},
            "score": {"type": "number", "exclusiveMinimum": -1.5, "maximum": 2.25},
            "ok": {"type": "boolean"},
            "nothing": {"type": "null"},
        },
        "required": ["name", "age", "score", "ok", "nothing"],
        "additionalProperties": False,
    },
    "nested_arrays_enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue", 7, None]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
            "points": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "nick": {"type": ["string", "null"]}},
                "required": ["id", "nick"],
                "additionalProperties": False,
            },
            "items": {"type": "array", "minItems": 2, "maxItems": 2,
                      "items": {"type": "object", "properties": {"k": {"type": "number"}}, "required": ["k"]}},
        },
        "required": ["color", "tags", "points", "owner", "items"],
        "additionalProperties": False,
    },
    "optional_refs_escapes": {
        "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
        "type": "object",
        "properties": {
            'qu"ote\\key': {"const": 'a "quoted"\nline'},
            "unit": {"$ref": "#/$defs/unit"},
            "maybe": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]},
            "free": {},
            "text": {"type": "string"},
            "ünï": {"type": "number"},
        },
        "required": ["unit"],
    },
    "unions": {
        "type": "object",
        "properties": {
            "nick": {"type": ["string", "null"], "minLength": 2, "maxLength": 4},
            "id": {"oneOf": [{"type": "string"}, {"type": "integer", "minimum": 0}]},
            "pair": {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 2, "maxItems": 2},
            "opt": {"type": "number", "nullable": True},
        },
        "required": ["nick", "id", "pair", "opt"],
    },
    "patterns_formats": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2,3}$"},
            "loose": {"type": "string", "pattern": "ab|c\\.d", "maxLength": 6},
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "codes": {"type": "array", "items": {"type": "string", "pattern": "^x+$"}, "maxItems": 2},
        },
        "required": ["code", "loose", "day", "id", "codes"],
        "additionalProperties": False,
    },
    "object_arrays_anyof": {
        "type": "object",
        "properties": {
            "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"], "additionalProperties": False}},
            "pay": {"anyOf": [
                {"type": "object", "properties": {"card": {"type": "string"}}, "required": ["card"]},
                {"type": "object", "properties": {"iban": {"enum": ["A", "B"]}}, "required": ["iban"]},
                {"type": "null"}]},
        },
        "required": ["lines", "pay"],
    },
    "top_level_array": {"type": "array", "items": {"type": "number", "minimum": 0.5, "maximum": 3}, "minItems": 2},
    "top_level_enum": {"enum": ["alpha", "beta", "gamma"]},
}


def _decode(decoder, constraint, seed, **kw):
    params = SamplingParams(**{"max_tokens": 120, "temperature": 1.0, "seed": seed, **kw})
    state = decoder.start(decoder.tokenizer.encode("Answer in JSON:"), params, constraint)
    decoder.run(state)
    return state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_models_always_produce_valid_json(decoders, tok, mode, name):
    schema = SCHEMAS[name]
    for seed in range(3):
        c = json_schema_constraint(schema, tok)
        state = _decode(decoders[mode], c, seed)
        text, value = constrained_text(state, tok)
        assert state.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        assert value == json.loads(text)


@pytest.mark.parametrize("layout", ["lazy", "fixed"])
def test_optional_properties_may_be_left_out(decoders, tok, layout):
    """Optional simple properties after a written one are the model's choice: random models write some and leave
    out others, always valid; a required one is always there."""
    schema = {"type": "object", "properties": {
        "id": {"type": "integer"}, "note": {"type": "string"}, "unit": {"enum": ["cm", "inch"]},
        "score": {"type": "number"}}, "required": ["id"]}
    seen: dict[str, int] = {}
    runs = 0
    for mode in MODES:
        for seed in range(6):
            state = _decode(decoders[mode], json_schema_constraint(schema, tok, layout=layout), seed)
            text, value = constrained_text(state, tok)
            jsonschema.validate(value, schema)
            assert "id" in value
            for key in value:
                seen[key] = seen.get(key, 0) + 1
            runs += 1
    optional_counts = [seen.get(k, 0) for k in ("note", "unit", "score")]
    assert any(0 < c < runs for c in optional_counts), seen  # written in some answers, left out in others


@pytest.mark.parametrize("mode", MODES)
def test_aggressive_policies_and_self_correction_stay_valid(decoders, tok, mode):
    """threshold 0 commits every position in one step (joint feasibility), self-correction revises."""
    schema = SCHEMAS["nested_arrays_enums"]
    variants = [
        {"threshold": 0.0},
        {"policy": "low_confidence", "steps_per_block": 2},
        {"policy": "margin", "margin": 0.0, "remask_threshold": 0.5, "edit_threshold": 0.1},
        {"temperature": 0.0},
    ]
    for i, kw in enumerate(variants):
        c = json_schema_constraint(schema, tok)
        state = _decode(decoders[mode], c, seed=10 + i, max_tokens=150, **kw)
        text, _ = constrained_text(state, tok)
        jsonschema.validate(json.loads(text), schema)


def test_batched_steps_with_mixed_constraints(decoders, tok):
    """The engine path: one Decoder.step over several constrained and free states."""
    dec = decoders["block_causal"]
    schema = SCHEMAS["flat"]
    states = [dec.start(tok.encode("x"), SamplingParams(max_tokens=80, temperature=1.0, seed=s),
                        json_schema_constraint(schema, tok) if s % 2 == 0 else None) for s in range(4)]
    while not all(s.finished for s in states):
        dec.step(states)
    for s in states[::2]:
        jsonschema.validate(json.loads(tok.decode(s.answer_ids)), schema)


def test_skeleton_is_pinned_and_saves_forwards(decoders, tok):
    from types import SimpleNamespace

    from quicksilver.structured import compare_pinned_vs_free

    loaded = SimpleNamespace(model=decoders["causal"].model, tokenizer=tok, defaults=SamplingParams())
    schema = SCHEMAS["flat"]
    row = compare_pinned_vs_free(loaded, schema, "Describe a person", max_tokens=80, chat=False)
    assert row["pinned"]["valid"]
    # a causal model spends one forward per free token: pinned tokens cost none
    assert row["free"]["forwards"] == row["answer_tokens"]
    assert row["free_json_length"]["forwards"] == row["json_tokens"]
    # at most one forward per slot position (forced positions, e.g. the rest of a filler run, cost none)
    assert row["pinned"]["forwards"] <= row["slot_tokens"]
    assert row["pinned"]["forwards"] < row["free_json_length"]["forwards"] <= row["free"]["forwards"]
    text = json_schema_constraint(schema, tok)
    state = decoders["causal"].start(tok.encode("x"), SamplingParams(max_tokens=80), text)
    head = tok.encode('{"name": "')
    pl = state.prompt_len
    assert state.tokens[pl : pl + len(head)].tolist() == head  # pinned before any forward
    assert bool(state.fixed[pl : pl + len(head)].all()) and state.stats.forwards == 0


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "ping"}},
]


@pytest.mark.parametrize("mode", MODES)
def test_tool_choice_required_and_named_give_valid_calls(decoders, tok, mode):
    seen = set()
    for seed in range(4):
        c = tool_call_constraint(TOOLS, "required", tok)
        state = _decode(decoders[mode], c, seed)
        text, calls = constrained_text(state, tok)
        assert tok.decode(state.answer_ids, skip_special_tokens=False).startswith("<|tool_calls|>")
        assert parse_tool_calls(text, TOOLS) == calls
        assert len(calls) == 1
        seen.add(calls[0]["name"])
    assert seen <= {"get_weather", "add", "ping"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    state = _decode(decoders[mode], tool_call_constraint(TOOLS, named, tok), 7)
    _, calls = constrained_text(state, tok)
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(calls[0]["arguments"], TOOLS[0]["function"]["parameters"])


def test_tool_choice_none_auto_and_bad_input(tok):
    assert tool_call_constraint(TOOLS, "none", tok) is None
    assert tool_call_constraint(TOOLS, "auto", tok) is None
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}}, tok)
    with pytest.raises(ValueError, match="tool_choice"):
        tool_call_constraint(TOOLS, "sometimes", tok)
    with pytest.raises(ValueError, match="tools"):
        tool_call_constraint([{"type": "function"}], "required", tok)


def test_parse_tool_calls():
    good = '<|tool_calls|>[{"name": "add", "arguments": {"a": 1, "b": 2.5}}]'
    assert parse_tool_calls(good, TOOLS) == [{"name": "add", "arguments": {"a": 1, "b": 2.5}}]
    assert parse_tool_calls('[{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}]', TOOLS) == [
        {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_tool_calls("The weather is nice.", TOOLS) is None
    assert parse_tool_calls('[{"name": "add", "arguments": {"a": "x", "b": 1}}]', TOOLS) is None  # bad type
    assert parse_tool_calls('[{"name": "rm_rf", "arguments": {}}]', TOOLS) is None  # unknown tool
    assert parse_tool_calls('[{"name": "add", "arguments": {"a": 1', TOOLS) is None  # truncated


@pytest.mark.parametrize("schema, feature", [
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern"),
    ({"type": "string", "pattern": "(?=a)a"}, "pattern"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"not": {"type": "null"}}, "not"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "array"}]}, "oneOf"),
    ({"anyOf": [{"type": "string", "maxLength": 3}, {"enum": ["hello", "x"]}]}, "length-bounded"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "same JSON type"),
    ({"type": "string", "format": "hostname"}, "format"),
    ({"type": "object", "properties": {}, "required": ["ghost"]}, "ghost"),
    ({"$ref": "https://example.com/s.json"}, "local"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
      "$ref": "#/$defs/n"}, "recursive"),
])
def test_unsupported_schemas_raise(tok, schema, feature):
    with pytest.raises(UnsupportedSchema, match=feature):
        json_schema_constraint(schema, tok, max_tokens=64)


def test_optional_property_that_cannot_be_enforced_is_left_out(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "pattern": "(?=x)"},
                                               "c": False}, "required": ["a"]}
    c = json_schema_constraint(schema, tok, max_tokens=32)
    text = tok.decode([t for t in c.plan(32).head.tokens if t >= 0])
    assert '"a": ' in text and '"b"' not in text and '"c"' not in text
    tree = {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/n"}}}, "required": ["v"]}}, "$ref": "#/$defs/n"}
    c = json_schema_constraint(tree, tok, max_tokens=32)  # the recursive optional branch is left out
    assert tok.decode([t for t in c.plan(32).head.tokens if t >= 0]).startswith('{"v": ')


def test_format_is_an_annotation_when_not_strict(tok):
    c = json_schema_constraint({"type": "string", "format": "hostname"}, tok, strict=False, max_tokens=16)
    assert c.skeleton_length(16) <= 16


def test_too_small_canvas_is_a_clear_error(decoders, tok):
    schema = SCHEMAS["flat"]
    with pytest.raises(ValueError, match="max_tokens is 10"):
        json_schema_constraint(schema, tok, max_tokens=10)
    c = json_schema_constraint(schema, tok)  # no size given: checked when decoding starts
    with pytest.raises(ValueError, match="max_tokens"):
        decoders["block_causal"].start(tok.encode("x"), SamplingParams(max_tokens=10), c)
    with pytest.raises(ValueError, match="max_tokens is too small"):
        tool_call_constraint(TOOLS[:2], "required", tok, max_tokens=12)
    with pytest.raises(ValueError, match="stop"):
        decoders["block_causal"].start(tok.encode("x"), SamplingParams(max_tokens=64, stop=("}",)), c)


def test_slots_shrink_to_fit_a_tight_canvas(decoders, tok):
    schema = SCHEMAS["flat"]
    c = json_schema_constraint(schema, tok)
    tight = c.skeleton_length(None) - 8  # unsized layout minus a few tokens: flexible slots give way
    state = _decode(decoders["bidirectional"], json_schema_constraint(schema, tok, max_tokens=tight), 1,
                    max_tokens=tight)
    assert len(state.answer_ids) <= tight
    jsonschema.validate(json.loads(tok.decode(state.answer_ids)), schema)


@pytest.mark.parametrize("mode", MODES)
def test_json_object_mode(decoders, tok, mode):
    for seed, max_tokens in [(0, 40), (1, 12), (2, 6), (3, 2)]:
        c = json_object_constraint(tok)
        state = _decode(decoders[mode], c, seed, max_tokens=max_tokens)
        text, value = constrained_text(state, tok)
        assert isinstance(json.loads(text), dict)
        assert len(state.answer_ids) <= max_tokens


# -- the value automata themselves ---------------------------------------------------------------------------
def _accepts(auto, data: bytes) -> bool:
    s, count = auto.start, 0
    for b in data:
        r = auto.step(s, b)
        if r is None:
            return False
        s, count = r[0], count + r[1]
    if not auto.accept(s):
        return False
    return not auto.counted or (count >= auto.count_min and (auto.count_max is None or count <= auto.count_max))


@pytest.mark.parametrize("integer, lo, hi, lo_x, hi_x", [
    (False, None, None, False, False), (True, "-5", "12", False, False), (False, "0", "1", False, True),
    (False, "-2.5", "3.75", True, False), (False, None, "-0.5", False, False), (True, "100", "1000", False, False),
    (False, "0.25", "0.25", False, False), (False, "-1", "0", False, True), (True, "3", None, True, False),
])
def test_number_automaton_agrees_with_json_and_bounds(integer, lo, hi, lo_x, hi_x):
    auto = V.number(integer, lo, hi, lo_x, hi_x)
    rng = random.Random(0)
    for _ in range(1500):
        text = "".join(rng.choice("-0123456789.e+") for _ in range(rng.randint(1, 5)))
        try:
            value = json.loads(text)
            ok = isinstance(value, int if integer else (int, float))
        except ValueError:
            ok = False
        if ok:
            d = Decimal(text)
            bounded = lo is not None or hi is not None
            ok = not (lo is not None and (d < Decimal(lo) or (lo_x and d == Decimal(lo))))
            ok = ok and not (hi is not None and (d > Decimal(hi) or (hi_x and d == Decimal(hi))))
            if text.startswith("-") and d == 0:
                continue  # "-0" may be accepted or not: never needed
            if bounded and "e" in text:
                assert not _accepts(auto, text.encode())  # bounded numbers are written without exponent
                continue
        assert _accepts(auto, text.encode()) == ok, text


def test_string_automaton():
    plain = V.string_content()
    for text, ok in [(b"abc", True), (b'a"b', False), (b'a\\"b', True), (b"\\u00e9", True), (b"\\ud83d", False),
                     ("é".encode(), True), (b"\xc3", False), (b"\n", False), (b"\\x", False), (b"", True)]:
        assert _accepts(plain, text) == ok, text
    bounded = V.string_content(2, 3)
    for text in [b"a", b"ab", b"\\n\\t", b"abcd", "éé".encode(), "éééé".encode(), b"\\u0041bc"]:
        assert _accepts(bounded, text) == (2 <= len(json.loads(b'"' + text + b'"')) <= 3), text


@pytest.mark.parametrize("spec", [("qstring",), ("qstring", 2, 40, None), ("number", True, "-5", "900", False, False)])
def test_slot_solver_masks_over_long_free_runs_match_a_plain_walk(tok, spec):
    """The solver stops walking a free run once a position leaves the reachable set unchanged (wide lazy slots):
    its masks must equal those of a walk over every position."""
    from quicksilver.structured.automata import SlotSolver
    from quicksilver.structured.layout import automaton_for
    from quicksilver.structured.lexicon import lexicon_for

    auto = automaton_for(spec, lexicon_for(tok))
    solver = SlotSolver(auto)

    def plain(cols, i):
        fwd = auto.initial()
        for c in cols[:i]:
            fwd = auto.forward_free(fwd) if c < 0 else auto.forward_token(fwd, c)
        bwd = auto.final()
        for c in reversed(cols[i + 1:]):
            bwd = auto.backward_free(bwd) if c < 0 else auto.backward_token(bwd, c)
        return auto.allowed_columns(fwd, bwd)

    rng = random.Random(0)
    for _ in range(12):
        length = rng.randint(1, 60)
        cols = [-1] * length
        for _ in range(rng.randint(0, 4)):  # a few committed tokens that keep the slot completable
            pos = rng.randrange(length)
            allowed = solver.masks(cols, [pos])[pos]
            choices = [c for c in range(len(allowed)) if allowed[c] and c != auto.filler_col]
            if choices:
                cols[pos] = rng.choice(choices)
        free = [i for i, c in enumerate(cols) if c < 0]
        for i, mask in solver.masks(cols, free).items():
            assert (mask == plain([c if j != i else -1 for j, c in enumerate(cols)], i)).all(), (cols, i)


@pytest.mark.parametrize("layout", ["fixed", "lazy"])
def test_filler_that_is_a_stop_token_does_not_end_the_answer(tok, layout):
    """Trained models list the rainbow pads (our slot filler) as stop tokens."""
    pads = [tok.token_id(f"<|pad_{i}|>") for i in range(8)]
    dec = Decoder(tiny_model("block_causal", seed=5, stop_token_ids=pads), tok)
    schema = SCHEMAS["flat"]
    for seed in range(3):
        state = _decode(dec, json_schema_constraint(schema, tok, layout=layout), seed)
        text, _ = constrained_text(state, tok)
        assert state.finish_reason == "stop"
        jsonschema.validate(json.loads(text), schema)
        if layout == "fixed":
            assert pads[0] in state.answer_ids  # the filler was used and the answer went on past it
        else:  # lazy: the filler only ever says "value over"; it never lands in the answer
            assert pads[0] not in state.answer_ids


@pytest.mark.parametrize("pattern", [r"^[A-Z]{2}-\d{2,3}$", r"ab|c\.d", r"^(x|yz)*q?$", r"\w+@\w+", r"^[^a-c]{0,2}$"])
def test_pattern_automaton_agrees_with_re_search(pattern):
    import re

    from quicksilver.structured.regex import pattern_content

    auto = pattern_content(pattern)
    rng = random.Random(1)
    alphabet = ['A', 'B', 'x', 'y', 'z', 'q', 'a', 'b', 'c', 'd', '.', '-', '@', '1', '2', '\\n', '\\"', ' ']
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        value = json.loads('"' + text + '"')
        got, want = _accepts(auto, text.encode()), bool(re.search(pattern, value))
        if want and value.endswith("\n") and pattern.endswith("$"):
            continue  # Python's $ also matches before a final newline; we never need that
        assert got == want, (pattern, text)


# -- fuzzing: random schemas x random models x random decoding settings ---------------------------------------
def _maybe(rng: random.Random, p: float, schema: dict, key: str, value) -> None:
    if rng.random() < p:
        schema[key] = value


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "anyof", "typelist"]
    if depth < 2:
        kinds += ["object", "object", "array", "array"]
    k = rng.choice(kinds)
    if k == "string":
        s: dict = {"type": "string"}
        _maybe(rng, 0.3, s, "minLength", rng.randint(0, 3))
        _maybe(rng, 0.3, s, "maxLength", s.get("minLength", 0) + rng.randint(0, 5))
        _maybe(rng, 0.2, s, "pattern", rng.choice(["^[a-z]+$", "x", "^\\d{3}$", "^(ab|cd)*$"]))
        _maybe(rng, 0.1, s, "format", rng.choice(["date", "uuid", "date-time", "email", "ipv4", "time"]))
        return s
    if k in ("integer", "number"):
        s = {"type": k}
        _maybe(rng, 0.5, s, "minimum", rng.choice([-10, 0, 1, 2.5, -0.5, 100]))
        _maybe(rng, 0.5, s, "maximum", s.get("minimum", 0) + rng.choice([0, 1, 3.25, 50, 1000]))
        _maybe(rng, 0.2, s, "exclusiveMinimum", s.get("minimum", -3) - rng.choice([0, 1]))
        _maybe(rng, 0.2, s, "exclusiveMaximum", s.get("maximum", 7) + rng.choice([0, 1]))
        return s
    if k in ("boolean", "null"):
        return {"type": k}
    if k == "enum":
        values = ["a", "b c", 'q"uote', 1, 2.5, None, True, [1, 2], {"k": "v"}]
        return {"enum": rng.sample(values, rng.randint(1, 4))}
    if k == "const":
        return {"const": rng.choice(["x", 3, None, {"a": [1]}])}
    if k == "anyof":
        return {"anyOf": [_random_schema(rng, 2) for _ in range(rng.randint(1, 3))]}
    if k == "typelist":
        return {"type": rng.sample(["string", "integer", "null", "boolean", "number"], rng.randint(1, 3))}
    if k == "object":
        props = {(f"k{i}" if rng.random() < 0.8 else f'ключ{i}"'): _random_schema(rng, depth + 1)
                 for i in range(rng.randint(0, 4))}
        s = {"type": "object", "properties": props, "required": [p for p in props if rng.random() < 0.7]}
        _maybe(rng, 0.5, s, "additionalProperties", False)
        return s
    s = {"type": "array", "items": _random_schema(rng, depth + 1)}
    _maybe(rng, 0.5, s, "minItems", rng.randint(0, 2))
    _maybe(rng, 0.5, s, "maxItems", s.get("minItems", 0) + rng.randint(0, 3))
    _maybe(rng, 0.1, s, "uniqueItems", True)
    return s


def test_fuzzed_schemas_are_valid_or_cleanly_unsupported(decoders, tok):
    rng = random.Random(1234)
    decoded = 0
    for i in range(40):
        schema = _random_schema(rng)
        mode = MODES[i % 3]
        kw = rng.choice([{}, {"threshold": 0.0}, {"policy": "low_confidence", "steps_per_block": 2},
                         {"remask_threshold": 0.3, "edit_threshold": 0.05}])
        try:
            c = json_schema_constraint(schema, tok, strict=bool(i % 2))
        except UnsupportedSchema:
            continue
        state = _decode(decoders[mode], c, i, max_tokens=160, **kw)
        text, _ = constrained_text(state, tok)
        jsonschema.validate(json.loads(text), schema)
        decoded += 1
    assert decoded >= 30


def test_slot_filler_is_not_counted_as_output_tokens(tok):
    from quicksilver.decoding import Decoder
    from quicksilver.sampling import SamplingParams
    from quicksilver.structured import json_schema_constraint
    from quicksilver.testing import tiny_model

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    dec = Decoder(tiny_model("block_causal"), tok)
    constraint = json_schema_constraint(schema, tok, max_tokens=48, layout="fixed")
    result = dec.generate("weather?", SamplingParams(max_tokens=48), constraint)
    filler = constraint.lex.filler_id
    assert filler in result.token_ids  # a random model leaves most of the slot empty
    assert result.stats.tokens == sum(1 for t in result.token_ids if t != filler)


@pytest.mark.parametrize("layout", ["lazy", "fixed"])
def test_auto_tool_choice_pins_the_call_in_either_layout(tok, layout):
    """A model that opens with the tool-call marker gets its call pinned; with the fixed layout the skeleton's
    pins must be written too (they once were dropped and decoding never advanced)."""
    model = tiny_model("causal", seed=1, tie_word_embeddings=False)
    marker = tok.token_id(TOOL_CALLS)
    with torch.no_grad():  # point the marker's output row along the model's mean hidden state
        ids = torch.randint(5, 300, (1, 64), generator=torch.Generator().manual_seed(0))
        direction = model(ids)[0][0].mean(0)
        model.lm_head.weight[marker] = 50 * direction / direction.norm()
    dec = Decoder(model, tok)
    c = auto_tool_constraint(TOOLS, tok, max_tokens=90, layout=layout)
    state = dec.start(tok.encode("Answer in JSON:"), SamplingParams(max_tokens=90), c)
    for _ in range(200):
        if state.finished:
            break
        dec.step([state])
    assert state.finished
    assert state.answer_ids[0] == marker
    calls = parse_tool_calls(dec.result(state).text, TOOLS)
    assert calls and len(calls) == 1
