"""A skeleton laid out as canvas tokens: pinned token runs and value slots with token budgets."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from quicksilver.structured.automata import SlotSolver, TokenAutomaton, TooManyStates
from quicksilver.structured.lexicon import Lexicon
from quicksilver.structured.schema import Piece, SchemaTooLarge, Slot, UnsupportedSchema
from quicksilver.structured.segmentation import Pinned
from quicksilver.structured.values import UnionError, build
from quicksilver.tokenizer import Tokenizer

MAX_SLOT_TOKENS = 64  # fixed layout: flexible slots grow up to this when the canvas has room
AUTOMATA_PER_VOCABULARY = 48  # compiled value automata kept per tokenizer (LRU)


@dataclass
class SlotRun:
    offset: int  # first canvas position, relative to the start of the answer
    length: int
    solver: SlotSolver
    closers: np.ndarray  # token ids that mean "this value is over" (their mass goes to the filler)
    flexible: bool = False  # a value of open length (a string, an array): the lazy layout may widen its slot

    @property
    def automaton(self) -> TokenAutomaton:
        return self.solver.a


@dataclass
class Layout:
    tokens: list[int]  # token id per relative position, -1 inside slots
    slots: list[SlotRun]

    @property
    def length(self) -> int:
        return len(self.tokens)


_cache_lock = threading.Lock()  # the server builds constraints in worker threads while the engine plans layouts


def automaton_for(spec: tuple, lex: Lexicon) -> TokenAutomaton:
    with _cache_lock:
        cache: OrderedDict = lex.__dict__.setdefault("_automata", OrderedDict())
        auto = cache.get(spec)
        if auto is not None:
            cache.move_to_end(spec)
    if auto is None:
        try:
            byte_auto = build(spec)
        except UnionError as exc:
            raise UnsupportedSchema(str(exc)) from None
        if byte_auto is None:
            raise UnsupportedSchema(f"no value satisfies {_describe(spec)}")
        try:
            auto = TokenAutomaton(byte_auto, lex)
        except TooManyStates as exc:
            raise SchemaTooLarge(f"{_describe(spec)} is too large to enforce ({exc})") from None
        with _cache_lock:
            cache[spec] = auto
            while len(cache) > AUTOMATA_PER_VOCABULARY:  # bounded: servers see many different schemas
                cache.popitem(last=False)
    return auto


def _describe(spec: tuple) -> str:
    if spec[0] == "affix":
        return _describe(spec[2])
    if spec[0] == "number":
        _, integer, lo, hi, lo_x, hi_x = spec
        kind = "integer" if integer else "number"
        return f"{kind} range [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
    if spec[0] in ("string", "qstring") and len(spec) > 1:
        lo, hi, pattern = (spec[1:] + (None,))[:3]
        parts = [f"minLength {lo}" if lo else "", f"maxLength {hi}" if hi is not None else "",
                 f"pattern {pattern!r}" if pattern else ""]
        return "a string with " + ", ".join(p for p in parts if p)
    return f"the {spec[0]} value"


@dataclass
class _Planned:
    slot: Slot
    automaton: TokenAutomaton
    min_len: int
    budget: int


def lay_out(
    pieces: list[Piece | Pinned], tokenizer: Tokenizer, lex: Lexicon, max_tokens: int | None,
    end_ids: tuple[int, ...] = (),
) -> Layout:
    """Tokenize the fixed text, size the slots to fit ``max_tokens`` (ValueError if impossible).

    Pieces are text, :class:`Pinned` token ids, or slots."""
    if lex.filler_id is None:
        raise UnsupportedSchema("the tokenizer has no spare special token to pad value slots with")
    encoded: list[list[int] | _Planned] = []
    for p in pieces:
        if isinstance(p, str):
            encoded.append(tokenizer.encode(p))
            continue
        if isinstance(p, Pinned):  # token ids cut from the canonical text
            encoded.append(list(p))
            continue
        auto = automaton_for(p.spec, lex)
        solver = SlotSolver(auto)
        min_len = solver.min_length()
        if min_len is None:
            raise UnsupportedSchema(f"no value of {_describe(p.spec)} can be written with this vocabulary")
        budget = max(p.budget, min_len)
        pre, inner, suf = (p.spec[1], p.spec[2], p.spec[3]) if p.spec[0] == "affix" else ("", p.spec, "")
        if inner[0] == "literals":  # room for the longest alternative as the tokenizer writes it
            budget = max(budget, *(len(tokenizer.encode(pre + t + suf)) for t in inner[1]))
        encoded.append(_Planned(p, auto, min_len, budget))
    fixed = sum(len(e) for e in encoded if isinstance(e, list))
    slots = [e for e in encoded if isinstance(e, _Planned)]
    if max_tokens is not None:
        _fit(slots, max_tokens - fixed, max_tokens)
    tokens: list[int] = []
    runs: list[SlotRun] = []
    for i, e in enumerate(encoded):
        if isinstance(e, list):
            tokens.extend(e)
            continue
        closers = _closers(lex, _following_bytes(encoded[i + 1:], lex), end_ids)
        runs.append(SlotRun(len(tokens), e.budget, SlotSolver(e.automaton), closers, e.slot.flexible))
        tokens.extend([-1] * e.budget)
    return Layout(tokens, runs)


def _fit(slots: list[_Planned], room: int, max_tokens: int) -> None:
    need = sum(s.min_len for s in slots)
    if need > room:
        raise ValueError(
            f"the JSON skeleton needs at least {max_tokens - room + need} tokens but max_tokens is {max_tokens}"
        )
    total = sum(s.budget for s in slots)
    flexible = [s for s in slots if s.slot.flexible]
    while total > room:  # shrink the largest flexible slot one token at a time
        cand = [s for s in slots if s.budget > s.min_len]
        best = max(cand, key=lambda s: s.budget - s.min_len)
        best.budget -= 1
        total -= 1
    # spare canvas: each flexible slot may double once (up to MAX_SLOT_TOKENS); the rest stays unused
    spare = room - total
    for s in flexible:
        grow = min(spare, s.budget, MAX_SLOT_TOKENS - s.budget)
        if grow > 0:
            s.budget += grow
            spare -= grow


def _closers(lex: Lexicon, next_bytes: set[int], end_ids: tuple[int, ...]) -> np.ndarray:
    ids = set(end_ids)
    for b in next_bytes:
        ids.update(lex.first_byte_ids(b).tolist())
    return np.array(sorted(ids), dtype=np.int64)


def _following_bytes(rest: list, lex: Lexicon) -> set[int]:
    """Bytes the text after a slot can start with: the next pinned token's first byte, or the first bytes of the
    slots before it (an optional property's slot may hold nothing, so what follows it counts too)."""
    out: set[int] = set()
    for e in rest:
        if isinstance(e, list):
            if e:
                text = lex.token_bytes(e[0])
                if text:
                    out.add(text[0])
                return out
            continue
        first = _first_bytes(e.slot.spec)
        if first is None:  # a value that could start with many bytes: what comes after it decides, as before
            continue
        found, may_be_empty = first
        out |= found
        if not may_be_empty:
            return out
    return out


def _first_bytes(spec: tuple) -> tuple[set[int], bool] | None:
    """(bytes a value of ``spec`` can start with, whether it can be empty), for the specs whose first byte is
    fixed text; None for the others."""
    kind = spec[0]
    if kind == "affix":
        if spec[1]:
            return {spec[1].encode("utf-8")[0]}, False
        inner = _first_bytes(spec[2])
        if inner is None or not inner[1] or not spec[3]:
            return inner
        return inner[0] | {spec[3].encode("utf-8")[0]}, False
    if kind == "literals":
        return {t.encode("utf-8")[0] for t in spec[1] if t}, any(t == "" for t in spec[1])
    if kind == "seq":
        first = spec[1][0] if spec[1] else None
        return ({first[1].encode("utf-8")[0]}, False) if first and first[0] == "lit" and first[1] else None
    if kind == "union":
        parts = [_first_bytes(s) for s in spec[1]]
        if any(p is None for p in parts):
            return None
        return set().union(*(p[0] for p in parts)), any(p[1] for p in parts)
    return None
