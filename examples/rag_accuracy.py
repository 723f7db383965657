"""RAG answer accuracy on the task suite's retrieval questions, with and without retrieval.

Each held-out ``retrieval`` example carries its passages inside the user message. Here all the passages of all
examples go into one index; then every question is asked three ways:
  given      - the original prompt with its own passages (the task suite's setting, an upper bound),
  retrieval  - the question alone, plus the top-k passages the index returns for it (what `ask` does),
  none       - the question alone (the facts are invented, so this should be near zero).
It also reports how often the passage about the entity the question names was in the top k.

    python examples/rag_accuracy.py [--model FOLDER] [--n 32] [--k 3] [--max-tokens 48] [--mode vector]
    python examples/rag_accuracy.py --retrieval-only     # passage hit rate per search mode, no model needed
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from quicksilver.rag import Index
from quicksilver.rag.chat import augment_messages
from quicksilver.rag.chunking import Chunk

PASSAGE = re.compile(r"^\[\d+\] .+$", re.M)


def split_example(messages: list[dict]) -> tuple[list[str], list[dict]]:
    """(passages, messages with the passages cut out of the last user turn)."""
    user = messages[-1]["content"]
    passages = [p.split("] ", 1)[1] for p in PASSAGE.findall(user)]
    question = re.sub(r"\n{2,}", "\n\n", PASSAGE.sub("", user)).strip()
    return passages, messages[:-1] + [{"role": "user", "content": question}]


def gold_passage(i: int, passages: list[str], question: str) -> str | None:
    """Path of the example's passage about the entity the question names (None: the entity has no passage)."""
    names = set(re.findall(r"\b[A-Z][a-z]+\b", question.split("\n")[-1]))
    for j, p in enumerate(passages):
        if names & set(re.findall(r"\b[A-Z][a-z]+\b", p)):
            return f"example{i}/passage{j}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model folder or shipped name (default: the shipped default model)")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--mode", default="hybrid", choices=("vector", "hybrid", "bm25"))
    ap.add_argument("--retrieval-only", action="store_true", help="only measure passage hits for every mode")
    args = ap.parse_args()

    from quicksilver.evaluate import eval_examples
    from quicksilver.tasks import get_task

    task = get_task("retrieval")
    examples = eval_examples("retrieval", args.n)
    split = [split_example(e.messages) for e in examples]
    index_path = Path(tempfile.mkdtemp()) / "taskpassages.sqlite"
    with Index(index_path) as index:
        all_passages = [(i, j, p) for i, (ps, _) in enumerate(split) for j, p in enumerate(ps)]
        vectors = index.embedder.embed([p for _, _, p in all_passages])
        for (i, j, p), v in zip(all_passages, vectors, strict=True):
            index.put_document(f"example{i}/passage{j}", f"example {i}", "text", "-", len(p),
                               [Chunk(p, 0, len(p), 1, 1)], v[None])
    print(f"indexed {len(all_passages)} passages from {len(examples)} examples")
    if args.retrieval_only:
        golds = [(i, gold_passage(i, ps, bare[-1]["content"]), bare) for i, (ps, bare) in enumerate(split)]
        golds = [g for g in golds if g[1] is not None]
        for mode in ("vector", "bm25", "hybrid"):
            for k in sorted({1, args.k}):
                hits = sum(gold in [s["path"] for s in augment_messages(index_path, bare, k, mode)[1]]
                           for _, gold, bare in golds)
                print(f"{mode:6s}: passage about the asked entity in top {k}: {hits}/{len(golds)}")
        return

    from quicksilver.decoding import Decoder
    from quicksilver.loading import load_model

    loaded = load_model(args.model)
    params = loaded.defaults.replace(max_tokens=args.max_tokens)
    decoder = Decoder(loaded.model, loaded.tokenizer, params)
    correct = {"given": 0, "retrieval": 0, "none": 0}
    own_hit, forwards, started = 0, 0, time.perf_counter()
    for i, (example, (_, bare)) in enumerate(zip(examples, split, strict=True)):
        augmented, sources = augment_messages(index_path, bare, args.k, args.mode)
        gold = gold_passage(i, split[i][0], bare[-1]["content"])
        own_hit += gold is not None and gold in [s["path"] for s in sources]
        for name, messages in (("given", example.messages), ("retrieval", augmented), ("none", bare)):
            result = decoder.chat(messages, params)
            forwards += result.stats.forwards
            correct[name] += task.verify(example, result.text)
    n = len(examples)
    print(f"model {loaded.name}, {n} questions, k={args.k}, {time.perf_counter() - started:.0f} s, {forwards} forwards")
    print(f"passage about the asked entity retrieved in top {args.k}: {own_hit}/{n} questions")
    for name, c in correct.items():
        print(f"accuracy {name:9s}: {c}/{n} = {c / n:.3f}")
    print(f"(answerable: {sum(e.answer is not None for e in examples)}/{n}; baseline of always 'not found': "
          f"{np.mean([e.answer is None for e in examples]):.3f})")


if __name__ == "__main__":
    main()
