"""Byte automata for the JSON values a slot can hold.

Specs are hashable tuples so compiled automata can be cached per vocabulary:

* ``("string", min_len, max_len, pattern)``: the characters between two pinned quotes (escapes, no raw
  control characters, valid UTF-8, no lone surrogate escapes); length counted in characters as ``len()``
  does; with a pattern, ASCII text matching it (see ``regex.py``).
* ``("qstring", ...)``: the same as a whole quoted string (used inside unions and arrays).
* ``("number", integer, lo, hi, lo_exclusive, hi_exclusive)``: JSON number syntax, bounds as decimal
  strings or None; bounded numbers are written without exponent.
* ``("literals", (text, ...))``: exactly one of some JSON texts (enum values, true/false).
* ``("union", (spec, ...))``: any one of several value automata.
* ``("array", item_spec, min_items, max_items)``: the inside of ``[...]``: items separated by ``, ``.
* ``("seq", (part, ...))``: fixed text ``("lit", text)`` and values one after another (an object whose
  keys the model must write itself: used for variable-length arrays of objects and anyOf of objects).
* ``("affix", prefix, spec, suffix)``: a value with the skeleton text the tokenizer merges with it (the space
  before a number, a closing quote merged with ``}``), so the slot holds whole natural tokens; the value's
  counter (string length, item count) is kept.
"""

from __future__ import annotations

from collections.abc import Hashable
from decimal import Decimal

from quicksilver.structured.automata import ByteAutomaton

_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrt')


# -- strings ------------------------------------------------------------------------------------------
def _utf8_lead(b: int) -> tuple[int, int, int] | None:
    """(continuation bytes, allowed range of the first one) for a UTF-8 lead byte, None if invalid."""
    if 0xC2 <= b <= 0xDF:
        return 1, 0x80, 0xBF
    if b == 0xE0:
        return 2, 0xA0, 0xBF
    if 0xE1 <= b <= 0xEC or 0xEE <= b <= 0xEF:
        return 2, 0x80, 0xBF
    if b == 0xED:
        return 2, 0x80, 0x9F  # no UTF-16 surrogates
    if b == 0xF0:
        return 3, 0x90, 0xBF
    if 0xF1 <= b <= 0xF3:
        return 3, 0x80, 0xBF
    if b == 0xF4:
        return 3, 0x80, 0x8F
    return None


def _string_step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
    if s == "N":
        if b == 0x22 or b < 0x20:
            return None
        if b == 0x5C:
            return "E", 0
        if b < 0x80:
            return "N", 1
        lead = _utf8_lead(b)
        return None if lead is None else (("C",) + lead, 0)
    if s == "E":
        if b in _ESCAPES:
            return "N", 1
        if b == ord("u"):
            return ("U", 0), 0
        return None
    kind = s[0]
    if kind == "U":
        k = s[1]
        if b not in _HEX:
            return None
        if k == 0 and b in b"dD":
            return ("UD",), 0  # \uD800-\uDFFF would be half a surrogate pair
        return ("N", 1) if k == 3 else (("U", k + 1), 0)
    if kind == "UD":
        return (("U", 2), 0) if b in b"01234567" else None
    if kind == "C":
        left, lo, hi = s[1], s[2], s[3]
        if not lo <= b <= hi:
            return None
        return ("N", 1) if left == 1 else (("C", left - 1, 0x80, 0xBF), 0)
    return None


def string_content(min_len: int = 0, max_len: int | None = None) -> ByteAutomaton:
    counted = min_len > 0 or max_len is not None
    return ByteAutomaton("N", _string_step, lambda s: s == "N", min_len, max_len, counted)


def _qstring_step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
    if s == "Q":
        return (("S", "N"), 0) if b == 0x22 else None
    if s == "END":
        return None
    inner = s[1]
    if inner == "N" and b == 0x22:
        return "END", 0
    r = _string_step(inner, b)
    return None if r is None else (("S", r[0]), r[1])


def quoted_string(min_len: int = 0, max_len: int | None = None) -> ByteAutomaton:
    counted = min_len > 0 or max_len is not None
    return ByteAutomaton("Q", _qstring_step, lambda s: s == "END", min_len, max_len, counted)


# -- numbers ------------------------------------------------------------------------------------------
class _Bound:
    """A non-negative decimal bound split into integer digits and (trailing-zero-free) fraction digits."""

    def __init__(self, value: Decimal, exclusive: bool):
        text = f"{value:f}"
        whole, _, frac = text.partition(".")
        self.int_digits = whole.lstrip("0") or "0"
        self.frac_digits = frac.rstrip("0")
        self.exclusive = exclusive


def _cmp(a: int, b: int) -> int:
    return (a > b) - (a < b)


