"""Natural text and code that can be had offline, prepared once into ``runs/corpus/`` (gitignored).

Sources (each optional: a missing one is skipped and recorded as absent in the manifest):

* ``python_docs``   — reStructuredText sources of the Python documentation (Debian ``python3.11-doc``)
* ``docstrings``    — long docstrings from the Python standard library on this machine
* ``stdlib_code``   — Python standard library source files (tests excluded)
* ``fortunes``      — quotes from Debian ``fortunes`` (offensive set excluded)
* ``gcide``         — GNU Collaborative International Dictionary of English (Debian ``dict-gcide``)

To repeat the setup: ``apt-get install -y python3.11-doc fortunes dict-gcide`` then ``quicksilver data prepare``.
Each source is capped so preparation and loading stay fast; files are read in sorted order so the prepared
corpus is the same on every machine with the same packages.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import sysconfig
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CORPUS_DIR = Path(os.environ.get("QUICKSILVER_CORPUS_DIR", REPO_ROOT / "runs" / "corpus"))
MANIFEST = "manifest.json"

PY_DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
FORTUNES_DIR = Path("/usr/share/games/fortunes")
GCIDE = Path("/usr/share/dictd/gcide.dict.dz")
MB = 1 << 20


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    root = _stdlib_dir()
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & skip or path.name.startswith("test_"):
            continue
        files.append(path)
    return files


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _python_docs() -> Iterator[str]:
    for path in sorted(PY_DOC_SOURCES.rglob("*.txt")):
        text = _read(path)
        if text and len(text) > 200:
            yield text


def _docstrings() -> Iterator[str]:
    for path in _stdlib_files():
        source = _read(path)
        if source is None:
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    yield doc


def _stdlib_code() -> Iterator[str]:
    for path in _stdlib_files():
        source = _read(path)
        if source and len(source) > 200:
            yield source


def _fortunes() -> Iterator[str]:
    for path in sorted(p for p in FORTUNES_DIR.iterdir() if p.is_file() and not p.suffix and not p.is_symlink()):
        text = _read(path)
        if not text:
            continue
        for quote in text.split("\n%\n"):
            quote = quote.strip("%\n ")
            if len(quote) > 40:
                yield quote


_GCIDE_HEADWORD = re.compile(r"^\S[^\n]* \\[^\n]*\\")  # "headword \\pronunciation\\ part-of-speech"
GCIDE_STRIDE = 6  # keep every 6th entry so the byte cap spans the whole alphabet, not just A-C


def _gcide() -> Iterator[str]:
    with gzip.open(GCIDE, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    # an entry starts at a line in column 0 with "headword \\pronunciation\\"; the database header,
    # licence notes and section banners do not look like that and are skipped
    entries = (c for c in re.split(r"\n(?=\S)", text) if _GCIDE_HEADWORD.match(c) and len(c) > 60)
    for i, chunk in enumerate(entries):
        if i % GCIDE_STRIDE == 0:
            yield chunk.rstrip()


# name -> (reader, availability check, byte cap, kind)
SOURCES: dict[str, tuple[Callable[[], Iterator[str]], Callable[[], bool], int, str]] = {
    "python_docs": (_python_docs, PY_DOC_SOURCES.is_dir, 12 * MB, "text"),
    "docstrings": (_docstrings, lambda: _stdlib_dir().is_dir(), 4 * MB, "text"),
    "gcide": (_gcide, GCIDE.is_file, 6 * MB, "text"),
    "fortunes": (_fortunes, FORTUNES_DIR.is_dir, 3 * MB, "text"),
    "stdlib_code": (_stdlib_code, lambda: _stdlib_dir().is_dir(), 8 * MB, "code"),
}


def prepare_corpus(folder: str | Path | None = None, force: bool = False) -> dict:
    """Write ``<source>.jsonl`` (one document per line) and ``manifest.json``; returns the manifest."""
    folder = Path(folder or CORPUS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path = folder / MANIFEST
    if manifest_path.is_file() and not force:
        return json.loads(manifest_path.read_text())
    manifest: dict = {"sources": {}}
    for name, (reader, available, cap, kind) in SOURCES.items():
        if not available():
            manifest["sources"][name] = {"available": False, "kind": kind}
            continue
        size = docs = 0
        tmp = folder / f"{name}.jsonl.{os.getpid()}.tmp"  # two trainers may prepare at once: no shared temp file
        with tmp.open("w", encoding="utf-8") as out:
            for doc in reader():
                out.write(json.dumps(doc, ensure_ascii=False) + "\n")
                size += len(doc.encode("utf-8"))
                docs += 1
                if size >= cap:
                    break
        tmp.replace(folder / f"{name}.jsonl")
        manifest["sources"][name] = {"available": True, "kind": kind, "documents": docs, "bytes": size}
    tmp_manifest = folder / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp_manifest.replace(manifest_path)  # atomic: readers see no manifest or a complete one
    return manifest


def load_corpus(folder: str | Path | None = None) -> dict[str, list[str]]:
    """source name -> documents (prepares the corpus first if needed); absent sources are left out."""
    return _load_corpus(str(folder or CORPUS_DIR))


@lru_cache(maxsize=4)
def _load_corpus(folder: str) -> dict[str, list[str]]:
    path = Path(folder)
    manifest = prepare_corpus(path)
    corpus = {}
    for name, info in manifest["sources"].items():
        file = path / f"{name}.jsonl"
        if info.get("available") and file.is_file():
            with file.open(encoding="utf-8") as f:
                corpus[name] = [json.loads(line) for line in f]
    return corpus


def source_kind(name: str) -> str:
    return SOURCES[name][3] if name in SOURCES else "text"
