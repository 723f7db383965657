"""Tool calls: a pinned ``<|tool_calls|>[{"name": ..., "arguments": {...}}]`` skeleton, and parsing.

The text layout matches the chat template (``tool_calls | tojson``: ``json.dumps`` default separators).
With one possible tool everything but the argument values is pinned; with several the model first fills
the name slot (one of the tool names), then that tool's arguments skeleton is pinned behind it.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from typing import TYPE_CHECKING, Any

import jsonschema
import torch

from quicksilver.decoding.constraints import Constraint
from quicksilver.structured.constraint import Plan, StructuredConstraint, StructuredOutputError
from quicksilver.structured.layout import lay_out
from quicksilver.structured.lexicon import Lexicon
from quicksilver.structured.schema import Piece, SchemaCompiler, Slot, UnsupportedSchema, dumps
from quicksilver.structured.segmentation import natural_pieces
from quicksilver.tokenizer import TOOL_CALLS, Tokenizer

if TYPE_CHECKING:
    from quicksilver.decoding.denoise import DecodeState


TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for a function name


def tool_name_error(name: str) -> str | None:
    """Why ``name`` cannot name a tool, or None if it can: one rule for the API's requests and the CLI's files."""
    if TOOL_NAME.fullmatch(name) is None:
        return f"a tool name must be 1 to 64 ASCII letters, digits, '_', '.' or '-', got {name!r}"
    return None


def parameters_error(parameters: dict) -> str | None:
    """Why a tool's ``parameters`` schema cannot describe a call's arguments, or None: they are a JSON object, so no
    call could satisfy a schema of another type. One rule for the API's requests and the CLI's files."""
    kind = parameters.get("type", "object")
    if kind != "object":
        return f'parameters must be a JSON Schema of type "object", got type {json.dumps(kind)}'
    return None


def function_schemas(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema, from OpenAI-format tools (ValueError on malformed tools)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if error := tool_name_error(name):
            raise ValueError(f"tools[{i}].function.name: {error}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = params
    return out


def check_tools(tools: list[dict], tokenizer: Tokenizer) -> None:
    """ValueError unless ``tools`` is a well-formed OpenAI tool list with valid JSON schemas that this
    tokenizer can call (it has the tool-call token): what a front end checks before decoding under them."""
    for name, schema in function_schemas(tools).items():
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"tool {name!r}: invalid JSON schema: {exc.message}") from None
        if error := parameters_error(schema):
            raise ValueError(f"tool {name!r}: {error}")
    if tokenizer.token_id(TOOL_CALLS) is None:
        raise ValueError("this model has no tool-call token; tools are not supported")


def _strict(tools: list[dict], name: str) -> bool:
    for t in tools:
        if t.get("function", {}).get("name") == name:
            return bool(t["function"].get("strict", False))
    return False


def tool_call_constraint(
    tools: list[dict], tool_choice: Any, tokenizer: Tokenizer, max_tokens: int | None = None, layout: str = "lazy"
) -> StructuredConstraint | None:
    """A constraint forcing a valid call, or None when the model may answer freely ("none"/"auto").

    ``layout``: "lazy" or "fixed" (see :mod:`quicksilver.structured.constraint`)."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    functions = function_schemas(tools)
    if tool_choice == "required":
        names = list(functions)
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        names = [name]
    else:
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}")
    if tokenizer.token_id(TOOL_CALLS) is None:
        raise UnsupportedSchema(f"this tokenizer has no {TOOL_CALLS} token")
    args = {n: SchemaCompiler(functions[n], strict=_strict(tools, n)).compile() for n in names}
    validators = {n: jsonschema.validators.validator_for(functions[n])(functions[n]) for n in functions}

    def planner(max_tok: int | None, lex: Lexicon, end_ids: tuple[int, ...]) -> Plan:
        return _plan(names, args, tokenizer, lex, max_tok, end_ids)

    def validate(text: str) -> list[dict]:
        calls = _decode_calls(text, validators)
        if calls is None:
            raise StructuredOutputError(f"output is not a valid tool call: {text!r}")
        return calls

    return StructuredConstraint(tokenizer, planner, validate, max_tokens, layout)