class _Magnitude:
    """Unsigned JSON number (``0|[1-9][0-9]*`` then optional ``.digits``) inside [low, high]."""

    def __init__(self, low: _Bound | None, high: _Bound | None, integer: bool, exponent: bool):
        self.low, self.high, self.integer, self.exponent = low, high, integer, exponent
        lens = [len(b.int_digits) for b in (low, high) if b is not None]
        self.cap = max(lens, default=0) + 1

    # int phase state: ("I", k, zero, cmp_low, cmp_high); cmp is the digit-wise comparison with the
    # bound's first k integer digits (meaningful only while k <= its length)
    start: Hashable = ("I", 0, False, 0, 0)

    def _int_result(self, k: int, cmp: int, bound: _Bound) -> int:
        n = len(bound.int_digits)
        return -1 if k < n else 1 if k > n else cmp

    def step(self, s: Hashable, b: int) -> Hashable | None:
        tag = s[0]
        if tag == "I":
            _, k, zero, cl, ch = s
            if b in _DIGITS:
                if zero:
                    return None  # no leading zeros
                d = b - 0x30
                k2 = min(k + 1, self.cap)
                if self.high is not None and k2 > len(self.high.int_digits):
                    return None  # longer than the upper bound's integer part
                cl2 = self._digit_cmp(cl, k, d, self.low)
                ch2 = self._digit_cmp(ch, k, d, self.high)
                return ("I", k2, k == 0 and d == 0, cl2, ch2)
            if b == ord(".") and k > 0 and not self.integer:
                rl = self._int_result(k, cl, self.low) if self.low else 1
                rh = self._int_result(k, ch, self.high) if self.high else -1
                return ("F", 0, rl, rh)
            if b in b"eE" and k > 0 and self.exponent:
                return ("X", 0)
            return None
        if tag == "F":
            j, rl, rh = s[1], s[2], s[3]
            if b in _DIGITS:
                d = b - 0x30
                rl2 = rl if rl != 0 else _cmp(d, self._frac_digit(self.low, j))
                rh2 = rh if rh != 0 else _cmp(d, self._frac_digit(self.high, j))
                if rh2 > 0:
                    return None  # already above the upper bound
                jmax = max(len(self.low.frac_digits) if self.low else 0,
                           len(self.high.frac_digits) if self.high else 0)
                return ("F", min(j + 1, jmax), rl2, rh2, True)
            if b in b"eE" and len(s) == 5 and self.exponent:
                return ("X", 0)
            return None
        if tag == "X":  # exponent: ("X", 0) after e, ("X", 1) after sign, ("X", 2) digits
            phase = s[1]
            if phase == 0 and b in b"+-":
                return ("X", 1)
            if b in _DIGITS:
                return ("X", 2)
            return None
        return None

    @staticmethod
    def _digit_cmp(cmp: int, k: int, d: int, bound: _Bound | None) -> int:
        if bound is None or k >= len(bound.int_digits):
            return 1  # no bound, or already longer: only the length matters now
        if cmp != 0:
            return cmp
        return _cmp(d, int(bound.int_digits[k]))

    @staticmethod
    def _frac_digit(bound: _Bound | None, j: int) -> int:
        if bound is None or j >= len(bound.frac_digits):
            return 0
        return int(bound.frac_digits[j])

    def accept(self, s: Hashable) -> bool:
        tag = s[0]
        if tag == "X":
            return s[1] == 2
        if tag == "I":
            _, k, _, cl, ch = s
            if k == 0:
                return False
            rl = self._int_result(k, cl, self.low) if self.low else 1
            rh = self._int_result(k, ch, self.high) if self.high else -1
            # equal integer parts: a bound with a fraction is larger than our fraction-less number
            if rl == 0 and self.low.frac_digits:
                rl = -1
            if rh == 0 and self.high.frac_digits:
                rh = -1
        elif tag == "F":
            if len(s) != 5:
                return False  # "." needs at least one digit
            _, j, rl, rh, _ = s
            if rl == 0 and self.low and j < len(self.low.frac_digits):
                rl = -1
            if rh == 0 and self.high and j < len(self.high.frac_digits):
                rh = -1
        else:
            return False
        ok_low = self.low is None or rl > 0 or (rl == 0 and not self.low.exclusive)
        ok_high = self.high is None or rh < 0 or (rh == 0 and not self.high.exclusive)
        return ok_low and ok_high


def _dec(x: str | None) -> Decimal | None:
    return None if x is None else Decimal(x)


