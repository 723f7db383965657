"""Session 43 scratch: the test collection's 24 questions (tests/data/docs) answered with the top-k passages laid out
as in runs/s43/rag_layouts.py; right = the expected answer appears in the reply.
Usage: OMP_NUM_THREADS=1 python runs/s43/rag_layouts_docs.py MODEL K"""
import json
import sys
import tempfile
from pathlib import Path

argv = sys.argv
sys.path.insert(0, "runs/s43")
from rag_layouts import layouts  # noqa: E402

from quicksilver.decoding import Decoder  # noqa: E402
from quicksilver.loading import load_model  # noqa: E402
from quicksilver.rag import Index  # noqa: E402
from quicksilver.rag.chat import retrieve  # noqa: E402

model, k = argv[1], int(argv[2])
docs = Path("tests/data/docs")
questions = json.loads((docs / "questions.json").read_text())
index_path = Path(tempfile.mkdtemp()) / "docs.sqlite"
with Index(index_path) as index:
    index.add_paths([docs / "corpus"])
loaded = load_model(model)
params = loaded.defaults.replace(max_tokens=64)
decoder = Decoder(loaded.model, loaded.tokenizer, params)
right: dict[str, int] = {}
for q in questions:
    bare = [{"role": "user", "content": q["question"]}]
    hits = retrieve(index_path, q["question"], k)
    for name, messages in layouts(bare, hits).items():
        text = decoder.chat(messages, params).text
        right[name] = right.get(name, 0) + (q["answer"].lower() in text.lower())
for name, c in right.items():
    print(f"{model} k={k}: {name:28s} {c}/{len(questions)}")
