"""``quicksilver index add|list|remove|search|stats``: the document index for retrieval (one SQLite file)."""

from __future__ import annotations

import argparse
import contextlib
import os

DEFAULT_INDEX = os.environ.get("QUICKSILVER_INDEX", "quicksilver-index.sqlite")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("index", help="build and search the document index used for retrieval (RAG)")
    p.add_argument("--index", default=DEFAULT_INDEX,
                   help=f"index file (default: $QUICKSILVER_INDEX or {DEFAULT_INDEX})")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    add = actions.add_parser("add", help="add or update files and folders (text, Markdown, HTML, PDF, source)")
    add.add_argument("paths", nargs="+")
    add.add_argument("--chunk-chars", type=int, default=900, help="maximum characters per chunk")
    add.add_argument("--overlap-chars", type=int, default=150, help="characters repeated between chunks")
    add.add_argument("--force", action="store_true", help="re-embed files even when unchanged")

    actions.add_parser("list", help="list the indexed documents")
    actions.add_parser("stats", help="document/chunk counts and consistency check")

    rm = actions.add_parser("remove", help="remove documents (a folder removes everything under it)")
    rm.add_argument("paths", nargs="+")

    search = actions.add_parser("search", help="search the index")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=5, help="number of passages (default 5)")
    search.add_argument("--mode", choices=("hybrid", "vector", "bm25"), default="hybrid")
    search.add_argument("--json", action="store_true", help="print the hits as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from quicksilver.rag.store import Index

    if args.action == "add":
        if args.chunk_chars < 50:
            raise ValueError(f"--chunk-chars must be at least 50, got {args.chunk_chars}")
        if not 0 <= args.overlap_chars < args.chunk_chars // 2:
            raise ValueError(f"--overlap-chars must be >= 0 and less than half of --chunk-chars, got "
                             f"{args.overlap_chars}")
        missing = [p for p in args.paths if not os.path.exists(p)]
        if missing:  # before the index file is created
            raise FileNotFoundError(f"{', '.join(missing)}: no such file or folder")
        created, code = not os.path.exists(args.index), 1
        try:
            with Index(args.index) as index:
                code = _add(args, index)
            return code
        finally:
            if created and code != 0:  # a failed first add leaves no empty index behind
                _remove_if_empty(args.index)

    with Index(args.index, create=False) as index:
        if args.action == "list":
            docs = index.documents()
            for d in docs:
                print(f"{d.n_chunks:5d} chunks  {d.kind:8s}  {d.path}  {d.title!r}")
            print(f"{len(docs)} documents")
        elif args.action == "stats":
            stats = index.stats()
            problems = index.check()
            print(json.dumps({**stats, "consistent": not problems, "problems": problems}, indent=2))
            return 1 if problems else 0
        elif args.action == "remove":
            removed = index.remove(args.paths)
            for p in removed:
                print(f"removed {p}")
            if not removed:
                raise LookupError(f"no indexed document matches {' '.join(args.paths)}")
        elif args.action == "search":
            index.require_documents()
            started = time.perf_counter()
            hits = index.search(args.query, k=args.k, mode=args.mode)
            ms = 1000 * (time.perf_counter() - started)
            if args.json:
                print(json.dumps([h.to_dict() for h in hits], ensure_ascii=False, indent=2))
                return 0
            for i, h in enumerate(hits, 1):
                snippet = " ".join(h.text.split())
                print(f"[{i}] {h.score:.4f}  {h.citation}\n    {snippet[:300]}")
            print(f"{len(hits)} hits in {ms:.0f} ms ({args.mode})")
    return 0


def _add(args: argparse.Namespace, index) -> int:
    import time

    started = time.perf_counter()
    totals = {"added": 0, "updated": 0, "unchanged": 0, "error": 0}

    def report(r) -> None:
        totals[r.status] += 1
        extra = f" ({r.chunks} chunks)" if r.status in ("added", "updated") else f" ({r.error})" * bool(r.error)
        print(f"{r.status:9s} {r.path}{extra}", flush=True)

    index.add_paths(args.paths, args.chunk_chars, args.overlap_chars, args.force, on_result=report)
    s = index.stats()
    print(f"{', '.join(f'{v} {k}' for k, v in totals.items())} in {time.perf_counter() - started:.1f} s; "
          f"index {args.index}: {s['documents']} documents, {s['chunks']} chunks")
    return 1 if totals["error"] and not (totals["added"] + totals["updated"] + totals["unchanged"]) else 0


def _remove_if_empty(path: str) -> None:
    """Delete an index file this command created when no document made it in (and its WAL side files)."""
    import sqlite3
    from pathlib import Path

    try:
        conn = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)
        try:
            empty = conn.execute("SELECT count(*) FROM documents").fetchone()[0] == 0
        finally:
            conn.close()
    except sqlite3.Error:
        return
    if empty:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + suffix)
