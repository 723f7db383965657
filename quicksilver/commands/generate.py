"""``quicksilver generate``: decode one prompt, optionally showing the canvas as it denoises."""

from __future__ import annotations

import argparse
import sys

from quicksilver.commands._decode_args import add_decode_args, params_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("prompt", help="the prompt ('-' reads standard input)")
    add_decode_args(p)
    p.add_argument("--raw", action="store_true", help="complete the text as is (no chat template)")
    p.add_argument("--system", help="system message (chat template only)")
    p.add_argument("--show-steps", action="store_true", help="print the canvas after every denoising step")
    p.add_argument("--json", action="store_true", help="print the result and stats as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from quicksilver.decoding import Decoder
    from quicksilver.loading import load_model

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    loaded = load_model(args.model, precision=args.precision, device=args.device, compile=args.compile)
    params = params_from_args(args, loaded.defaults)
    decoder = Decoder(loaded.model, loaded.tokenizer, params)
    if args.raw:
        text = prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    on_step = None
    if args.show_steps:
        def on_step(state):  # noqa: E306 - a closure over the tokenizer
            canvas = state.canvas_text(loaded.tokenizer, mask_glyph="\u2591")
            print(f"[step {state.stats.steps:3d} | committed {state.stats.committed:4d}] {canvas!r}", flush=True)
    result = decoder.generate(text, params, on_step=on_step)
    if args.json:
        print(json.dumps({"text": result.text, "finish_reason": result.finish_reason,
                          "prompt_tokens": result.prompt_tokens, "stats": result.stats.to_dict()}))
        return 0
    print(result.text)
    print(f"[{result.finish_reason}] {result.stats.line()}", file=sys.stderr)
    return 0
