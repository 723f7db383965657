"""Skeleton layout: slots meet pinned text at the tokenizer's own boundaries; the lazy layout keeps slack out.

Uses the shipped AR twin's tokenizer (a real 4k byte-level BPE that writes ``"age": 52`` as ``'":', ' 52'``)
and the shipped AR twin itself for the end-to-end check.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from quicksilver.decoding import Decoder
from quicksilver.sampling import SamplingParams
from quicksilver.structured import constrained_text, json_schema_constraint, tool_call_constraint
from quicksilver.testing import tiny_model, tiny_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "price": {"type": "number"},
        "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "dark blue"]},
        "tags": {"type": "array", "items": {"type": "string"}}, "n": {"type": "integer", "minimum": -5},
    },
    "required": ["name", "age", "price", "ok", "color", "tags", "n"],
    "additionalProperties": False,
}
VALUES = [
    {"name": "Kara Khan", "age": 1901, "price": 3.25, "ok": True, "color": "red", "tags": ["a b", "c"], "n": -3},
    {"name": "Paris", "age": 52, "price": 200.99, "ok": False, "color": "dark blue", "tags": ["x"], "n": 0},
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "set_timer", "parameters": {
        "type": "object", "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]}}},
]


@pytest.fixture(scope="module")
def ar_twin():
    from quicksilver.loading import load_model

    return load_model("ar-twin")


def _split_like_layout(layout, ids: list[int]) -> list[list[int]]:
    """Cut the canonical token ids where the layout has slots: pinned runs must match exactly; each slot takes
    the tokens up to the next pinned run. Returns the tokens of each slot."""
    runs: list[list[int] | None] = []  # pinned runs and None for slots, in order
    for i, t in enumerate(layout.tokens):
        if t < 0:
            if i == 0 or layout.tokens[i - 1] >= 0:
                runs.append(None)
        elif i == 0 or layout.tokens[i - 1] < 0:
            runs.append([t])
        else:
            runs[-1].append(t)
    k, slots = 0, []
    for j, run in enumerate(runs):
        if run is not None:
            assert ids[k : k + len(run)] == run, (ids[k : k + len(run)], run)
            k += len(run)
            continue
        nxt = runs[j + 1] if j + 1 < len(runs) else None
        end = len(ids) if nxt is None else next(e for e in range(k + 1, len(ids)) if ids[e : e + len(nxt)] == nxt)
        slots.append(ids[k:end])
        k = end
    assert k == len(ids)
    return slots


def _slot_accepts(slot, toks: list[int]) -> bool:
    a = slot.automaton
    if any(t not in a.col_of for t in toks) or len(toks) > slot.length:
        return False
    return slot.solver.feasible([a.col_of[t] for t in toks] + [a.filler_col] * (slot.length - len(toks)))


@pytest.mark.parametrize("value", VALUES)
def test_pinned_tokens_and_slots_follow_the_tokenizers_segmentation(ar_twin, value):
    """The canonical text (json.dumps layout) tokenized whole splits exactly at the layout's slot edges, and
    each slot's automaton accepts its natural tokens: ints, floats, strings, enums, booleans, arrays."""
    tok = ar_twin.tokenizer
    layout = json_schema_constraint(SCHEMA, tok, layout="fixed").plan(None).head
    ids = tok.encode(json.dumps(value))
    slots = _split_like_layout(layout, ids)
    assert len(slots) == len(layout.slots)
    for slot, toks in zip(layout.slots, slots, strict=True):
        assert _slot_accepts(slot, toks), [tok.backend.id_to_token(t) for t in toks]
    # the defect this fixes: nothing pinned ends in a lone space (" 52" is one token for this tokenizer)
    space = tok.encode(" ")
    assert all(t != space[0] for t in layout.tokens)


def test_tool_call_skeleton_follows_the_tokenizers_segmentation(ar_twin):
    tok = ar_twin.tokenizer
    call = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]
    text = "<|tool_calls|>" + json.dumps(call)
    ids = tok.encode(text)
    one = tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, tok,
                               layout="fixed").plan(None).head
    for slot, toks in zip(one.slots, _split_like_layout(one, ids), strict=True):
        assert _slot_accepts(slot, toks)
    plan = tool_call_constraint(TOOLS, "required", tok, layout="fixed").plan(None)
    head_len = len(plan.head.tokens)
    name_slot = plan.head.slots[-1]
    tail = next(t for k, t in plan.tails.items() if "get_weather" in k)
    pinned_head = [t for t in plan.head.tokens if t >= 0]
    assert ids[: len(pinned_head)] == pinned_head
    rest = ids[len(pinned_head) :]
    first_pinned = next(t for t in tail.tokens if t >= 0)
    cut = rest.index(first_pinned)
    assert _slot_accepts(name_slot, rest[:cut]) and head_len == len(pinned_head) + name_slot.length
    for slot, toks in zip(tail.slots, _split_like_layout(tail, rest[cut:]), strict=True):
        assert _slot_accepts(slot, toks)