def number(integer: bool, lo: str | None, hi: str | None, lo_excl: bool, hi_excl: bool) -> ByteAutomaton | None:
    """JSON numbers v with lo <= v <= hi (exclusive flags as JSON Schema); None if the range is empty."""
    low, high = _dec(lo), _dec(hi)
    if integer:  # integer bounds become inclusive integers
        if low is not None:
            low = low.to_integral_value(rounding="ROUND_CEILING") + (1 if lo_excl and low == low.to_integral_value()
                                                                     else 0)
            lo_excl = False
        if high is not None:
            high = high.to_integral_value(rounding="ROUND_FLOOR") - (1 if hi_excl and high == high.to_integral_value()
                                                                     else 0)
            hi_excl = False
    if low is not None and high is not None and (low > high or (low == high and (lo_excl or hi_excl))):
        return None
    exponent = low is None and high is None and not integer
    # non-negative branch: magnitude in [max(low, 0), high]
    pos = None
    if high is None or high > 0 or (high == 0 and not hi_excl):
        pos_low = _Bound(low, lo_excl) if low is not None and low >= 0 else None
        pos_high = _Bound(high, hi_excl) if high is not None else None
        pos = _Magnitude(pos_low, pos_high, integer, exponent)
    # negative branch: magnitude m = -v in [max(-high, 0), -low]
    neg = None
    if low is None or low < 0:
        if high is None or high >= 0:
            neg_low = _Bound(Decimal(0), bool(high == 0 and hi_excl)) if high is not None and high == 0 else None
        else:
            neg_low = _Bound(-high, hi_excl)
        neg_high = _Bound(-low, lo_excl) if low is not None else None
        neg = _Magnitude(neg_low, neg_high, integer, exponent)
    if pos is None and neg is None:
        return None

    def step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
        if s == "S":
            if b == ord("-") and neg is not None:
                return ("M", neg.start), 0
            if pos is None:
                return None
            t = pos.step(pos.start, b)
            return None if t is None else (("P", t), 0)
        branch = pos if s[0] == "P" else neg
        t = branch.step(s[1], b)
        return None if t is None else ((s[0], t), 0)

    def accept(s: Hashable) -> bool:
        if s == "S":
            return False
        return (pos if s[0] == "P" else neg).accept(s[1])

    return ByteAutomaton("S", step, accept)


# -- literals, unions, arrays ---------------------------------------------------------------------------
def literals(texts: tuple[str, ...]) -> ByteAutomaton:
    alts = tuple(t.encode("utf-8") for t in texts)
    prefixes = {a[:i] for a in alts for i in range(len(a) + 1)}

    def step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
        t = s + bytes([b])
        return (t, 0) if t in prefixes else None

    return ByteAutomaton(b"", step, lambda s: s in alts)


def first_bytes(auto: ByteAutomaton) -> set[int]:
    return {b for b in range(256) if auto.step(auto.start, b) is not None}


class UnionError(ValueError):
    pass


def union(autos: tuple[ByteAutomaton, ...]) -> ByteAutomaton:
    """Any one of several automata (run side by side).

    At most one may be counted (a string with length bounds), and it must not share a first byte with
    the others, so its count never leaks into their paths; values of the others ignore the count bounds.
    """
    counted = [i for i, a in enumerate(autos) if a.counted]
    if len(counted) > 1:
        raise UnionError("only one alternative of a union may have length bounds")
    if counted:
        c = counted[0]
        firsts = first_bytes(autos[c])
        if any(firsts & first_bytes(a) for i, a in enumerate(autos) if i != c):
            raise UnionError("a length-bounded string cannot share a union with other string values")
    ci = counted[0] if counted else None

    def step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
        out = []
        inc = 0
        for i, (a, sub) in enumerate(zip(autos, s, strict=True)):
            r = a.step(sub, b) if sub is not None else None
            out.append(None if r is None else r[0])
            if r is not None and i == ci:
                inc = r[1]
        return None if all(x is None for x in out) else (tuple(out), inc)

    def accept(s: Hashable) -> bool:
        return any(sub is not None and a.accept(sub) for a, sub in zip(autos, s, strict=True))

    def exempt(s: Hashable) -> bool:
        return any(sub is not None and a.accept(sub) for i, (a, sub) in enumerate(zip(autos, s, strict=True))
                   if i != ci)

    if ci is None:
        return ByteAutomaton(tuple(a.start for a in autos), step, accept)
    a = autos[ci]
    return ByteAutomaton(tuple(x.start for x in autos), step, accept, a.count_min, a.count_max, True, exempt)


