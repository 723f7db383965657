"""``quicksilver`` command line. Each sub-command lives in its own module under
:mod:`quicksilver.commands` and registers itself; this file only discovers and dispatches them."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from quicksilver import __version__, commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quicksilver", description="Diffusion language models.")
    parser.add_argument("--version", action="version", version=f"quicksilver {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (ValueError, OSError, LookupError) as exc:  # user errors: one line, no traceback
        print(f"quicksilver {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2


def one_line(message: str) -> str:
    """A message that spans lines (e.g. a YAML parser's, with the offending source line and a caret under it)
    as one line: lines stripped and joined, caret-only lines dropped."""
    lines = [line.strip() for line in message.splitlines()]
    return " ".join(line for line in lines if line and line.strip("^ ") != "")


if __name__ == "__main__":
    sys.exit(main())
