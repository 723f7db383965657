"""Cut the skeleton where the tokenizer itself cuts: pinned text and value slots meet at natural token boundaries.

A byte-level BPE writes ``"age": 52`` as ``'":', ' 52'`` (the space belongs to the number) and
``"red"}`` with ``'"}'`` as one token. Pinning ``'": '`` and letting the model write ``52`` after a lone
``' '`` token shows it a segmentation it never saw in training. So the skeleton text next to a value is cut
at token boundaries of the canonical text (the skeleton filled with typical values, tokenized whole): the
part of the text that the tokenizer merges with the value moves into the slot as a fixed prefix/suffix of
its automaton (``("affix", prefix, spec, suffix)``), and the pinned tokens are exactly the tokens the
tokenizer writes for the rest. The text itself is unchanged (``json.dumps`` separators), so validity is too;
only where a slot begins and ends moves.

A boundary counts only if the tokenizer puts it there for every probe value (several typical values per
slot), so one odd value does not decide the layout. Values unlike the probes stay valid; they may just be
written with a less usual token at the edge of the slot.
"""

from __future__ import annotations

from quicksilver.structured.schema import Piece, Slot
from quicksilver.tokenizer import Tokenizer

MAX_PROBES = 6


class Pinned(tuple):
    """Token ids of a pinned piece, taken from the canonical tokenization (not re-encoded on their own)."""


def _probes(spec: tuple) -> list[str]:
    """Typical texts of a value (only their edges matter: which characters touch the skeleton)."""
    kind = spec[0]
    if kind == "string":
        return ["Paris", "Kara Khan", "blue"]
    if kind == "qstring":
        return [f'"{p}"' for p in _probes(("string",))]
    if kind == "number":
        probes = ["52", "1901", "7"] if spec[1] else ["52", "3.25", "7"]
        # a number that may be negative: " -7" is not cut where " 52" is once digits are split from the space
        # before them (" " + "52" against " -" + "7"), so the space then stays in the slot
        return probes + ["-7"] if spec[2] is None or float(spec[2]) < 0 else probes
    if kind == "literals":
        return list(spec[1][:MAX_PROBES]) or [""]
    if kind == "union":
        return [_probes(s)[0] for s in spec[1][:MAX_PROBES]]
    if kind == "array":
        items = _probes(spec[1])
        return [", ".join([items[0], items[-1]]), items[0]]
    if kind == "seq":
        return ["".join(p[1] if p[0] == "lit" else _probes(p)[0] for p in spec[1])]
    return [""]


def _offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    return list(enc.ids), [tuple(o) for o in enc.offsets]


def natural_pieces(pieces: list[Piece], tokenizer: Tokenizer) -> list[Piece | Pinned]:
    """``pieces`` (text and slots, merged) re-cut at the tokenizer's boundaries; text comes back as :class:`Pinned`.

    The start and the end of ``pieces`` are taken as boundaries (the answer's start and end, or the cut of
    a tool-call head and its arguments tail, which is itself a boundary).
    """
    texts: list[str] = [""]
    slots: list[Slot] = []
    for p in pieces:
        if isinstance(p, Slot):
            slots.append(p)
            texts.append("")
        else:
            texts[-1] += p
    if not slots:
        return [Pinned(tokenizer.encode(texts[0]))] if texts[0] else []
    probes = [_probes(s.spec) for s in slots]
    rounds = max(len(p) for p in probes)
    common: list[set[int] | None] = [None] * len(texts)
    canonical: list[tuple[list[int], list[tuple[int, int]], list[int]]] = []
    for j in range(rounds):
        starts, text = [], ""
        for i, t in enumerate(texts):
            starts.append(len(text))
            text += t
            if i < len(slots):
                text += probes[i][j % len(probes[i])]
        ids, offsets = _offsets(tokenizer, text)
        cuts = {a for a, _ in offsets} | {len(text)}
        canonical.append((ids, offsets, starts))
        for i, t in enumerate(texts):
            here = {c - starts[i] for c in cuts if starts[i] <= c <= starts[i] + len(t)}
            common[i] = here if common[i] is None else common[i] & here
    bounds = [sorted(c or ()) for c in common]
    bounds[0] = sorted(set(bounds[0]) | {0})
    bounds[-1] = sorted(set(bounds[-1]) | {len(texts[-1])})
    # per text: [keep_from, keep_to): the part pinned; what is left of it joins the neighbouring slots
    keep = []
    for i, t in enumerate(texts):
        lo = bounds[i][0] if i > 0 and bounds[i] else 0
        hi = bounds[i][-1] if i < len(slots) and bounds[i] else len(t)
        if lo > hi:  # no common boundary: leave the text whole (the old, value-exact cut)
            lo, hi = 0, len(t)
        keep.append((lo, hi))
    ids, offsets, starts = canonical[0]
    out: list[Piece | Pinned] = []
    for i, t in enumerate(texts):
        lo, hi = keep[i]
        if hi > lo:
            a, b = starts[i] + lo, starts[i] + hi
            toks = [tid for tid, (s, _) in zip(ids, offsets, strict=True) if a <= s < b]
            out.append(Pinned(toks) if _spans(offsets, ids, toks, a, b) else Pinned(tokenizer.encode(t[lo:hi])))
        if i < len(slots):
            slot = slots[i]
            prefix, suffix = t[hi:], texts[i + 1][: keep[i + 1][0]]
            if not prefix and not suffix:
                out.append(slot)
                continue
            extra = len(tokenizer.encode(prefix)) if prefix else 0
            extra += len(tokenizer.encode(suffix)) if suffix else 0
            out.append(Slot(("affix", prefix, slot.spec, suffix), slot.budget + extra, slot.flexible))
    return out


def _spans(offsets: list[tuple[int, int]], ids: list[int], toks: list[int], a: int, b: int) -> bool:
    """The selected canonical tokens cover exactly [a, b) (else re-encode that text on its own)."""
    inside = [(s, e) for s, e in offsets if a <= s < b]
    return bool(inside) and inside[0][0] == a and max(e for _, e in inside) == b and len(inside) == len(toks)