@pytest.mark.parametrize("mode", ["block_causal", "bidirectional", "causal"])
def test_lazy_layout_keeps_filler_out_and_always_validates(mode):
    tok = tiny_tokenizer()
    dec = Decoder(tiny_model(mode, seed=4), tok)
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "nick": {"type": ["string", "null"], "maxLength": 3}},
              "required": [*SCHEMA["required"], "nick"]}
    fillers = 0
    for seed in range(4):
        for constraint, check in (
            (json_schema_constraint(schema, tok), lambda v: jsonschema.validate(v, schema)),
            (tool_call_constraint(TOOLS, "required", tok), None),
        ):
            params = SamplingParams(max_tokens=96, temperature=1.0, seed=seed)
            state = dec.start(tok.encode("JSON:"), params, constraint)
            dec.run(state)
            text, value = constrained_text(state, tok)
            if check is not None:
                check(value)
            assert constraint.lex.filler_id not in state.answer_ids  # no slack anywhere in the answer
            assert state.finish_reason == "stop"
            fixed = json_schema_constraint(schema, tok, layout="fixed")
            fstate = dec.start(tok.encode("JSON:"), params, fixed)
            dec.run(fstate)
            constrained_text(fstate, tok)
            fillers += fstate.answer_ids.count(fixed.lex.filler_id)
    assert fillers > 0  # the fixed layout on the same requests does pad inside the answer


def test_lazy_constraint_leaves_a_causal_models_valid_answer_unchanged(ar_twin):
    """The shipped AR twin writes these JSON answers validly on its own: under the lazy skeleton (pinned
    text exactly as the tokenizer writes it, no filler) greedy decoding gives the same tokens."""
    from quicksilver.evaluate import eval_examples
    from quicksilver.tasks import render_prompt

    tok = ar_twin.tokenizer
    dec = Decoder(ar_twin.model, tok, ar_twin.defaults)
    params = ar_twin.defaults.replace(max_tokens=64, temperature=0.0)
    checked = 0
    for ex in eval_examples("json", 6):
        ids = tok.encode(render_prompt(ex, tok))
        free = dec.run(dec.start(ids, params))
        schema = ex.answer["schema"]
        try:
            jsonschema.validate(json.loads(free.text), schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        lazy = dec.run(dec.start(ids, params, json_schema_constraint(schema, tok, max_tokens=64)))
        assert lazy.text == free.text
        assert lazy.stats.forwards < free.stats.forwards  # pinned skeleton text still costs no forward
        checked += 1
    assert checked >= 3


def test_auto_tool_choice_decides_then_constrains():
    """tool_choice="auto": a call started with <|tool_calls|> is always valid; otherwise free text without the
    marker. A tiny random model never starts a call, so one variant pushes the marker at the first position."""
    from quicksilver.structured import auto_tool_constraint, parse_tool_calls
    from quicksilver.structured.tools import AutoToolConstraint

    class Eager(AutoToolConstraint):
        def mask_logits(self, state, positions, logits):
            if self._mode[state] == "undecided":
                logits[positions == state.prompt_len, self.marker] += 100.0
            return super().mask_logits(state, positions, logits)

    tok = tiny_tokenizer()
    marker = tok.token_id("<|tool_calls|>")
    calls = 0
    for mode in ["block_causal", "bidirectional", "causal"]:
        dec = Decoder(tiny_model(mode, seed=4), tok)
        for seed in range(3):
            for eager in (False, True):
                c = auto_tool_constraint(TOOLS, tok, max_tokens=64)
                if eager:
                    c = Eager(c.calls, c.marker)
                params = SamplingParams(max_tokens=64, temperature=1.0, seed=seed)
                ids = dec.run(dec.start(tok.encode("hi"), params, c)).token_ids
                if eager:
                    assert ids[0] == marker and ids.count(marker) == 1
                    assert parse_tool_calls(tok.decode(ids[1:]), TOOLS) is not None
                    assert c.lex.filler_id not in ids
                    calls += 1
                else:
                    assert marker not in ids[1:]  # no malformed call halfway through a free answer
    assert calls == 9
    # tools whose call cannot fit the canvas: auto stays free (never a refusal)
    assert auto_tool_constraint(TOOLS, tok, max_tokens=4) is None


def test_constraint_factory_constrains_auto_by_default():
    from quicksilver.structured.request import constraint_factory
    from quicksilver.structured.tools import AutoToolConstraint

    tok = tiny_tokenizer()
    for choice in ("auto", None):  # an unset tool_choice with tools means "auto", as in OpenAI's API
        make = constraint_factory(tok, tools=TOOLS, tool_choice=choice, max_tokens=64)
        assert isinstance(make(), AutoToolConstraint)
    assert constraint_factory(tok, tools=TOOLS, tool_choice="auto", max_tokens=64, constrain_auto=False) is None
    assert constraint_factory(tok, tools=TOOLS, tool_choice="none", max_tokens=64) is None


def test_lazy_string_slots_take_the_room_left_and_stay_within_max_tokens():
    """An open-length value is not cut at a default width in the lazy layout: it may use every position the
    rest of the skeleton does not need (a random model rarely ends a string early), and the answer still fits
    ``max_tokens`` and validates."""
    from quicksilver.structured.schema import STRING_TOKENS

    tok = tiny_tokenizer()
    tools = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["text", "n"]}}}]
    longest = 0
    for mode in ["block_causal", "causal"]:
        dec = Decoder(tiny_model(mode, seed=4), tok)
        for seed in range(3):
            constraint = tool_call_constraint(tools, "required", tok, max_tokens=96)
            state = dec.start(tok.encode("note:"), SamplingParams(max_tokens=96, temperature=1.0, seed=seed),
                              constraint)
            dec.run(state)
            assert len(state.answer_ids) <= 96
            text, calls = constrained_text(state, tok)
            args = calls[0]["arguments"]
            assert isinstance(args["text"], str) and isinstance(args["n"], int)
            longest = max(longest, constraint._runs[state].layout.slots[0].length)  # the value's canvas tokens
    assert longest > 2 * STRING_TOKENS  # wider than the slot's default width doubled (the old cap)


