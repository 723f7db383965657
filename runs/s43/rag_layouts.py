"""Session 43 scratch: where should retrieved passages go for the shipped models? The rag_accuracy questions asked
with the top-k passages laid out several ways.
Usage: OMP_NUM_THREADS=1 python runs/s43/rag_layouts.py MODEL N K [SEED]"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "examples")
from rag_accuracy import split_example  # noqa: E402

from quicksilver.decoding import Decoder  # noqa: E402
from quicksilver.evaluate import eval_examples  # noqa: E402
from quicksilver.loading import load_model  # noqa: E402
from quicksilver.rag import Index  # noqa: E402
from quicksilver.rag.chat import format_passages, retrieve  # noqa: E402
from quicksilver.rag.chunking import Chunk  # noqa: E402
from quicksilver.tasks import get_task  # noqa: E402

# the header augment_messages wrote before session 43
CONTEXT_HEADER = (
    "Answer using the numbered passages below when they are relevant, and cite them like [1]. "
    "If they do not contain the answer, say so.\n\nPassages:\n"
)


def layouts(bare, hits):
    q, head = bare[-1]["content"], bare[:-1]
    sourced = format_passages(hits)
    plain = "\n".join(f"[{i}] {h.text}" for i, h in enumerate(hits, 1))

    def in_system(context):
        if head and head[0]["role"] == "system":
            return [{**head[0], "content": head[0]["content"].rstrip() + "\n\n" + context}, *head[1:], bare[-1]]
        return [{"role": "system", "content": context}, *head, bare[-1]]

    return {
        "system turn, sourced (now)": in_system(CONTEXT_HEADER + sourced),
        "system turn, plain": in_system(CONTEXT_HEADER + plain),
        "user turn, sourced": [*head, {"role": "user", "content": CONTEXT_HEADER + sourced + "\n\nQuestion: " + q}],
        "user turn, header + plain": [*head, {"role": "user", "content": CONTEXT_HEADER + plain + "\n\n" + q}],
        "user turn, plain": [*head, {"role": "user", "content": "Passages:\n" + plain + "\n\n" + q}],
    }


def main() -> None:
    model, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else None  # another draw of held-out questions
    task = get_task("retrieval")
    examples = eval_examples("retrieval", n) if seed is None else eval_examples("retrieval", n, seed=seed)
    split = [split_example(e.messages) for e in examples]
    index_path = Path(tempfile.mkdtemp()) / "p.sqlite"
    with Index(index_path) as index:
        allp = [(i, j, p) for i, (ps, _) in enumerate(split) for j, p in enumerate(ps)]
        vectors = index.embedder.embed([p for *_, p in allp])
        for (i, j, p), v in zip(allp, vectors, strict=True):
            index.put_document(f"example{i}/passage{j}", f"example {i}", "text", "-", len(p),
                               [Chunk(p, 0, len(p), 1, 1)], v[None])
    loaded = load_model(model)
    params = loaded.defaults.replace(max_tokens=48)
    decoder = Decoder(loaded.model, loaded.tokenizer, params)
    right: dict[str, int] = {}
    for example, (_, bare) in zip(examples, split, strict=True):
        hits = retrieve(index_path, bare[-1]["content"], k)
        for name, messages in layouts(bare, hits).items():
            right[name] = right.get(name, 0) + task.verify(example, decoder.chat(messages, params).text)
    for name, c in right.items():
        print(f"{model} k={k} seed={seed or 'suite'}: {name:28s} {c}/{n}")


if __name__ == "__main__":
    main()
