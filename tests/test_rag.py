"""Chunking, readers, the SQLite index (add/search/remove/replace/crash safety), retrieval quality, chat augmentation
and the index/ask CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quicksilver.cli import main as cli
from quicksilver.rag import Index, IndexStoreError, ReaderError, chunk_text, read_document
from quicksilver.rag.chat import augment_messages, run_search_tool
from quicksilver.rag.readers import html_to_text
from quicksilver.testing import HashEmbedder

DOCS = Path(__file__).parent / "data" / "docs"


# --------------------------------------------------------------------------------------------- chunking
def test_chunks_cover_text_with_overlap_and_correct_spans():
    text = "\n".join(f"Line {i}: " + "word " * (i % 7 + 3) for i in range(200))
    chunks = chunk_text(text, max_chars=300, overlap_chars=60)
    assert len(chunks) > 5
    for c in chunks:
        assert len(c.text) <= 300
        assert text[c.start : c.end].strip() == c.text
        assert c.text.startswith(f"Line {c.line_start - 1}:")  # lines are 1-based, content is 0-based
        assert c.text.splitlines()[-1].startswith(f"Line {c.line_end - 1}:")
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.start < a.end, "consecutive chunks overlap"
        assert b.start > a.start, "progress"
    assert chunks[0].start == 0 and chunks[-1].end == len(text)


def test_one_huge_line_is_split_at_sentences():
    text = " ".join(f"Sentence number {i} is here." for i in range(200))
    chunks = chunk_text(text, max_chars=200, overlap_chars=0)
    assert all(len(c.text) <= 200 for c in chunks)
    assert all(c.text.endswith(".") for c in chunks[:-1])
    assert "".join(text[c.start : c.end] for c in chunks) == text


def test_chunk_arguments_are_checked():
    with pytest.raises(ValueError):
        chunk_text("x", max_chars=10)
    with pytest.raises(ValueError):
        chunk_text("x", max_chars=100, overlap_chars=60)


# --------------------------------------------------------------------------------------------- readers
def test_html_reader_drops_scripts_and_keeps_blocks():
    text, title = html_to_text("<html><head><title>T &amp; U</title><script>var x=1;</script>"
                               "<style>p{}</style></head><body><p>One</p><p>Two &lt;3</p><ul><li>a</li></ul></body>")
    assert title == "T & U"
    assert "var x" not in text and "p{}" not in text
    assert text.splitlines() == ["One", "", "Two <3", "", "a"] or text.split() == ["One", "Two", "<3", "a"]


def test_readers_by_kind(tmp_path):
    doc = read_document(DOCS / "corpus" / "orrin_compiler.html")
    assert doc.kind == "html" and doc.title == "Orrin Compiler Manual"
    assert "--fold-consts" in doc.text and "analytics" not in doc.text
    assert read_document(DOCS / "corpus" / "tidewater_ferry.md").title.startswith("Tidewater Ferry")
    assert read_document(DOCS / "corpus" / "inventory.py").kind == "code"
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(ReaderError, match="binary"):
        read_document(binary)


# --------------------------------------------------------------------------------------------- the index
@pytest.fixture()
def folder(tmp_path):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "ferry.md").write_text("# Ferry\nThe ferry leaves at 05:40 and bicycles cost three credits.\n")
    (d / "bees.txt").write_text("Glass bees forage at night on moonflowers.\n")
    (d / "sub").mkdir()
    (d / "sub" / "rail.md").write_text("# Rail\nThe rack railway climbs at 18 percent through 14 tunnels.\n")
    (d / "image.png").write_bytes(b"\x89PNG\x00\x00")  # unsupported suffix: skipped when walking a folder
    return d


def test_add_search_list_remove(tmp_path, folder):
    with Index(tmp_path / "i.sqlite", embedder=HashEmbedder()) as index:
        results = index.add_paths([folder])
        assert sorted(r.status for r in results) == ["added"] * 3
        assert {Path(d.path).name for d in index.documents()} == {"ferry.md", "bees.txt", "rail.md"}
        for mode in ("vector", "bm25", "hybrid"):
            hits = index.search("which railway climbs through tunnels", k=2, mode=mode)
            assert Path(hits[0].path).name == "rail.md", mode
            assert hits[0].line_start == 1 and "18 percent" in hits[0].text
        assert [r.status for r in index.add_paths([folder])] == ["unchanged"] * 3
        assert index.remove([folder / "sub"]) == [str((folder / "sub" / "rail.md").resolve())]
        assert all(Path(h.path).name != "rail.md" for h in index.search("railway tunnels", k=5))
        assert index.stats()["documents"] == 2 and index.check() == []


def test_re_adding_a_changed_file_replaces_its_chunks(tmp_path, folder):
    with Index(tmp_path / "i.sqlite", embedder=HashEmbedder()) as index:
        index.add_paths([folder])
        (folder / "bees.txt").write_text("Glass bees now sleep all winter in sandy banks.\n" * 30)
        [result] = index.add_paths([folder / "bees.txt"])
        assert result.status == "updated" and result.chunks >= 2
        texts = " ".join(h.text for h in index.search("glass bees", k=20, mode="bm25"))
        assert "moonflowers" not in texts and "sandy banks" in texts
        rows = index.conn.execute("SELECT count(*) FROM chunks").fetchone()[0]
        assert rows == sum(d.n_chunks for d in index.documents())
        assert index.check() == []


def test_search_errors_and_wrong_embedder(tmp_path, folder):
    path = tmp_path / "i.sqlite"
    with Index(path, embedder=HashEmbedder()) as index:
        index.add_paths([folder / "ferry.md"])
        with pytest.raises(IndexStoreError):
            index.search("   ")
        with pytest.raises(IndexStoreError):
            index.search("ferry", k=0)
        with pytest.raises(IndexStoreError):
            index.search("ferry", mode="magic")
        assert index.search('ferry" OR (NEAR *', k=1, mode="bm25")  # FTS syntax in user text is harmless
    other = HashEmbedder()
    other.name = "another-model"
    with Index(path, embedder=other) as index, pytest.raises(IndexStoreError, match="built with test-hash"):
        index.add_paths([folder / "bees.txt"])
    with pytest.raises(FileNotFoundError):
        Index(tmp_path / "missing.sqlite", create=False)
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(IndexStoreError):
        Index(tmp_path / "junk.sqlite")


CRASH_SCRIPT = textwrap.dedent("""
    import os
    from quicksilver.testing import HashEmbedder
    from quicksilver.rag.store import Index

    index = Index({path!r}, embedder=HashEmbedder())
    real_insert = Index._insert_chunk
    calls = []
    def insert_then_die(self, *args):
        real_insert(self, *args)
        calls.append(1)
        if len(calls) == 3:
            os._exit(9)  # the process dies mid-transaction: no rollback, no exception handling
    Index._insert_chunk = insert_then_die
    index.add_paths([{file!r}])
