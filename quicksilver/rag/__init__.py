"""Retrieval-augmented generation: read files, chunk, embed, store in SQLite, search (vector, BM25, hybrid)."""

from quicksilver.rag.chunking import Chunk, chunk_text
from quicksilver.rag.readers import Document, ReaderError, read_document
from quicksilver.rag.store import AddResult, DocInfo, Hit, Index, IndexStoreError

__all__ = [
    "AddResult", "Chunk", "DocInfo", "Document", "Hit", "Index", "IndexStoreError", "ReaderError", "chunk_text",
    "read_document",
]
