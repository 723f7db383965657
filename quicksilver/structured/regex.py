"""``pattern`` (and common ``format``s) for string slots: a regex compiled to a byte automaton over the
JSON-escaped string content.

The pattern is parsed with Python's own regex parser (the syntax JSON Schema validators run it with),
turned into an NFA (Thompson construction) over ASCII characters, and run lazily as a DFA (sets of NFA
states) inside the JSON string automaton: raw printable ASCII bytes and the short escapes (``\\n``,
``\\"``, ...) are characters. JSON Schema patterns are unanchored (``re.search``), so a pattern without
``^``/``$`` gets ``.*`` on that side. Generated strings are ASCII only (a subset of what matches).
Unsupported regex features (backreferences, lookaround, flags, anchors in the middle) raise ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

try:  # Python 3.11+
    import re._parser as sre_parse  # type: ignore[import-not-found]
    from re import _constants as sre_c  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

from quicksilver.structured.automata import ByteAutomaton

ALPHABET = frozenset(range(128))
_ESCAPES = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 0x08, ord("f"): 0x0C, ord("n"): 0x0A,
            ord("r"): 0x0D, ord("t"): 0x09}
_MAX_NFA = 3000

_DIGIT = frozenset(range(ord("0"), ord("9") + 1))
_WORD = _DIGIT | frozenset(range(ord("a"), ord("z") + 1)) | frozenset(range(ord("A"), ord("Z") + 1)) | {ord("_")}
_SPACE = frozenset(b" \t\n\r\f\v")
_CATEGORIES = {
    sre_c.CATEGORY_DIGIT: _DIGIT, sre_c.CATEGORY_NOT_DIGIT: ALPHABET - _DIGIT,
    sre_c.CATEGORY_WORD: _WORD, sre_c.CATEGORY_NOT_WORD: ALPHABET - _WORD,
    sre_c.CATEGORY_SPACE: _SPACE, sre_c.CATEGORY_NOT_SPACE: ALPHABET - _SPACE,
}

# formats we can enforce, as patterns (dates never name a day a month lacks; Feb stops at 28)
_DATE = (r"\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
         r"|02-(?:0[1-9]|1\d|2[0-8]))")
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    "email": r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}$",
    "ipv4": rf"^(?:{_OCTET}\.){{3}}{_OCTET}$",
}


class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[frozenset[int], int]]] = []

    def state(self) -> int:
        if len(self.eps) >= _MAX_NFA:
            raise ValueError("pattern is too large to enforce")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, items: list, start: int) -> int:
        """Add the sequence ``items`` from ``start``; returns its end state."""
        cur = start
        for op, arg in items:
            cur = self.node(op, arg, cur)
        return cur

    def node(self, op, arg, start: int) -> int:
        if op == sre_c.LITERAL:
            return self._chars(frozenset({arg}) & ALPHABET, start)
        if op == sre_c.NOT_LITERAL:
            return self._chars(ALPHABET - {arg}, start)
        if op == sre_c.ANY:
            return self._chars(ALPHABET - {ord("\n")}, start)
        if op == sre_c.IN:
            return self._chars(_char_class(arg), start)
        if op == sre_c.SUBPATTERN:
            _group, add_flags, del_flags, sub = arg
            if add_flags or del_flags:
                raise ValueError("inline regex flags are not supported")
            return self.build(list(sub), start)
        if op == sre_c.BRANCH:
            end = self.state()
            for alt in arg[1]:
                s = self.state()
                self.eps[start].append(s)
                self.eps[self.build(list(alt), s)].append(end)
            return end
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT) or op == getattr(sre_c, "POSSESSIVE_REPEAT", None):
            lo, hi, sub = arg
            cur = start
            for _ in range(lo):
                cur = self.build(list(sub), cur)
            if hi == sre_c.MAXREPEAT:
                loop = self.state()
                self.eps[cur].append(loop)
                body_end = self.build(list(sub), loop)
                self.eps[body_end].append(loop)
                return loop
            end = self.state()
            self.eps[cur].append(end)
            for _ in range(hi - lo):
                cur = self.build(list(sub), cur)
                self.eps[cur].append(end)
            return end
        if op == sre_c.AT:
            raise ValueError("anchors (^, $, \\b) inside a pattern are not supported")
        raise ValueError(f"regex feature {op} is not supported")

    def _chars(self, chars: frozenset[int], start: int) -> int:
        end = self.state()
        if chars:
            self.edges[start].append((chars, end))
        return end


def _char_class(items) -> frozenset[int]:
    out: set[int] = set()
    negate = False
    for op, arg in items:
        if op == sre_c.NEGATE:
            negate = True
        elif op == sre_c.LITERAL:
            out.add(arg)
        elif op == sre_c.RANGE:
            out.update(range(arg[0], arg[1] + 1))
        elif op == sre_c.CATEGORY:
            if arg not in _CATEGORIES:
                raise ValueError(f"regex class {arg} is not supported")
            out |= _CATEGORIES[arg]
        else:
            raise ValueError(f"regex class item {op} is not supported")
    chars = frozenset(out) & ALPHABET
    return ALPHABET - chars if negate else chars


def compile_pattern(pattern: str) -> tuple[_NFA, int, int]:
    """(nfa, start, accept) for a JSON Schema pattern (search semantics)."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise ValueError(f"invalid pattern {pattern!r}: {exc}") from None
    flags = parsed.state.flags & ~(re.UNICODE | getattr(sre_c, "SRE_FLAG_UNICODE", 0))
    if flags:
        raise ValueError("regex flags are not supported in patterns")
    items = list(parsed)
    anchored_start = bool(items) and items[0] == (sre_c.AT, sre_c.AT_BEGINNING)
    anchored_end = bool(items) and items[-1][0] == sre_c.AT and items[-1][1] in (sre_c.AT_END, sre_c.AT_END_STRING)
    if anchored_start:
        items = items[1:]
    if anchored_end:
        items = items[:-1]
    nfa = _NFA()
    start = nfa.state()
    cur = start
    if not anchored_start:  # re.search: anything may come before the match
        nfa.edges[start].append((ALPHABET, start))
    cur = nfa.build(items, cur)
    if not anchored_end:
        nfa.edges[cur].append((ALPHABET, cur))
    return nfa, start, cur


