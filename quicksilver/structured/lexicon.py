"""The byte string each token id stands for, as numpy arrays the automata can run over in bulk.

Slot automata work on bytes (JSON escaping and UTF-8 are byte-level facts), so every token is turned into
its bytes once per tokenizer: byte-level BPE vocabularies through the GPT-2 byte<->unicode table,
SentencePiece-style ones through ``<0xNN>`` byte tokens and the ``▁`` space marker. Special tokens have no
bytes: value slots never contain them (except the dedicated filler).
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import numpy as np

from quicksilver.tokenizer import RAINBOW_PADS, TOOL_CALLS, Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100.."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


@dataclass
class Lexicon:
    """Bytes of every token of a vocabulary (``lengths[i] == 0`` for special or empty tokens)."""

    size: int  # number of token ids (the tokenizer's vocabulary, added tokens included)
    byte_matrix: np.ndarray  # [size, max_len] uint8, zero padded
    lengths: np.ndarray  # [size] int32
    special: np.ndarray  # [size] bool
    filler_id: int | None  # a special token that decodes to nothing and does not end a response

    def token_bytes(self, token_id: int) -> bytes:
        return bytes(self.byte_matrix[token_id, : self.lengths[token_id]].tolist())

    def first_byte_ids(self, byte: int) -> np.ndarray:
        """Token ids whose text starts with ``byte``."""
        return np.nonzero((self.lengths > 0) & (self.byte_matrix[:, 0] == byte))[0]


_cache: weakref.WeakKeyDictionary[Tokenizer, Lexicon] = weakref.WeakKeyDictionary()


def lexicon_for(tokenizer: Tokenizer) -> Lexicon:
    lex = _cache.get(tokenizer)
    if lex is None:
        lex = _build(tokenizer)
        _cache[tokenizer] = lex
    return lex


def _build(tokenizer: Tokenizer) -> Lexicon:
    backend = tokenizer.backend
    size = tokenizer.vocab_size
    added = {i: t for i, t in backend.get_added_tokens_decoder().items()}
    byte_level = "ByteLevel" in repr(backend.decoder)
    u2b = _unicode_to_byte()
    rows: list[bytes] = []
    special = np.zeros(size, dtype=bool)
    for i in range(size):
        tok = backend.id_to_token(i)
        if i in added:
            if added[i].special or i in tokenizer.special_ids:
                special[i] = True
                rows.append(b"")
            else:
                rows.append(added[i].content.encode("utf-8"))
            continue
        if tok is None:
            rows.append(b"")
            continue
        if byte_level:
            try:
                rows.append(bytes(u2b[c] for c in tok))
            except KeyError:  # not a byte-level symbol: take the text as is
                rows.append(tok.encode("utf-8"))
            continue
        m = _BYTE_TOKEN.match(tok)
        if m:
            rows.append(bytes([int(m.group(1), 16)]))
        else:
            rows.append(tok.replace("\u2581", " ").encode("utf-8"))
    max_len = max(1, max(len(r) for r in rows))
    matrix = np.zeros((size, max_len), dtype=np.uint8)
    lengths = np.zeros(size, dtype=np.int32)
    for i, r in enumerate(rows):
        if r:
            matrix[i, : len(r)] = np.frombuffer(r, dtype=np.uint8)
            lengths[i] = len(r)
    return Lexicon(size, matrix, lengths, special, _pick_filler(tokenizer, special))


def _pick_filler(tokenizer: Tokenizer, special: np.ndarray) -> int | None:
    """The slot filler: the first rainbow pad, else another special token (not mask/EOS/pad/tool marker).

    Special tokens are dropped by ``decode(skip_special_tokens=True)``, so fillers vanish from the text.
    """
    # end tokens are fine (the constraint marks committed fillers fixed, so they never end the answer) but
    # never the mask, EOS, pad or the tool-call marker (servers look for it in the token ids)
    banned = {tokenizer.mask_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.token_id(TOOL_CALLS)}
    for name in RAINBOW_PADS:
        tid = tokenizer.token_id(name)
        if tid is not None and tid not in banned:
            return tid
    for tid in np.nonzero(special)[0].tolist():
        if tid not in banned:
            return int(tid)
    return None
