"""The document index: one SQLite file with documents, chunks, their vectors (float32 BLOBs) and an FTS5 table.

Why vectors in plain SQLite + numpy rather than sqlite-vec: at 100k chunks a numpy brute-force search over a
cached matrix was faster than sqlite-vec's brute-force scan and needs no native extension (numbers in
docs/rag.md). Each document is written in one transaction, so a crash mid-ingest leaves either the old version of
that document or the new one, never half of it; WAL mode lets a server read while the CLI adds.

Search is hybrid by default (vector ranks and FTS5 BM25 ranks fused by reciprocal rank): on the task suite's
invented-name retrieval questions it found the right passage first far more often than vectors alone, and it tied
the best mode on the shipped document set (docs/rag.md).
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from quicksilver.rag.chunking import DEFAULT_MAX_CHARS, DEFAULT_OVERLAP_CHARS, Chunk, chunk_text
from quicksilver.rag.readers import ReaderError, read_document, supported

SCHEMA_VERSION = 1
SEARCH_MODES = ("vector", "bm25", "hybrid")
RRF_K = 60  # reciprocal-rank-fusion constant (the usual value; it damps the weight of top ranks)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,
    title TEXT NOT NULL,
    kind TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    n_chunks INTEGER NOT NULL,
    first_chunk INTEGER NOT NULL,  -- chunk ids are first_chunk .. first_chunk + n_chunks - 1, in order
    vectors BLOB NOT NULL,  -- float32 [n_chunks, dim], one BLOB per document: 100k vectors load in ~0.5 s
    added_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY,
    doc_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    ord INTEGER NOT NULL,
    text TEXT NOT NULL,
    start INTEGER NOT NULL,
    end INTEGER NOT NULL,
    line_start INTEGER NOT NULL,
    line_end INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc_id);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(text, content='chunks', content_rowid='id');
CREATE TRIGGER IF NOT EXISTS chunks_ai AFTER INSERT ON chunks BEGIN
    INSERT INTO chunks_fts(rowid, text) VALUES (new.id, new.text);
END;
CREATE TRIGGER IF NOT EXISTS chunks_ad AFTER DELETE ON chunks BEGIN
    INSERT INTO chunks_fts(chunks_fts, rowid, text) VALUES ('delete', old.id, old.text);
END;
"""


class IndexStoreError(ValueError):
    """A user-facing index problem (not an index file, wrong embedder, bad query)."""


@dataclass(frozen=True)
class Hit:
    chunk_id: int
    path: str
    title: str
    text: str
    score: float
    ord: int
    line_start: int
    line_end: int

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def citation(self) -> str:
        return f"{self.path}:{self.line_start}-{self.line_end}"


@dataclass(frozen=True)
class DocInfo:
    path: str
    title: str
    kind: str
    n_chunks: int
    size: int
    added_at: float


@dataclass(frozen=True)
class AddResult:
    path: str
    status: str  # added | updated | unchanged | error
    chunks: int = 0
    error: str = ""


# Function words match nearly every chunk: OR-ing them in makes BM25 slow (every row scored) and adds no signal.
STOPWORDS = frozenset(
    "a an and are as at be but by can could did do does for from had has have how i if in into is it its me my "
    "no not of on or our she so than that the their them then there these they this to was we were what when "
    "where which who whom why will with would you your".split()
)


def _fts_query(text: str) -> str:
    """User text -> a safe FTS5 query: content words quoted and OR-ed (FTS5 syntax never reaches the parser)."""
    words = re.findall(r"\w+", text.lower())
    content = [w for w in words if w not in STOPWORDS] or words
    return " OR ".join(f'"{w}"' for w in dict.fromkeys(content))


def iter_files(paths: Iterable[str | Path]) -> Iterable[tuple[Path, bool]]:
    """(file, explicit) for each path; folders are walked (hidden entries skipped, unsupported files skipped)."""
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in {"__pycache__", "node_modules"})
                for name in sorted(files):
                    f = Path(root) / name
                    if not name.startswith(".") and supported(f):
                        yield f, False
        elif p.exists():
            yield p, True
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")