def _plan(names: list[str], args: dict[str, list[Piece]], tokenizer: Tokenizer, lex: Lexicon,
          max_tokens: int | None, end_ids: tuple[int, ...]) -> Plan:
    if len(names) == 1:
        pieces = [TOOL_CALLS + '[{"name": ' + dumps(names[0]) + ', "arguments": ', *args[names[0]], "}]"]
        return Plan(lay_out(natural_pieces(_merge(pieces), tokenizer), tokenizer, lex, max_tokens, end_ids))
    alive = list(names)
    errors: list[str] = []
    while True:
        escaped = tuple(dumps(n)[1:-1] for n in alive)
        tail_pieces = {n: _merge(['", "arguments": ', *args[n], "}]"]) for n in alive}
        # the name slot is cut against the text all tails start with, so the head is the same for every tool
        after = os.path.commonprefix([p[0] for p in tail_pieces.values()])
        head_pieces = natural_pieces([TOOL_CALLS + '[{"name": "', Slot(("literals", escaped), 0, False), after],
                                     tokenizer)
        head_pieces = head_pieces[: next(i for i, p in enumerate(head_pieces) if isinstance(p, Slot)) + 1]
        name_spec = head_pieces[-1].spec
        pre, suf = (name_spec[1], name_spec[3]) if name_spec[0] == "affix" else ("", "")
        head = lay_out(head_pieces, tokenizer, lex, None, end_ids)
        if not suf:  # the closing quote is pinned: its mass means "name done"
            head.slots[-1].closers = _union(head.slots[-1].closers, lex.first_byte_ids(ord('"')))
        room = None if max_tokens is None else max_tokens - head.length
        tails = {}
        for n, e in zip(alive, escaped, strict=True):
            try:
                if room is not None and room < 1:
                    raise ValueError(f"max_tokens {max_tokens} leaves no room for the arguments")
                rest = [tail_pieces[n][0][len(suf):], *tail_pieces[n][1:]]
                tails[e] = lay_out(natural_pieces(_merge(rest), tokenizer), tokenizer, lex, room, end_ids)
            except ValueError as exc:
                if isinstance(exc, UnsupportedSchema):
                    raise
                errors.append(f"{n}: {exc}")
        if not tails:
            raise ValueError("max_tokens is too small for any tool call (" + "; ".join(errors) + ")")
        if len(tails) == len(alive):
            if len(alive) == 1:  # only one tool fits: pin its name too
                return _plan(alive, args, tokenizer, lex, max_tokens, end_ids)
            affix = (len(pre.encode("utf-8")), len(suf.encode("utf-8")))
            return Plan(head, tails, choice_slot=len(head.slots) - 1, choice_affix=affix)
        alive = [n for n, e in zip(alive, escaped, strict=True) if e in tails]