def sequence(parts: tuple[ByteAutomaton | bytes, ...]) -> ByteAutomaton:
    """Parts one after another (fixed text and uncounted value automata): a whole object as one value.

    A part is left as soon as the next byte cannot continue it (JSON values never continue into the
    ``,``/``}``/``"`` that follows them), so the parse is deterministic and only valid texts are accepted.
    """
    n = len(parts)

    def enter(i: int) -> Hashable:
        return 0 if isinstance(parts[i], bytes) else parts[i].start

    def done(i: int, sub: Hashable) -> bool:
        part = parts[i]
        return sub == len(part) if isinstance(part, bytes) else part.accept(sub)

    def inside(i: int, sub: Hashable, b: int) -> Hashable | None:
        part = parts[i]
        if isinstance(part, bytes):
            return sub + 1 if sub < len(part) and part[sub] == b else None
        r = part.step(sub, b)
        return None if r is None else r[0]

    def step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
        i, sub = s
        r = inside(i, sub, b)
        if r is not None:
            return (i, r), 0
        while done(i, sub) and i + 1 < n:
            i, sub = i + 1, enter(i + 1)
            r = inside(i, sub, b)
            if r is not None:
                return (i, r), 0
        return None

    def accept(s: Hashable) -> bool:
        i, sub = s
        if not done(i, sub):
            return False
        return all(done(j, enter(j)) for j in range(i + 1, n))

    return ByteAutomaton((0, enter(0)), step, accept)


def array_items(item: ByteAutomaton, min_items: int, max_items: int | None) -> ByteAutomaton:
    """Items separated by ``, `` (or ``,``); the counter counts items."""

    def step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
        if s == "A0" or s == "S1" or s == "S2":
            if s == "S1" and b == 0x20:
                return "S2", 0
            r = item.step(item.start, b)
            return None if r is None else (("I", r[0]), 1)
        sub = s[1]
        r = item.step(sub, b)
        if r is not None:
            return ("I", r[0]), 0
        if b == ord(",") and item.accept(sub):
            return "S1", 0
        return None

    def accept(s: Hashable) -> bool:
        return s == "A0" or (s[0] == "I" and item.accept(s[1]))

    return ByteAutomaton("A0", step, accept, min_items, max_items, True)


def affix(prefix: bytes, value: ByteAutomaton, suffix: bytes) -> ByteAutomaton:
    """``prefix`` + a value + ``suffix``, the value's counter and exemptions kept.

    The value is left as soon as the next byte cannot continue it (JSON values never continue into the
    punctuation that follows them), so the automaton stays deterministic.
    """

    def step(s: Hashable, b: int) -> tuple[Hashable, int] | None:
        tag = s[0]
        if tag == "P":
            k = s[1]
            if prefix[k] != b:
                return None
            return (("P", k + 1), 0) if k + 1 < len(prefix) else (("V", value.start), 0)
        if tag == "V":
            r = value.step(s[1], b)
            if r is not None:
                return ("V", r[0]), r[1]
            if suffix and suffix[0] == b and value.accept(s[1]):
                exempt = bool(value.exempt(s[1])) if value.exempt else False
                return ("S", 1, exempt), 0
            return None
        k = s[1]
        return (("S", k + 1, s[2]), 0) if k < len(suffix) and suffix[k] == b else None

    def accept(s: Hashable) -> bool:
        if s[0] == "V":
            return not suffix and value.accept(s[1])
        return s[0] == "S" and s[1] == len(suffix)

    def exempt(s: Hashable) -> bool:
        if s[0] == "V":
            return not suffix and value.exempt is not None and bool(value.exempt(s[1]))
        return s[0] == "S" and s[1] == len(suffix) and s[2]

    start = ("P", 0) if prefix else ("V", value.start)
    return ByteAutomaton(start, step, accept, value.count_min, value.count_max, value.counted,
                         exempt if value.exempt else None)


def build(spec: tuple) -> ByteAutomaton | None:
    kind = spec[0]
    if kind == "affix":
        inner = build(spec[2])
        return None if inner is None else affix(spec[1].encode("utf-8"), inner, spec[3].encode("utf-8"))
    if kind in ("string", "qstring"):
        lo, hi, pattern = (spec[1:] + (0, None, None)[len(spec) - 1:])[:3]
        if pattern is not None:
            from quicksilver.structured.regex import pattern_content

            return pattern_content(pattern, lo, hi, quoted=kind == "qstring")
        return string_content(lo, hi) if kind == "string" else quoted_string(lo, hi)
    if kind == "number":
        return number(*spec[1:])
    if kind == "literals":
        return literals(spec[1])
    if kind == "union":
        parts = tuple(build(s) for s in spec[1])
        return union(tuple(p for p in parts if p is not None))
    if kind == "seq":
        parts = []
        for part in spec[1]:
            if part[0] == "lit":
                parts.append(part[1].encode("utf-8"))
                continue
            auto = build(part)
            if auto is None:
                return None
            parts.append(auto)
        return sequence(tuple(parts))
    if kind == "array":
        item = build(spec[1])
        if item is None:  # no item value exists: only the empty array, if allowed
            return None if spec[2] > 0 else array_items(literals(()), 0, 0)
        return array_items(item, spec[2], spec[3])
    raise ValueError(f"unknown value spec {spec!r}")