class Index:
    """A document index in one SQLite file. Safe to share between threads (one connection, one lock)."""

    def __init__(self, path: str | Path, create: bool = True, embedder=None):
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such index (create one with `quicksilver index add`)")
        if create and not self.path.parent.is_dir():
            raise FileNotFoundError(f"{self.path.parent}: no such folder for the index {self.path.name}")
        self._embedder = embedder
        self._lock = threading.RLock()
        try:
            self.conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:  # e.g. a folder given as the index, or no permission
            raise IndexStoreError(f"{self.path}: cannot open the index ({exc})") from exc
        try:
            self.conn.execute("PRAGMA busy_timeout=10000")
            # before anything writes (switching to WAL writes a header): a reader must leave a stray file as it is
            existing = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if existing or create:
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise IndexStoreError(f"{self.path}: not a quicksilver index ({exc})") from exc
        if existing and "meta" not in existing:
            self.conn.close()
            raise IndexStoreError(f"{self.path}: not a quicksilver index (an unrelated SQLite file)")
        if not existing and not create:  # e.g. an empty file: reading it must not turn it into an index
            self.conn.close()
            raise IndexStoreError(f"{self.path}: not a quicksilver index (an empty file)")
        try:
            self.conn.executescript(_SCHEMA)
        except sqlite3.Error as exc:  # e.g. a read-only file or folder
            self.conn.close()
            raise IndexStoreError(f"{self.path}: cannot write the index ({exc})") from exc
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None  # (generation, chunk ids, matrix)

    # ----------------------------------------------------------------- metadata
    def _meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def _generation(self) -> int:
        return int(self._meta("generation") or 0)

    @property
    def embedder(self):
        if self._embedder is None:
            from quicksilver.embeddings import get_embedder

            self._embedder = get_embedder()
        return self._embedder

    def _check_embedder(self, name: str, dim: int) -> None:
        stored = self._meta("embedder"), self._meta("dim")
        if stored[0] is not None and (stored[0], int(stored[1] or 0)) != (name, dim):
            raise IndexStoreError(f"{self.path} was built with {stored[0]} (dim {stored[1]}), not {name} (dim {dim})")

    # ----------------------------------------------------------------- writing
    def _write(self, fn: Callable[[sqlite3.Connection], None], embedder_name: str, dim: int) -> None:
        """Run fn inside one IMMEDIATE transaction and bump the generation; any error rolls everything back."""
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self._check_embedder(embedder_name, dim)
                fn(self.conn)
                self.conn.executemany(
                    "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    [("schema", str(SCHEMA_VERSION)), ("embedder", embedder_name), ("dim", str(dim)),
                     ("generation", str(self._generation() + 1))],
                )
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise

    def put_document(
        self, path: str, title: str, kind: str, sha256: str, size: int, chunks: Sequence[Chunk], vectors: np.ndarray,
        embedder_name: str | None = None,
    ) -> None:
        """Insert or replace one document with its chunks and vectors (rows of ``vectors`` match ``chunks``)."""
        if len(chunks) != len(vectors):
            raise ValueError(f"{len(chunks)} chunks but {len(vectors)} vectors")
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        name = embedder_name or self.embedder.name

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM documents WHERE path=?", (path,))  # cascades to chunks and (trigger) FTS
            first = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM chunks").fetchone()[0]
            cur = conn.execute(
                "INSERT INTO documents(path, title, kind, sha256, size, n_chunks, first_chunk, vectors, added_at) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                (path, title, kind, sha256, size, len(chunks), first, vectors.tobytes(), time.time()),
            )
            doc_id = cur.lastrowid
            for i, c in enumerate(chunks):
                self._insert_chunk(conn, doc_id, first + i, i, c)

        self._write(write, name, int(vectors.shape[1]) if len(vectors) else self._dim_or(name))

    def _dim_or(self, name: str) -> int:
        stored = self._meta("dim")
        return int(stored) if stored else self.embedder.dim

    def _insert_chunk(self, conn: sqlite3.Connection, doc_id: int, chunk_id: int, ord_: int, c: Chunk) -> None:
        conn.execute(
            "INSERT INTO chunks(id, doc_id, ord, text, start, end, line_start, line_end) VALUES (?,?,?,?,?,?,?,?)",
            (chunk_id, doc_id, ord_, c.text, c.start, c.end, c.line_start, c.line_end),
        )

    def add_paths(
        self,
        paths: Iterable[str | Path],
        max_chars: int = DEFAULT_MAX_CHARS,
        overlap_chars: int = DEFAULT_OVERLAP_CHARS,
        force: bool = False,
        on_result: Callable[[AddResult], None] | None = None,
    ) -> list[AddResult]:
        """Ingest files/folders. Unchanged files (same SHA-256) are skipped; changed ones replace their chunks."""
        paths = list(paths)
        missing = [str(p) for p in paths if not Path(p).exists()]
        if missing:  # check everything first: a typo in the last path should not cost a long ingest
            raise FileNotFoundError(f"{', '.join(missing)}: no such file or folder")
        results = []
        for file, explicit in iter_files(paths):
            result = self._add_file(file, explicit, max_chars, overlap_chars, force)
            results.append(result)
            if on_result is not None:
                on_result(result)
        return results

    def _add_file(self, file: Path, explicit: bool, max_chars: int, overlap_chars: int, force: bool) -> AddResult:
        key = str(file.resolve())
        raw = file.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        row = self.conn.execute("SELECT sha256 FROM documents WHERE path=?", (key,)).fetchone()
        if row and row[0] == digest and not force:
            return AddResult(key, "unchanged")
        try:
            doc = read_document(file)
        except ReaderError as exc:
            if explicit:
                raise
            return AddResult(key, "error", error=str(exc))
        chunks = chunk_text(doc.text, max_chars, overlap_chars)
        vectors = self.embedder.embed([c.text for c in chunks]) if chunks else np.zeros((0, self.embedder.dim))
        self.put_document(key, doc.title, doc.kind, digest, len(raw), chunks, vectors)  # embed first, write fast
        return AddResult(key, "updated" if row else "added", len(chunks))

    def remove(self, paths: Iterable[str | Path]) -> list[str]:
        """Remove documents by path; a folder removes every document under it. Returns the removed paths."""
        removed: list[str] = []
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                for raw in paths:
                    key = str(Path(raw).resolve())
                    rows = self.conn.execute(
                        "SELECT path FROM documents WHERE path=? OR substr(path, 1, ?)=?",
                        (key, len(key) + 1, key.rstrip(os.sep) + os.sep),
                    ).fetchall()
                    for (p,) in rows:
                        self.conn.execute("DELETE FROM documents WHERE path=?", (p,))
                        removed.append(p)
                if removed:
                    self.conn.execute(
                        "INSERT INTO meta(key, value) VALUES ('generation', ?) "
                        "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (str(self._generation() + 1),))
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
        return removed

    # ----------------------------------------------------------------- reading
    def documents(self) -> list[DocInfo]:
        rows = self.conn.execute(
            "SELECT path, title, kind, n_chunks, size, added_at FROM documents ORDER BY path").fetchall()
        return [DocInfo(*r) for r in rows]

    def stats(self) -> dict:
        docs, chunks = self.conn.execute("SELECT count(*), coalesce(sum(n_chunks), 0) FROM documents").fetchone()
        return {"path": str(self.path), "documents": docs, "chunks": chunks, "embedder": self._meta("embedder"),
                "dim": int(self._meta("dim") or 0), "bytes": self.path.stat().st_size if self.path.exists() else 0}

    def require_documents(self) -> None:
        """LookupError when nothing is indexed: a search or an answer with no passages would look like one with them."""
        if not self.stats()["chunks"]:
            raise LookupError(f"{self.path}: the index is empty (add documents with `quicksilver index add`)")

    def check(self) -> list[str]:
        """Consistency problems (empty list = consistent): chunk counts, FTS rows, vector sizes."""
        problems = []
        bad = self.conn.execute(
            "SELECT d.path FROM documents d LEFT JOIN chunks c ON c.doc_id=d.id GROUP BY d.id "
            "HAVING count(c.id) != d.n_chunks").fetchall()
        problems += [f"{p}: chunk count mismatch" for (p,) in bad]
        orphans = self.conn.execute(
            "SELECT count(*) FROM chunks WHERE doc_id NOT IN (SELECT id FROM documents)").fetchone()[0]
        if orphans:
            problems.append(f"{orphans} orphan chunks")
        dim = int(self._meta("dim") or 0)
        wrong = self.conn.execute(
            "SELECT count(*) FROM documents WHERE length(vectors) != 4 * ? * n_chunks", (dim,)).fetchone()[0]
        if wrong:
            problems.append(f"{wrong} documents with vectors of the wrong size")
        misplaced = self.conn.execute(
            "SELECT count(*) FROM chunks c JOIN documents d ON d.id=c.doc_id WHERE c.id != d.first_chunk + c.ord"
        ).fetchone()[0]
        if misplaced:
            problems.append(f"{misplaced} chunks out of place")
        try:  # FTS5 compares its index with the chunks table and raises when they disagree
            self.conn.execute("INSERT INTO chunks_fts(chunks_fts, rank) VALUES ('integrity-check', 1)")
        except sqlite3.DatabaseError as exc:
            problems.append(f"full-text index out of step with the chunks ({exc})")
        return problems

    def _matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """(chunk ids, [N, dim] vectors), cached until the next write by anyone (the generation counter)."""
        gen = self._generation()
        if self._cache is None or self._cache[0] != gen:
            rows = self.conn.execute("SELECT first_chunk, n_chunks, vectors FROM documents ORDER BY id").fetchall()
            dim = int(self._meta("dim") or 0)
            ids = np.concatenate([np.arange(f, f + n, dtype=np.int64) for f, n, _ in rows] or [np.zeros(0, np.int64)])
            mat = np.frombuffer(b"".join(r[2] for r in rows), dtype=np.float32).reshape(len(ids), dim)
            self._cache = (gen, ids, mat)
        return self._cache[1], self._cache[2]

    def _vector_ranking(self, query_vec: np.ndarray, n: int) -> list[tuple[int, float]]:
        ids, mat = self._matrix()
        if not len(ids):
            return []
        scores = mat @ query_vec.astype(np.float32)
        n = min(n, len(ids))
        top = np.argpartition(-scores, n - 1)[:n]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(ids[i]), float(scores[i])) for i in top]

    def _bm25_ranking(self, query: str, n: int) -> list[tuple[int, float]]:
        q = _fts_query(query)
        if not q:
            return []
        rows = self.conn.execute(
            "SELECT rowid, bm25(chunks_fts) FROM chunks_fts WHERE chunks_fts MATCH ? ORDER BY bm25(chunks_fts) LIMIT ?",
            (q, n)).fetchall()
        return [(int(r[0]), -float(r[1])) for r in rows]  # bm25() is lower-is-better; flip so higher is better

    def search(self, query: str, k: int = 5, mode: str = "hybrid", query_vector: np.ndarray | None = None) -> list[Hit]:
        if not isinstance(query, str) or not query.strip():
            raise IndexStoreError("the search query is empty")
        if k < 1:
            raise IndexStoreError(f"k must be at least 1, got {k}")
        if mode not in SEARCH_MODES:
            raise IndexStoreError(f"unknown search mode {mode!r}; choose from {', '.join(SEARCH_MODES)}")
        with self._lock:
            if mode == "bm25":
                ranked = self._bm25_ranking(query, k)
            else:
                vec = query_vector if query_vector is not None else self.embedder.embed(query)
                if mode == "vector":
                    ranked = self._vector_ranking(vec, k)
                else:
                    pool = max(50, 4 * k)
                    fused: dict[int, float] = {}
                    for ranking in (self._vector_ranking(vec, pool), self._bm25_ranking(query, pool)):
                        for rank, (cid, _) in enumerate(ranking):
                            fused[cid] = fused.get(cid, 0.0) + 1.0 / (RRF_K + rank + 1)
                    ranked = sorted(fused.items(), key=lambda kv: -kv[1])[:k]
            return self._hits(ranked)

    def _hits(self, ranked: list[tuple[int, float]]) -> list[Hit]:
        if not ranked:
            return []
        marks = ",".join("?" * len(ranked))
        rows = self.conn.execute(
            f"SELECT c.id, d.path, d.title, c.text, c.ord, c.line_start, c.line_end FROM chunks c "
            f"JOIN documents d ON d.id=c.doc_id WHERE c.id IN ({marks})", [cid for cid, _ in ranked]).fetchall()
        by_id = {r[0]: r for r in rows}
        return [Hit(cid, by_id[cid][1], by_id[cid][2], by_id[cid][3], score, by_id[cid][4], by_id[cid][5],
                    by_id[cid][6]) for cid, score in ranked if cid in by_id]

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