def test_long_tool_argument_is_written_in_full_under_the_constraint():
    """The shipped default writes this run_python call (code longer than a default slot) on its own; the tool
    constraint the server applies gives the same call rather than cutting the code short."""
    from quicksilver.agent.loop import SYSTEM_PROMPT
    from quicksilver.loading import load_model
    from quicksilver.structured import auto_tool_constraint, parse_tool_calls
    from quicksilver.structured.schema import STRING_TOKENS
    from quicksilver.tasks.agent_steps import tool_schema

    loaded = load_model("default")
    tok = loaded.tokenizer
    tools = [tool_schema("run_python")]
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Use Python to count the prime numbers below 1000 and report the count."}]
    ids = tok.encode(tok.apply_chat_template(messages, tools=tools))
    dec = Decoder(loaded.model, tok, loaded.defaults)
    params = loaded.defaults.replace(max_tokens=192)
    free = dec.run(dec.start(ids, params))
    constrained = dec.run(dec.start(ids, params, auto_tool_constraint(tools, tok, max_tokens=192)))
    marker = tok.token_id("<|tool_calls|>")
    want = parse_tool_calls(tok.decode(free.token_ids[1:]), tools)
    got = parse_tool_calls(tok.decode(constrained.token_ids[1:]), tools)
    assert free.token_ids[0] == marker and want is not None
    code = json.loads(want[0]["arguments"])["code"] if isinstance(want[0]["arguments"], str) \
        else want[0]["arguments"]["code"]
    assert len(tok.encode(code)) > 2 * STRING_TOKENS
    assert got == want


def test_optional_arguments_are_the_models_choice(ar_twin):
    """An optional argument is written when the model writes it and left out when it does not: on held-out
    tool_call prompts, every call the shipped twin writes validly on its own comes out the same under the tool
    constraint (before, optional arguments were always written: `"unit": "celsius"` nobody asked for)."""
    from quicksilver.evaluate import eval_examples
    from quicksilver.structured import auto_tool_constraint, parse_tool_calls
    from quicksilver.tasks import render_prompt

    tok = ar_twin.tokenizer
    dec = Decoder(ar_twin.model, tok, ar_twin.defaults)
    params = ar_twin.defaults.replace(max_tokens=96, temperature=0.0)
    with_unit = without_unit = 0
    for ex in eval_examples("tool_call", 60):
        if not isinstance(ex.answer, list) or ex.answer[0]["name"] != "get_weather":
            continue
        ids = tok.encode(render_prompt(ex, tok))
        free = parse_tool_calls(dec.run(dec.start(ids, params)).text.split("<|tool_calls|>")[-1], ex.tools)
        if not free:
            continue
        out = dec.run(dec.start(ids, params, auto_tool_constraint(ex.tools, tok, max_tokens=96)))
        assert parse_tool_calls(tok.decode(out.token_ids[1:]), ex.tools) == free
        has_unit = "unit" in free[0]["arguments"]
        with_unit += has_unit
        without_unit += not has_unit
    assert with_unit >= 1 and without_unit >= 1