class AutoToolConstraint(Constraint):
    """``tool_choice="auto"``, decide then constrain: the answer's first token is committed on its own; if it is
    ``<|tool_calls|>`` the rest is decoded under the tool-call skeleton (a valid call is guaranteed), otherwise
    the answer is free text in which the marker cannot appear later (so no malformed call either).

    The chat template writes a call as the whole assistant turn (``<|tool_calls|>`` first), so deciding at the
    first token matches training. Costs at most one forward: the first step commits only that token.
    """

    def __init__(self, calls: StructuredConstraint, marker: int):
        self.calls = calls
        self.marker = marker
        self._mode: weakref.WeakKeyDictionary[DecodeState, str] = weakref.WeakKeyDictionary()

    @property
    def lex(self) -> Lexicon:
        return self.calls.lex

    def pinned_tokens(self, state: DecodeState) -> dict[int, int]:
        # stop strings could cut a call's JSON: with them, auto stays plain free decoding
        self._mode[state] = "free" if state.params.stop else "undecided"
        return {}

    def mask_logits(self, state: DecodeState, positions: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        mode = self._mode[state]
        if mode == "call":
            return self.calls.mask_logits(state, positions, logits)
        if mode == "undecided":  # the marker only at the answer's first position
            later = positions != state.prompt_len
            logits[later, self.marker] = float("-inf")
            return logits
        if not state.params.stop:
            logits[:, self.marker] = float("-inf")
        return logits

    def allow_commits(
        self, state: DecodeState, positions: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        mode = self._mode[state]
        if mode == "call":
            return self.calls.allow_commits(state, positions, tokens, keep)
        if mode == "free":
            return keep
        first = positions == state.prompt_len
        if not bool(first.any()):
            return torch.zeros_like(keep)
        out = first & (keep | bool(keep.any()))  # the first position alone (even if the policy picked others)
        if not bool(out.any()):
            return out
        if int(tokens[first][0]) == self.marker:
            try:  # pin the call skeleton from the answer's start (marker included)
                pins = self.calls.pinned_tokens(state)
            except ValueError:  # no call fits this request's canvas: stay free
                self._mode[state] = "free"
                return out
            for pos, tok in pins.items():  # a fixed layout returns its pins; a lazy one writes them as it goes
                state.tokens[pos] = tok
                state.committed[pos] = state.fixed[pos] = True
            self._mode[state] = "call"
            return torch.zeros_like(keep)  # the marker position is pinned now
        self._mode[state] = "free"
        return out

    def filler_token_ids(self) -> frozenset[int]:
        return self.calls.filler_token_ids()

    def finished(self, state: DecodeState) -> bool:
        return self._mode.get(state) == "call" and self.calls.finished(state)


def auto_tool_constraint(
    tools: list[dict], tokenizer: Tokenizer, max_tokens: int | None = None, layout: str = "lazy"
) -> AutoToolConstraint | None:
    """:class:`AutoToolConstraint` over ``tools``, or None (free decoding, as before) when no call skeleton can be
    enforced for them (unsupported schema, or no call fits in ``max_tokens``): "auto" never refuses a request."""
    try:
        calls = tool_call_constraint(tools, "required", tokenizer, max_tokens=max_tokens, layout=layout)
    except ValueError:  # UnsupportedSchema is one; malformed tools were checked by the caller already
        return None
    return AutoToolConstraint(calls, tokenizer.token_id(TOOL_CALLS))


def _union(a, b):
    import numpy as np

    return np.union1d(a, b).astype(np.int64)


def _merge(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return out


def _decode_calls(text: str, validators: dict[str, Any]) -> list[dict] | None:
    body = text.split(TOOL_CALLS, 1)[1] if TOOL_CALLS in text else text
    body = body.strip()
    if not body.startswith(("[", "{")):
        return None
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or set(item) - {"name", "arguments"} or item.get("name") not in validators:
            return None
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):  # some models write the OpenAI wire form: a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        if next(iter(validators[item["name"]].iter_errors(arguments)), None) is not None:
            return None
        calls.append({"name": item["name"], "arguments": arguments})
    return calls


def parse_tool_calls(text: str, tools: list[dict]) -> list[dict] | None:
    """Validated ``[{"name", "arguments": dict}]`` if ``text`` is a tool call for ``tools``, else None.

    Accepts the template form (``<|tool_calls|>`` + JSON list, the marker is dropped when decoding with
    ``skip_special_tokens``) and a bare list or single call object.
    """
    try:
        functions = function_schemas(tools)
    except ValueError:
        return None
    validators = {n: jsonschema.validators.validator_for(s)(s) for n, s in functions.items()}
    return _decode_calls(text, validators)