def _closure(nfa: _NFA, states) -> frozenset[int]:
    seen = set(states)
    stack = list(states)
    while stack:
        s = stack.pop()
        for t in nfa.eps[s]:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return frozenset(seen)


def pattern_content(pattern: str, min_len: int = 0, max_len: int | None = None, quoted: bool = False
                    ) -> ByteAutomaton:
    """JSON string content (or a whole quoted string) whose decoded text matches ``pattern``."""
    nfa, start, accept = compile_pattern(pattern)
    moves: dict[tuple[frozenset[int], int], frozenset[int] | None] = {}

    def move(states: frozenset[int], ch: int) -> frozenset[int] | None:
        key = (states, ch)
        if key not in moves:
            nxt = {t for s in states for chars, t in nfa.edges[s] if ch in chars}
            moves[key] = _closure(nfa, nxt) if nxt else None
        return moves[key]

    first = _closure(nfa, [start])

    def step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
        if s == "Q":
            return (("N", first), 0) if b == 0x22 else None
        if s == "END":
            return None
        mode, states = s
        if mode == "N":
            if b == 0x22:
                return ("END", 0) if quoted and accept in states else None
            if b == 0x5C:
                return ("E", states), 0
            if not 0x20 <= b < 0x7F:
                return None
            ch = b
        else:
            ch = _ESCAPES.get(b)
            if ch is None:
                return None
        nxt = move(states, ch)
        return None if nxt is None else (("N", nxt), 1)

    def done(s: Hashable) -> bool:
        if quoted:
            return s == "END"
        return s != "Q" and s != "END" and s[0] == "N" and accept in s[1]

    counted = min_len > 0 or max_len is not None
    return ByteAutomaton("Q" if quoted else ("N", first), step, done, min_len, max_len, counted)
