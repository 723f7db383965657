"""``quicksilver chat``: an interactive multi-turn conversation in the terminal.

``--json`` / ``--json-schema FILE`` make every answer a JSON object (that schema's), and ``--tools FILE`` lets the
model call the OpenAI-format tools in FILE; both decode under the same constraints as the API server, so the
output is always valid. Tool calls are printed, not run: answer them with ``/tool RESULT`` (one line per call,
in order; ``quicksilver agent`` runs real tools). The turn after a tool result may answer in text even under
``--tool-choice required``, which applies to turns that answer the user.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from quicksilver.commands._decode_args import add_decode_args, params_from_args

HELP = "commands: /tool RESULT answers a tool call, /reset clears the conversation, /exit quits (or Ctrl-D)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat")
    add_decode_args(p)
    p.add_argument("--system", help="system message")
    p.add_argument("--stats", action="store_true", help="print speed stats after each answer")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="every answer is a JSON object")
    shape.add_argument("--json-schema", metavar="FILE", help="every answer is JSON valid under this schema")
    shape.add_argument("--tools", metavar="FILE", help="JSON file with an OpenAI-format list of tools to call")
    p.add_argument("--tool-choice", choices=("auto", "required"),
                   help="with --tools: the model may call a tool (auto, the default) or must (required)")
    p.set_defaults(func=run)


def _read_json(path: str, what: str) -> Any:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} {path}: file not found")
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from None


def _open_calls(history: list[dict]) -> int:
    """How many tool calls of the latest assistant turn have no result yet."""
    results = 0
    for message in reversed(history):
        if message["role"] == "tool":
            results += 1
        elif message["role"] == "assistant":
            return max(len(message.get("tool_calls") or ()) - results, 0)
        else:
            return 0
    return 0


def run(args: argparse.Namespace) -> int:
    from quicksilver.decoding import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB, Decoder, PrefixCache
    from quicksilver.loading import load_model
    from quicksilver.structured.answer import client_answer
    from quicksilver.structured.request import constraint_factory
    from quicksilver.structured.tools import check_tools

    if args.tool_choice and not args.tools:
        raise ValueError("--tool-choice needs --tools")
    tools = _read_json(args.tools, "--tools") if args.tools else None
    schema = _read_json(args.json_schema, "--json-schema") if args.json_schema else None
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"--json-schema {args.json_schema} must hold a JSON object")
    if args.compile:  # the warm-up is silent and can take a while: say why nothing happens yet
        print("compiling the model's layers (about 40 s the first time) ...", file=sys.stderr, flush=True)
    loaded = load_model(args.model, precision=args.precision, device=args.device, compile=args.compile)
    params = params_from_args(args, loaded.defaults)
    tok = loaded.tokenizer
    if tools is not None:
        check_tools(tools, tok)

    def constraints_for(choice: str | None):
        try:
            return constraint_factory(tok, tools=tools, tool_choice=choice, json_schema=schema,
                                      json_object=args.json, max_tokens=params.max_tokens)
        except MemoryError:  # a last resort: the compiler's bounds refuse such schemas (SchemaTooLarge) first
            raise ValueError("the schema is too large to enforce") from None

    user_choice = (args.tool_choice or "auto") if tools else None
    factories = {user_choice: constraints_for(user_choice)}
    if tools:  # after a tool result the model may answer in text
        factories["auto"] = constraints_for("auto")
    # every turn resends the conversation: earlier turns' keys come from the prefix cache
    prefix_cache = PrefixCache.for_model(loaded.model.config, loaded.model.dtype, DEFAULT_PREFIX_CACHE_MB)
    decoder = Decoder(loaded.model, tok, params, prefix_cache, DEFAULT_PREFILL_CHUNK)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"quicksilver chat with {loaded.name}. {HELP}")
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if line == "/tool" or line.startswith("/tool "):
            if not _open_calls(history):
                print("(no tool call to answer)", file=sys.stderr)
                continue
            history.append({"role": "tool", "content": line[len("/tool"):].strip()})
            if _open_calls(history):  # more calls of the same turn wait for their results
                continue
            choice = "auto"  # a pending call implies tools
        else:
            history.append({"role": "user", "content": line})
            choice = user_choice
        make_constraint = factories[choice]
        result = decoder.chat(system + history, params, tools=tools,
                              constraint=make_constraint() if make_constraint else None)
        answer = client_answer(result.token_ids, result.text, result.finish_reason, tok, tools=tools,
                               tool_choice=choice, json_schema=schema, json_object=args.json)
        history.append({"role": "assistant", "content": answer.content or "",
                        **({"tool_calls": answer.tool_calls} if answer.tool_calls else {})})
        lines = [answer.content] if answer.content else []
        for call in answer.tool_calls or ():
            lines.append(f"call {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})")
        if answer.error:
            lines.append(f"(error: {answer.error})")
        text = "\n".join(lines) if lines else result.text
        print(f"assistant> {text}" if interactive else text, flush=True)
        if args.stats:
            print(f"[{result.finish_reason}] {result.stats.line()}", file=sys.stderr)
    return 0
