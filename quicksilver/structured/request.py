"""Which constraint a chat request decodes under: one rule, shared by the server and the evaluator.

The server (``quicksilver/api/chat.py``) and ``quicksilver eval --constrained`` both call
:func:`constraint_factory`, so the eval measures exactly what an API client gets for the same request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quicksilver.tokenizer import Tokenizer


def is_forced_tool_choice(tool_choice: Any) -> bool:
    """True for ``"required"`` and for a named function (``{"type": "function", "function": {"name": ...}}``)."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


def constraint_factory(
    tokenizer: Tokenizer,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    json_schema: dict[str, Any] | None = None,
    strict: bool = False,
    json_object: bool = False,
    max_tokens: int | None = None,
    builders: Any = None,
    constrain_auto: bool = True,
) -> Callable[[], Any] | None:
    """A callable making one fresh constraint per choice (constraints keep per-state data), or None to decode freely.

    * a forced ``tool_choice`` ("required" / named function) pins a tool-call skeleton over ``tools``
      (the server ignores ``response_format`` then, so ``json_schema``/``json_object`` should be unset);
    * otherwise ``json_schema`` pins that schema's skeleton (``strict`` as in ``response_format.json_schema``);
    * otherwise ``json_object`` grows any JSON object;
    * ``tool_choice`` "auto" (or unset) with ``tools`` decides then constrains (``builders.auto_tool_constraint``):
      the first answer token alone, then, if it is ``<|tool_calls|>``, a valid call; else free text. This is what
      makes tool calls always valid in auto mode. ``constrain_auto=False`` decodes auto freely instead;
    * otherwise None: ``tool_choice`` "none" and plain text decode freely.

    The constraint is built once here, so an unsupported schema or a skeleton that cannot fit in ``max_tokens``
    raises ValueError (UnsupportedSchema is one) before anything is queued. ``builders`` is the module with the
    ``*_constraint`` functions (default ``quicksilver.structured``; the server's tests pass a stand-in).
    """
    if builders is None:
        import quicksilver.structured as builders
    if is_forced_tool_choice(tool_choice):
        def make() -> Any:
            return builders.tool_call_constraint(tools, tool_choice, tokenizer, max_tokens=max_tokens)
    elif constrain_auto and tools and tool_choice in (None, "auto") and json_schema is None and not json_object:
        def make() -> Any:  # None when no call skeleton can be enforced for these tools (then: free decoding)
            return builders.auto_tool_constraint(tools, tokenizer, max_tokens=max_tokens)
    elif json_schema is not None:
        def make() -> Any:
            return builders.json_schema_constraint(json_schema, tokenizer, strict=strict, max_tokens=max_tokens)
    elif json_object:
        def make() -> Any:
            return builders.json_object_constraint(tokenizer, max_tokens=max_tokens)
    else:
        return None
    first = make()  # built now: a request that cannot be served fails here
    if first is None:
        return None
    built = [first]

    def fresh() -> Any:  # the one built above serves the first choice (no second build), then new ones
        return built.pop() if built else make()

    return fresh
