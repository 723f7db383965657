"""Recall@k of the shipped test document collection for each search mode.

    python examples/rag_recall.py [--k 5] [--index /tmp/docs.sqlite] [--extra FOLDER ...]

--extra adds distractor files (e.g. the project's own source and docs) so that retrieval has to pick the right
passage out of many, not out of 16.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from quicksilver.rag import Index
from quicksilver.rag.store import SEARCH_MODES

DOCS = Path(__file__).resolve().parents[1] / "tests" / "data" / "docs"


def recall_at_k(index: Index, questions: list[dict], k: int, mode: str) -> tuple[float, list[str]]:
    """Fraction of questions whose expected source file is among the top-k hits, plus the misses."""
    misses = []
    vectors = index.embedder.embed([q["question"] for q in questions])
    for q, v in zip(questions, vectors, strict=True):
        names = [Path(h.path).name for h in index.search(q["question"], k=k, mode=mode, query_vector=v)]
        if q["source"] not in names:
            misses.append(q["question"])
    return 1 - len(misses) / len(questions), misses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--index", help="index file (default: a temporary one)")
    ap.add_argument("--extra", nargs="*", default=[], help="distractor files or folders to index as well")
    args = ap.parse_args()
    questions = json.loads((DOCS / "questions.json").read_text())
    path = args.index or str(Path(tempfile.mkdtemp()) / "docs.sqlite")
    with Index(path) as index:
        t = time.perf_counter()
        index.add_paths([DOCS / "corpus", *args.extra])
        print(f"indexed {index.stats()['chunks']} chunks in {time.perf_counter() - t:.2f} s")
        for mode in SEARCH_MODES:
            for k in (1, args.k):
                r, misses = recall_at_k(index, questions, k, mode)
                print(f"{mode:7s} recall@{k}: {r:.3f}  misses: {misses}")


if __name__ == "__main__":
    main()
