"""``quicksilver chat``: an interactive multi-turn conversation in the terminal."""

from __future__ import annotations

import argparse
import sys

from quicksilver.commands._decode_args import add_decode_args, params_from_args

HELP = "commands: /reset clears the conversation, /exit quits (or Ctrl-D)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat")
    add_decode_args(p)
    p.add_argument("--system", help="system message")
    p.add_argument("--stats", action="store_true", help="print speed stats after each answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quicksilver.decoding import Decoder
    from quicksilver.loading import load_model

    loaded = load_model(args.model)
    params = params_from_args(args, loaded.defaults)
    decoder = Decoder(loaded.model, loaded.tokenizer, params)
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
        history.append({"role": "user", "content": line})
        result = decoder.chat(system + history, params)
        history.append({"role": "assistant", "content": result.text})
        print(f"assistant> {result.text}" if interactive else result.text, flush=True)
        if args.stats:
            print(f"[{result.finish_reason}] {result.stats.line()}", file=sys.stderr)
    return 0
