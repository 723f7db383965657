"""``quicksilver ask "question" --index FILE``: retrieve passages, answer with the model, list the sources."""

from __future__ import annotations

import argparse
import sys

from quicksilver.commands._decode_args import add_decode_args, params_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="answer a question from the document index (retrieval-augmented)")
    p.add_argument("question", help="the question ('-' reads standard input)")
    p.add_argument("--index", required=True, help="index file built with `quicksilver index add`")
    p.add_argument("-k", type=int, default=4, help="passages to retrieve (default 4)")
    p.add_argument("--mode", choices=("hybrid", "vector", "bm25"), default="hybrid")
    p.add_argument("--no-retrieval", action="store_true", help="ask the model without passages (for comparison)")
    p.add_argument("--show-prompt", action="store_true", help="print the augmented messages first")
    p.add_argument("--json", action="store_true", help="print answer, sources and stats as JSON")
    add_decode_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import os

    from quicksilver.rag.chat import augment_messages

    question = sys.stdin.read() if args.question == "-" else args.question
    if not question.strip():
        raise ValueError("the question is empty")
    if not os.path.isfile(args.index):
        raise FileNotFoundError(f"{args.index}: no such index (create one with `quicksilver index add`)")
    messages = [{"role": "user", "content": question}]
    sources: list[dict] = []
    if not args.no_retrieval:
        from quicksilver.rag.store import Index

        with Index(args.index, create=False) as index:
            index.require_documents()
        messages, sources = augment_messages(args.index, messages, args.k, args.mode)
    if args.show_prompt:
        print(json.dumps(messages, ensure_ascii=False, indent=2), file=sys.stderr)

    from quicksilver.decoding import Decoder
    from quicksilver.loading import load_model

    loaded = load_model(args.model, precision=args.precision, device=args.device, compile=args.compile)
    params = params_from_args(args, loaded.defaults)
    result = Decoder(loaded.model, loaded.tokenizer, params).chat(messages, params)
    if args.json:
        print(json.dumps({"answer": result.text, "finish_reason": result.finish_reason, "sources": sources,
                          "prompt_tokens": result.prompt_tokens, "stats": result.stats.to_dict()}, ensure_ascii=False))
        return 0
    print(result.text.strip())
    if sources:
        print("\nSources:")
        for s in sources:
            print(f"  [{s['id']}] {s['path']}:{s['lines'][0]}-{s['lines'][1]}  {s['title']}")
    print(f"[{result.finish_reason}] {result.stats.line()}", file=sys.stderr)
    return 0
