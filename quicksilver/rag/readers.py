"""Turn files into plain text for indexing: text/Markdown as is, HTML through the stdlib parser, PDF through
``pypdf`` when it is installed, and source files as code. Unknown binary files are refused with a clear error."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text", ".csv", ".log", ""}
HTML_SUFFIXES = {".html", ".htm", ".xhtml"}
CODE_SUFFIXES = {
    ".py", ".pyi", ".js", ".jsx", ".ts", ".tsx", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".kt",
    ".rb", ".php", ".sh", ".bash", ".sql", ".toml", ".yaml", ".yml", ".json", ".ini", ".cfg", ".css", ".swift",
    ".scala", ".lua", ".r", ".jl", ".cs", ".m", ".zig",
}
PDF_SUFFIXES = {".pdf"}
MAX_FILE_BYTES = 50 * 1024 * 1024


class ReaderError(ValueError):
    """A file that cannot be ingested (binary, unsupported, unreadable PDF)."""


@dataclass(frozen=True)
class Document:
    text: str
    kind: str  # text | markdown | html | pdf | code
    title: str


def supported(path: Path) -> bool:
    s = path.suffix.lower()
    return s in TEXT_SUFFIXES | HTML_SUFFIXES | CODE_SUFFIXES | PDF_SUFFIXES


class _HTMLText(HTMLParser):
    """Visible text with block elements on their own lines; script/style/head noise dropped."""

    SKIP = {"script", "style", "noscript", "template", "svg"}
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section", "article",
             "header", "footer", "blockquote", "table", "ul", "ol", "dt", "dd", "hr", "title"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title_parts: list[str] = []
        self._skip = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in self.SKIP:
            self._skip += 1
        elif tag == "title":
            self._in_title = True
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP and self._skip:
            self._skip -= 1
        elif tag == "title":
            self._in_title = False
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        if self._in_title:
            self.title_parts.append(data)
            return
        self.parts.append(data)


def html_to_text(html: str) -> tuple[str, str]:
    """(text, title) of an HTML page."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    lines = [re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in "".join(parser.parts).split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return text, " ".join("".join(parser.title_parts).split())


def _pdf_text(path: Path) -> str:
    try:
        from pypdf import PdfReader
    except ImportError as exc:
        raise ReaderError(f"{path}: reading PDF needs the pypdf package (pip install pypdf)") from exc
    pdf_log = logging.getLogger("pypdf")
    level = pdf_log.level
    pdf_log.setLevel(logging.ERROR)  # its warnings about a damaged file would print lines beside our one error
    try:
        pages = [page.extract_text() or "" for page in PdfReader(str(path)).pages]
    except Exception as exc:  # pypdf raises many types for damaged files
        raise ReaderError(f"{path}: cannot read PDF ({exc})") from exc
    finally:
        pdf_log.setLevel(level)
    return "\n\n".join(p.strip() for p in pages if p.strip())


def _decode(raw: bytes, path: Path) -> str:
    if b"\x00" in raw[:8192]:
        raise ReaderError(f"{path}: looks binary, not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # never fails; old text files are usually latin-1


def _first_heading(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            return line.strip()[:80]
    return ""


def read_document(path: str | Path) -> Document:
    path = Path(path)
    if not path.is_file():
        raise ReaderError(f"{path}: not a file")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ReaderError(f"{path}: larger than {MAX_FILE_BYTES // (1024 * 1024)} MB")
    suffix = path.suffix.lower()
    if suffix in PDF_SUFFIXES:
        text = _pdf_text(path)
        return Document(text, "pdf", _first_heading(text) or path.name)
    text = _decode(path.read_bytes(), path)
    if suffix in HTML_SUFFIXES:
        body, title = html_to_text(text)
        return Document(body, "html", title or _first_heading(body) or path.name)
    if suffix in CODE_SUFFIXES:
        return Document(text, "code", path.name)
    kind = "markdown" if suffix in {".md", ".markdown"} else "text"
    return Document(text, kind, _first_heading(text) or path.name)
