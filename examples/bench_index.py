"""Index build speed and search latency at N chunks with synthetic vectors: our store (vectors as BLOBs in SQLite,
numpy brute force over a cached matrix, FTS5 for BM25) against sqlite-vec's vec0 table when it is installed.

    python examples/bench_index.py [--chunks 100000] [--queries 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from quicksilver.rag.chunking import Chunk
from quicksilver.rag.store import Index

DIM = 384


class Synthetic:
    name, dim = "synthetic", DIM


def texts(rng: np.random.Generator, n: int) -> list[str]:
    vocab = [f"w{i}" for i in range(20000)]
    picks = rng.zipf(1.3, size=(n, 60)) % len(vocab)  # Zipf-ish word frequencies, 60 words per chunk
    return [" ".join(vocab[j] for j in row) for row in picks]


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def query_text(chunk: str) -> str:
    """Four content words of a chunk. The 50 most frequent synthetic words play the part of stopwords (the store
    drops real stopwords from BM25 queries), so they are left out as a real query's function words would be."""
    content = [w for w in chunk.split() if int(w[1:]) >= 50]
    return " ".join(content[:4]) or chunk.split()[0]


def ms(samples: list[float]) -> str:
    return f"median {1000 * statistics.median(samples):.1f} ms, p90 {1000 * np.percentile(samples, 90):.1f} ms"


def bench_ours(folder: Path, vecs: np.ndarray, words: list[str], queries: np.ndarray, per_doc: int) -> None:
    index = Index(folder / "ours.sqlite", embedder=Synthetic())
    t = time.perf_counter()
    for d in range(0, len(vecs), per_doc):
        chunks = [Chunk(words[i], 0, len(words[i]), 1, 1) for i in range(d, min(d + per_doc, len(vecs)))]
        index.put_document(f"/doc/{d}", f"doc {d}", "text", "0", 0, chunks, vecs[d : d + len(chunks)])
    build = time.perf_counter() - t
    size = (folder / "ours.sqlite").stat().st_size / 2**20
    print(f"ours: built {len(vecs)} chunks in {build:.1f} s ({len(vecs) / build:.0f} chunks/s), {size:.0f} MiB")
    t = time.perf_counter()
    index.search("w1", k=5, mode="vector", query_vector=queries[0])
    print(f"ours: first search (loads the {len(vecs)}x{DIM} matrix) {1000 * (time.perf_counter() - t):.0f} ms")
    for mode in ("vector", "bm25", "hybrid"):
        samples = []
        for i, q in enumerate(queries):
            t = time.perf_counter()
            hits = index.search(query_text(words[i * 7]), k=5, mode=mode, query_vector=q)
            samples.append(time.perf_counter() - t)
            assert hits
        print(f"ours: {mode:6s} search k=5: {ms(samples)}")
    # exactness check: the vector hits are the true top-5 by dot product
    top = np.argsort(-(vecs @ queries[1]))[:5] + 1  # chunk ids start at 1 in insertion order
    got = [h.chunk_id for h in index.search("x", k=5, mode="vector", query_vector=queries[1])]
    assert got == top.tolist(), (got, top)
    index.close()


def bench_sqlite_vec(folder: Path, vecs: np.ndarray, queries: np.ndarray) -> None:
    try:
        import sqlite_vec
    except ImportError:
        print("sqlite-vec: not installed (pip install sqlite-vec) - skipped")
        return
    import sqlite3

    if not hasattr(sqlite3.Connection, "enable_load_extension"):  # e.g. pyenv builds without extension loading
        try:
            import pysqlite3 as sqlite3  # type: ignore[no-redef]  # pip install pysqlite3-binary
        except ImportError:
            print("sqlite-vec: this Python's sqlite3 cannot load extensions (try pysqlite3-binary) - skipped")
            return
    conn = sqlite3.connect(str(folder / "vec.sqlite"))
    conn.enable_load_extension(True)
    sqlite_vec.load(conn)
    conn.execute(f"CREATE VIRTUAL TABLE v USING vec0(embedding float[{DIM}])")
    t = time.perf_counter()
    with conn:
        conn.executemany("INSERT INTO v(rowid, embedding) VALUES (?, ?)",
                         ((i + 1, vecs[i].tobytes()) for i in range(len(vecs))))
    build = time.perf_counter() - t
    print(f"sqlite-vec: built {len(vecs)} vectors in {build:.1f} s ({len(vecs) / build:.0f}/s)")
    samples = []
    for q in queries:
        t = time.perf_counter()
        rows = conn.execute("SELECT rowid, distance FROM v WHERE embedding MATCH ? AND k = 5 ORDER BY distance",
                            (q.tobytes(),)).fetchall()
        samples.append(time.perf_counter() - t)
    top = (np.argsort(-(vecs @ queries[-1]))[:5] + 1).tolist()
    assert [r[0] for r in rows] == top
    print(f"sqlite-vec: knn k=5: {ms(samples)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--chunks-per-doc", type=int, default=100)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    vecs, words, queries = unit(rng, args.chunks), texts(rng, args.chunks), unit(rng, args.queries)
    with tempfile.TemporaryDirectory() as tmp:
        bench_ours(Path(tmp), vecs, words, queries, args.chunks_per_doc)
        bench_sqlite_vec(Path(tmp), vecs, queries)


if __name__ == "__main__":
    main()
