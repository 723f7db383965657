"""What a client gets from one finished answer: content, validated tool calls, finish reason, or a broken
guarantee. One rule for the server (``ChatPlan.finish``) and for ``quicksilver eval --constrained``, so the eval
grades exactly what an API client would receive."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from quicksilver.structured.request import is_forced_tool_choice
from quicksilver.structured.tools import parse_tool_calls
from quicksilver.tokenizer import TOOL_CALLS, Tokenizer


@dataclass(frozen=True)
class ClientAnswer:
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[dict[str, Any]] | None  # [{"name", "arguments": dict}], validated against the tools
    finish_reason: str
    error: str | None = None  # a guarantee the request asked for did not hold (the server answers 500)


def client_answer(
    token_ids: list[int],
    text: str,
    finish_reason: str,
    tokenizer: Tokenizer,
    *,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    json_schema: dict[str, Any] | None = None,
    json_object: bool = False,
    parallel_tool_calls: bool | None = None,
) -> ClientAnswer:
    """Interpret a finished answer (``token_ids``/``text`` as decoded, special tokens kept in the ids).

    Calls after the ``<|tool_calls|>`` token that :func:`parse_tool_calls` validates become ``tool_calls``;
    ``parallel_tool_calls=False`` keeps the first, a named ``tool_choice`` keeps only that function. A forced
    tool choice without a valid call, or JSON output that does not parse or match ``json_schema``, is an error
    unless the answer was cut by the length limit (then the client gets the partial text, as OpenAI does)."""
    forced = is_forced_tool_choice(tool_choice)
    if tools and tool_choice != "none":
        marker = tokenizer.token_id(TOOL_CALLS)
        if marker is not None and marker in token_ids:
            cut = token_ids.index(marker)
            calls = parse_tool_calls(tokenizer.decode(token_ids[cut + 1 :]), tools)
            if calls and parallel_tool_calls is False:
                calls = calls[:1]
            if calls and isinstance(tool_choice, dict):
                name = tool_choice.get("function", {}).get("name")
                calls = [c for c in calls if c["name"] == name]
            if calls:
                content = None if forced else tokenizer.decode(token_ids[:cut]) or None
                calls = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
                return ClientAnswer(content, calls, "tool_calls")
        if forced and finish_reason != "length":
            return ClientAnswer(None, None, finish_reason, "the model did not produce a valid tool call")
    wants_json = json_schema is not None or json_object
    if wants_json and not forced and finish_reason != "length":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return ClientAnswer(text, None, finish_reason, "the model did not produce valid JSON")
        if json_schema is None and not isinstance(value, dict):
            return ClientAnswer(text, None, finish_reason, "the model did not produce a JSON object")
        if json_schema is not None:
            import jsonschema

            try:
                jsonschema.validate(value, json_schema)
            except jsonschema.ValidationError as exc:
                return ClientAnswer(text, None, finish_reason,
                                    f"the output does not match the schema: {exc.message}")
    return ClientAnswer(text, None, finish_reason)
