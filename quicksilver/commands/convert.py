"""``quicksilver convert SRC DST``: write any loadable checkpoint (a supported family's Hugging Face folder, or
our own layout) into Quicksilver's own layout, so later loads need no adapter."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint folder (LLaDA, Dream, SDAR, LLaDA2, Fast-dLLM v2) "
                                       "into Quicksilver's layout")
    p.add_argument("src", help="source model folder (or shipped model name)")
    p.add_argument("dst", help="destination folder (must be new or empty unless --force)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="dtype of the written weights (default bfloat16)")
    p.add_argument("--force", action="store_true", help="write into a non-empty destination folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from quicksilver.checkpoint import DTYPES, save_pretrained
    from quicksilver.families.base import summary_line
    from quicksilver.loading import load_model, resolve_model_path

    src = resolve_model_path(args.src)
    dst = Path(args.dst).expanduser()
    if dst.resolve() == src.resolve():
        raise ValueError(f"{dst}: destination is the source folder")
    if dst.exists() and (not dst.is_dir() or (any(dst.iterdir()) and not args.force)):
        raise ValueError(f"{dst}: exists and is not an empty folder (use --force to write into it)")
    dtype = DTYPES[args.dtype]
    loaded = load_model(str(src), dtype=dtype)  # family loads print their own summary line (stderr)
    save_pretrained(dst, loaded.model, loaded.tokenizer, loaded.defaults, dtype=dtype)
    loaded.name = dst.name
    print(f"wrote {dst}: {summary_line(loaded).removeprefix('loaded ')}")
    return 0