""")


def test_crash_mid_ingest_leaves_index_consistent(tmp_path, folder):
    path = tmp_path / "i.sqlite"
    with Index(path, embedder=HashEmbedder()) as index:
        index.add_paths([folder])
        before = {d.path: d.n_chunks for d in index.documents()}
    (folder / "bees.txt").write_text("Replaced text about glass bees and winter nests.\n" * 40)
    script = CRASH_SCRIPT.format(path=str(path), file=str(folder / "bees.txt"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    with Index(path, embedder=HashEmbedder()) as index:
        assert index.check() == []
        assert {d.path: d.n_chunks for d in index.documents()} == before  # the old version survived whole
        assert "moonflowers" in index.search("glass bees", k=1, mode="bm25")[0].text
        [result] = index.add_paths([folder / "bees.txt"])  # and the interrupted file can simply be added again
        assert result.status == "updated" and index.check() == []


# --------------------------------------------------------------------------------------------- real retrieval
@pytest.fixture(scope="module")
def doc_index(tmp_path_factory):
    path = tmp_path_factory.mktemp("rag") / "docs.sqlite"
    with Index(path) as index:
        index.add_paths([DOCS / "corpus"])
    return path


def test_recall_on_shipped_collection(doc_index):
    questions = json.loads((DOCS / "questions.json").read_text())
    with Index(doc_index, create=False) as index:
        vectors = index.embedder.embed([q["question"] for q in questions])  # one batch instead of 24 calls
        for mode in ("vector", "hybrid"):
            ranked = [[Path(h.path).name for h in index.search(q["question"], k=5, mode=mode, query_vector=v)]
                      for q, v in zip(questions, vectors, strict=True)]
            top1 = [names[0] == q["source"] for q, names in zip(questions, ranked, strict=True)]
            top5 = [q["source"] in names for q, names in zip(questions, ranked, strict=True)]
            assert sum(top5) == len(questions), mode
            assert sum(top1) >= 0.9 * len(questions), mode


def test_augment_messages_adds_sources_and_keeps_input(doc_index):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Who was the keeper of Fenwick Point light?"}]}]
    snapshot = json.dumps(messages)
    out, sources = augment_messages(doc_index, messages, k=3)
    assert json.dumps(messages) == snapshot  # caller's list untouched
    assert len(out) == 2 and out[0] == messages[0]  # the system turn stays the caller's
    asked = out[1]["content"]  # the passages, numbered as the sources are, then the question
    assert asked.startswith("Passages:\n[1] ") and "\n[2] " in asked and "\n[3] " in asked
    assert asked.endswith("\n\nWho was the keeper of Fenwick Point light?") and "Elsie Drummond" in asked
    assert asked.index("Elsie Drummond") > asked.index("[1] ") and "(source:" not in asked
    assert len(sources) == 3 and Path(sources[0]["path"]).name == "fenwick_lighthouse.html"
    assert set(sources[0]) == {"id", "path", "title", "lines", "chunk", "score", "text"}
    assert [s["id"] for s in sources] == [1, 2, 3] and sources[0]["text"].strip() in asked
    later = [{"role": "user", "content": "ferry fares"}, {"role": "assistant", "content": "Which ferry?"},
             {"role": "user", "content": "   "}]  # a blank last turn: the question is the last one with text
    out, _ = augment_messages(doc_index, later, k=1)
    assert out[1:] == later[1:] and out[0]["content"].startswith("Passages:\n[1] ")
    assert out[0]["content"].endswith("\n\nferry fares") and "\n[2] " not in out[0]["content"]
    with pytest.raises(IndexStoreError):
        augment_messages(doc_index, [{"role": "user", "content": "x"}], k=0)
    with pytest.raises(IndexStoreError):
        augment_messages(doc_index, [{"role": "assistant", "content": "x"}], k=2)
    text, srcs = run_search_tool(doc_index, '{"query": "sourdough hydration", "k": 2}')
    assert "78 percent" in text and Path(srcs[0]["path"]).name == "sourdough_notes.txt"


# --------------------------------------------------------------------------------------------- CLI
def test_index_cli(tmp_path, folder, capsys):
    idx = str(tmp_path / "cli.sqlite")
    assert cli(["index", "--index", idx, "add", str(folder / "ferry.md"), str(folder / "bees.txt")]) == 0
    assert "2 added" in capsys.readouterr().out
    assert cli(["index", "--index", idx, "search", "when does the boat leave", "-k", "1", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert Path(hits[0]["path"]).name == "ferry.md"
    assert cli(["index", "--index", idx, "list"]) == 0
    assert "2 documents" in capsys.readouterr().out
    assert cli(["index", "--index", idx, "remove", str(folder / "bees.txt")]) == 0
    assert cli(["index", "--index", idx, "stats"]) == 0
    stats = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert stats["documents"] == 1 and stats["consistent"]
    assert cli(["index", "--index", idx, "remove", str(folder / "bees.txt")]) == 2  # nothing left to remove
    assert cli(["index", "--index", str(tmp_path / "none.sqlite"), "search", "x"]) == 2
    assert cli(["index", "--index", idx, "add", str(tmp_path / "missing.md")]) == 2
    err = capsys.readouterr().err
    assert "no such index" in err and "missing.md" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------- with a model
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from quicksilver.testing import save_tiny_model

    folder = tmp_path_factory.mktemp("ragmodel") / "tiny"
    save_tiny_model(folder, max_position_embeddings=4096)  # passages are long in the tiny byte-level vocabulary
    return folder


def test_server_retrieval_extension_lists_sources(doc_index, tiny_model_dir):
    from fastapi.testclient import TestClient

    from quicksilver.api.server import create_app
    from quicksilver.loading import load_model

    app = create_app(load_model(str(tiny_model_dir)), index_path=str(doc_index))
    with TestClient(app) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 8, "retrieval": {"k": 2},
                "messages": [{"role": "user", "content": "How steep is the Velin Pass rack railway?"}]}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        sources = r.json()["sources"]
        assert len(sources) == 2 and Path(sources[0]["path"]).name == "velin_pass_railway.md"
        r = client.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "railway"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        bad = client.post("/v1/chat/completions", json={**body, "retrieval": {"k": 0}})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("retrieval")


def test_ask_cli_with_and_without_retrieval(doc_index, tiny_model_dir, capsys):
    args = ["ask", "Who kept the Fenwick Point light?", "--index", str(doc_index), "--model", str(tiny_model_dir),
            "--max-tokens", "8", "-k", "2", "--json"]
    assert cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert Path(out["sources"][0]["path"]).name == "fenwick_lighthouse.html"
    assert out["prompt_tokens"] > 100 and out["stats"]["forwards"] >= 1  # the passages are in the prompt
    assert cli(args + ["--no-retrieval"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert bare["sources"] == [] and bare["prompt_tokens"] < out["prompt_tokens"]
    assert cli(["ask", "x", "--index", str(doc_index) + ".missing"]) == 2


def _tiny_pdf(text: str) -> bytes:
    """A one-page PDF with one line of Helvetica text, xref offsets computed (no PDF writer needed)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_pdf_reader(tmp_path, monkeypatch):
    pdf = tmp_path / "memo.pdf"
    pdf.write_bytes(_tiny_pdf("The vault code is 4471."))
    try:
        import pypdf  # noqa: F401
    except ImportError:
        pypdf = None
    if pypdf is not None:
        doc = read_document(pdf)
        assert doc.kind == "pdf" and "vault code is 4471" in doc.text
    monkeypatch.setitem(sys.modules, "pypdf", None)  # as if pypdf were not installed
    with pytest.raises(ReaderError, match="pip install pypdf"):
        read_document(pdf)


def test_index_cli_missing_folder_and_empty_index(tmp_path, capsys):
    """An index path in a folder that does not exist, and searching or asking an index with no documents: one-line
    errors and exit 2 (the first was a sqlite3 traceback, the others printed "0 hits" / answered without passages)."""
    assert cli(["index", "--index", str(tmp_path / "no" / "such" / "x.sqlite"), "add", str(DOCS)]) == 2
    assert "no such folder for the index x.sqlite" in capsys.readouterr().err
    assert cli(["index", "--index", str(tmp_path), "add", str(DOCS)]) == 2  # a folder given as the index file
    assert "cannot open the index" in capsys.readouterr().err
    empty = str(tmp_path / "empty.sqlite")
    assert cli(["index", "--index", empty, "add", str(tmp_path / "nothing_here")]) == 2
    Index(empty).close()  # a valid index with no documents
    assert cli(["index", "--index", empty, "list"]) == 0 and "0 documents" in capsys.readouterr().out
    assert cli(["index", "--index", empty, "search", "ferry"]) == 2
    assert cli(["ask", "When does the ferry leave?", "--index", empty]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err.count("the index is empty") == 2 and "Traceback" not in err
