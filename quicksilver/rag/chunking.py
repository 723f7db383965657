"""Split a document into overlapping chunks that fit the embedder (MiniLM reads at most 256 word pieces).

Text is cut into *units* (paragraph lines for prose, lines for code) which are packed greedily up to
``max_chars``; the next chunk starts with the trailing units of the previous one (up to ``overlap_chars``) so a
fact that straddles a boundary is whole in at least one chunk. Every chunk keeps its character span and line
range so a retrieved passage can be cited precisely.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ~4 characters per word piece for English prose: 900 chars stays under the encoder's 256-token window
DEFAULT_MAX_CHARS = 900
DEFAULT_OVERLAP_CHARS = 150


@dataclass(frozen=True)
class Chunk:
    text: str
    start: int  # character offsets into the document text
    end: int
    line_start: int  # 1-based, inclusive
    line_end: int


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _units(text: str, max_chars: int) -> list[tuple[int, int]]:
    """(start, end) spans of lines; a line longer than max_chars is split at sentence ends, then hard-cut."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for line in text.splitlines(keepends=True):
        start, end = pos, pos + len(line)
        pos = end
        if not line.strip():
            continue
        while end - start > max_chars:
            window = text[start : start + max_chars]
            cuts = [m.end() for m in _SENTENCE_END.finditer(window)]
            cut = cuts[-1] if cuts and cuts[-1] > max_chars // 3 else window.rfind(" ", max_chars // 2) + 1
            if cut <= 0:
                cut = max_chars
            spans.append((start, start + cut))
            start += cut
        spans.append((start, end))
    return spans


def chunk_text(
    text: str, max_chars: int = DEFAULT_MAX_CHARS, overlap_chars: int = DEFAULT_OVERLAP_CHARS
) -> list[Chunk]:
    if max_chars < 50:
        raise ValueError(f"max_chars must be at least 50, got {max_chars}")
    if not 0 <= overlap_chars < max_chars // 2:
        raise ValueError(f"overlap_chars must be in [0, max_chars/2), got {overlap_chars}")
    units = _units(text, max_chars)
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def line_of(offset: int) -> int:
        lo, hi = 0, len(line_starts) - 1
        while lo < hi:  # last line start <= offset
            mid = (lo + hi + 1) // 2
            if line_starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    chunks: list[Chunk] = []
    i = 0
    while i < len(units):
        j = i
        while j < len(units) and (j == i or units[j][1] - units[i][0] <= max_chars):
            j += 1
        start, end = units[i][0], units[j - 1][1]
        body = text[start:end].strip()
        if body:
            chunks.append(Chunk(body, start, end, line_of(start), line_of(max(start, end - 1))))
        if j >= len(units):
            break
        # step back over trailing units that fit in the overlap, but always move forward at least one unit
        k = j
        while k - 1 > i and units[j - 1][1] - units[k - 1][0] <= overlap_chars:
            k -= 1
        i = k
    return chunks
