"""Embedding throughput (texts/s) of the MiniLM encoder for query-sized and chunk-sized texts.

    python examples/bench_embeddings.py [--n 64] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from quicksilver.embeddings import Embedder
from quicksilver.rag import chunk_text, read_document

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "docs" / "corpus"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    t = time.perf_counter()
    embedder = Embedder(batch_size=args.batch_size)
    print(f"load: {time.perf_counter() - t:.2f} s")
    chunks = [c.text for f in sorted(CORPUS.iterdir()) for c in chunk_text(read_document(f).text)]
    long_texts = (chunks * (args.n // len(chunks) + 1))[: args.n]
    short_texts = [f"How often are the recycling bins emptied in town number {i}?" for i in range(args.n)]
    embedder.embed(short_texts[:4])  # warm-up
    for label, texts in (("query-sized", short_texts), ("chunk-sized", long_texts)):
        tokens = sum(embedder.token_counts(texts))
        t = time.perf_counter()
        embedder.embed(texts)
        dt = time.perf_counter() - t
        print(f"{label}: {len(texts)} texts, {tokens / len(texts):.0f} tokens each on average: "
              f"{len(texts) / dt:.1f} texts/s, {tokens / dt:.0f} tokens/s")
    samples = []
    for i in range(10):
        t = time.perf_counter()
        embedder.embed(short_texts[i])
        samples.append(time.perf_counter() - t)
    print(f"single query latency: median {1000 * sorted(samples)[5]:.1f} ms")


if __name__ == "__main__":
    main()
