"""Always-valid structured output and tool calls for the diffusion decoder.

* :func:`json_schema_constraint` / :func:`tool_call_constraint`: the JSON skeleton (braces, keys,
  punctuation) is pinned on the canvas and the model fills bounded value slots whose tokens are masked so
  that every slot can always still be completed to a valid value, whatever order positions are filled in.
* :func:`json_object_constraint`: any JSON object, grown left to right through a JSON prefix gate.
* :func:`auto_tool_constraint`: ``tool_choice="auto"``, decide then constrain (opt-in).
* :func:`parse_tool_calls`: validated calls from a free ("auto") answer, or None.
* Every constraint has ``validate(text)``; :func:`constrained_text` decodes a finished state and validates.
* Bounds (``SchemaTooLarge``, a kind of ``UnsupportedSchema``): lengths and item counts up to 1,024, 2,048
  sub-schemas, 256 values and a cap on each automaton's size, checked before the work is spent; the server builds
  constraints in a worker thread, so a long build does not hold up other requests.
"""

from __future__ import annotations

from typing import Any

from quicksilver.structured.constraint import StructuredConstraint, StructuredOutputError
from quicksilver.structured.free_json import JsonObjectConstraint
from quicksilver.structured.schema import UnsupportedSchema
from quicksilver.structured.tools import (
    AutoToolConstraint,
    auto_tool_constraint,
    parse_tool_calls,
    tool_call_constraint,
)
from quicksilver.tokenizer import Tokenizer

__all__ = [
    "AutoToolConstraint", "JsonObjectConstraint", "StructuredConstraint", "StructuredOutputError", "UnsupportedSchema",
    "compare_pinned_vs_free", "constrained_text", "json_object_constraint", "json_schema_constraint",
    "auto_tool_constraint", "parse_tool_calls", "tool_call_constraint",
]


def json_schema_constraint(
    schema: dict, tokenizer: Tokenizer, strict: bool = True, max_tokens: int | None = None, layout: str = "lazy"
) -> StructuredConstraint:
    """Constraint for ``response_format: {"type": "json_schema", ...}``.

    Raises UnsupportedSchema for schemas we cannot enforce, ValueError if the skeleton cannot fit in
    ``max_tokens`` (when given; otherwise checked when decoding starts). ``strict=False`` treats ``format``
    as an annotation (as JSON Schema itself does); every other keyword is enforced either way. ``layout``:
    "lazy" (skeleton pinned as the values are written, no filler inside the answer) or "fixed" (all pinned up
    front, fixed-width slots), see :mod:`quicksilver.structured.constraint`.
    """
    import jsonschema

    from quicksilver.structured.constraint import json_validator, schema_planner
    from quicksilver.structured.schema import SchemaCompiler

    pieces = SchemaCompiler(schema, strict=strict).compile()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return StructuredConstraint(tokenizer, schema_planner(pieces, tokenizer), json_validator(validator), max_tokens,
                                layout)


def json_object_constraint(tokenizer: Tokenizer, max_tokens: int | None = None) -> JsonObjectConstraint:
    """Constraint for ``response_format: {"type": "json_object"}``: any JSON object."""
    return JsonObjectConstraint(tokenizer, max_tokens)


def constrained_text(state: Any, tokenizer: Tokenizer) -> tuple[str, Any]:
    """(text, parsed value) of a finished constrained state; StructuredOutputError if invalid."""
    text = tokenizer.decode(state.answer_ids)
    return text, state.constraint.validate(text)


def compare_pinned_vs_free(loaded: Any, schema: dict, prompt: str, **kwargs: Any) -> dict:
    """Forwards and wall time for a JSON answer with the skeleton pinned vs generated freely (same length)."""
    from quicksilver.structured.bench import compare_pinned_vs_free as run

    return run(loaded, schema, prompt, **kwargs)
