"""Retrieval for chat: put the passages that match the user's question into the prompt, with their sources.

Used by the server (``serve --index FILE`` + a ``"retrieval": {"k": 5}`` request field), by ``quicksilver ask``,
and by the built-in ``search_documents`` tool (run by the agent, or by the server with ``"mode": "tool"``).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from quicksilver.rag.store import Hit, Index, IndexStoreError

MAX_K = 50
PASSAGES_HEADER = "Passages:\n"

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_documents",
        "description": "Search the document index and return the most relevant passages with their sources.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "description": "what to look for"},
                "k": {"type": "integer", "minimum": 1, "maximum": 20, "description": "number of passages"},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}

_indexes: dict[str, Index] = {}
_indexes_lock = threading.Lock()


def open_index(index_path: str | Path) -> Index:
    """One shared read handle per index file (the vector matrix stays cached between requests)."""
    key = str(Path(index_path).resolve())
    with _indexes_lock:
        if key not in _indexes:
            _indexes[key] = Index(key, create=False)
        return _indexes[key]


def message_text(content) -> str:
    """Text of an OpenAI message ``content``: a string, None, or a list of parts ({"type":"text","text":...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise IndexStoreError(f"unsupported message content of type {type(content).__name__}")


def last_user_index(messages: list[dict]) -> int:
    """Position of the last user message with text: the one retrieval searches for."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user" and message_text(messages[i].get("content")).strip():
            return i
    raise IndexStoreError("retrieval needs a user message with text to search for")


def source_of(hit: Hit, number: int) -> dict:
    """The JSON-able description of one retrieved passage (what a response lists as its sources)."""
    return {"id": number, "path": hit.path, "title": hit.title, "lines": [hit.line_start, hit.line_end],
            "chunk": hit.ord, "score": round(hit.score, 6), "text": hit.text}


def format_passages(hits: list[Hit], first_id: int = 1) -> str:
    return "\n\n".join(f"[{i}] (source: {Path(h.path).name}, lines {h.line_start}-{h.line_end})\n{h.text}"
                       for i, h in enumerate(hits, first_id))


def format_sources(sources: list[dict]) -> str:
    """The same numbered passages as :func:`format_passages`, rendered from :func:`source_of` dicts (so a caller
    can drop some, e.g. to fit the context, and re-render)."""
    return "\n\n".join(f"[{s['id']}] (source: {Path(s['path']).name}, lines {s['lines'][0]}-{s['lines'][1]})\n"
                       f"{s['text']}" for s in sources)


def retrieve(index_path: str | Path, query: str, k: int = 5, mode: str = "hybrid") -> list[Hit]:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise IndexStoreError(f"retrieval k must be an integer from 1 to {MAX_K}, got {k!r}")
    return open_index(index_path).search(query, k=k, mode=mode)


def augment_messages(
    index_path: str | Path, messages: list[dict], k: int = 5, mode: str = "hybrid"
) -> tuple[list[dict], list[dict]]:
    """(new messages, sources). The passages for the last user message go into that message, ahead of its text:
    "Passages:", then "[1] text", "[2] text", ..., then the question. That is how the retrieval drill shows
    passages to the shipped models; in the system turn with each passage's file and lines (the layout before
    session 43) they answered 15 and 30 of 200 held-out questions instead of 34 and 37 (docs/rag.md). The files
    and lines come back as ``sources``, numbered alike, so citations still resolve. The input list is not
    modified."""
    asked = last_user_index(messages)
    question = message_text(messages[asked].get("content")).strip()
    hits = retrieve(index_path, question, k, mode)
    out = [dict(m) for m in messages]
    if not hits:
        return out, []
    # one passage per line, as trained; a blank line between passages that span several lines
    separator = "\n\n" if any("\n" in h.text.strip() for h in hits) else "\n"
    passages = separator.join(f"[{i}] {h.text.strip()}" for i, h in enumerate(hits, 1))
    out[asked]["content"] = f"{PASSAGES_HEADER}{passages}\n\n{question}"
    return out, [source_of(h, i) for i, h in enumerate(hits, 1)]


def run_search_tool(
    index_path: str | Path, arguments: str | dict, default_k: int = 5, first_id: int = 1, max_k: int | None = None
) -> tuple[str, list[dict]]:
    """Execute a ``search_documents`` call: (observation text for the model, sources). Passages are numbered from
    ``first_id``, so that several searches in one conversation cite distinct numbers. ``max_k``: the most passages
    a call gets, whatever ``k`` it asks for."""
    args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
    if not isinstance(args, dict) or not isinstance(args.get("query"), str):
        raise IndexStoreError('search_documents needs {"query": "..."}')
    k = args.get("k", default_k)
    k = int(k) if isinstance(k, int | float) else default_k
    hits = retrieve(index_path, args["query"], k if max_k is None else min(k, max_k))
    if not hits:
        return "No matching passages.", []
    return format_passages(hits, first_id), [source_of(h, i) for i, h in enumerate(hits, first_id)]
