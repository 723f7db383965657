"""``response_format: json_object``: any JSON object, enforced by a left-to-right gate.

With no schema there is no skeleton to pin beyond the opening brace, so this constraint grows the answer
from the left: at the first open position only tokens that keep the text a viable JSON prefix *and* leave
enough canvas to close every open string/array/object are allowed; proposals at later positions are
committed while they extend that prefix validly (so a confident model still commits several tokens per
forward). The byte machine is JSON with nesting depth <= ``MAX_DEPTH`` and ``json.dumps`` spacing (one
optional space after ``:`` and ``,``, no other whitespace, so a model cannot stall in blank lines); its
states are built lazily.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Hashable

import numpy as np
import torch

from quicksilver.decoding.constraints import Constraint
from quicksilver.decoding.request_view import RequestView
from quicksilver.structured.constraint import StructuredOutputError
from quicksilver.structured.lexicon import lexicon_for
from quicksilver.structured.values import _string_step
from quicksilver.tokenizer import Tokenizer

MAX_DEPTH = 8
_DIGITS = frozenset(b"0123456789")
_LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}

# state: (stack, mode, sub). stack: tuple of "o"/"a" (open containers). modes:
#   "key?" after "{" (key or "}"), "key" after "," in an object, ("ks", s) in a key string, ":" after a key,
#   "val?" after "[" (value or "]"), "val" expecting a value, ("vs", s) in a value string,
#   ("num", phase) in a number, ("lit", text, i) in true/false/null, "after" after a value, "done".


def _after_value(stack: tuple) -> Hashable:
    return (stack, "after", None) if stack else ((), "done", None)


def _start_value(stack: tuple, b: int) -> Hashable | None:
    if b == 0x22:
        return (stack, "vs", "N")
    if b == ord("{") and len(stack) < MAX_DEPTH:
        return (stack + ("o",), "key?", None)
    if b == ord("[") and len(stack) < MAX_DEPTH:
        return (stack + ("a",), "val?", None)
    if b == ord("-"):
        return (stack, "num", "-")
    if b == ord("0"):
        return (stack, "num", "0")
    if b in _DIGITS:
        return (stack, "num", "int")
    if b in _LITERALS:
        return (stack, "lit", (_LITERALS[b], 1))
    return None


def _close(stack: tuple, b: int) -> Hashable | None:
    if stack and ((b == ord("}") and stack[-1] == "o") or (b == ord("]") and stack[-1] == "a")):
        return _after_value(stack[:-1])
    return None


# number phases: "-" sign, "0" leading zero, "int" digits, "." point, "frac" digits, "e" exp mark,
# "es" exp sign, "exp" exp digits; complete in "0", "int", "frac", "exp"
_NUM_DONE = {"0", "int", "frac", "exp"}


def _num_step(phase: str, b: int) -> str | None:
    d = b in _DIGITS
    if phase == "-":
        return "0" if b == ord("0") else "int" if d else None
    if phase == "0":
        return "." if b == ord(".") else "e" if b in b"eE" else None
    if phase == "int":
        return "int" if d else "." if b == ord(".") else "e" if b in b"eE" else None
    if phase in (".", "frac"):
        return "frac" if d else ("e" if phase == "frac" and b in b"eE" else None)
    if phase == "e":
        return "es" if b in b"+-" else "exp" if d else None
    if phase in ("es", "exp"):
        return "exp" if d else None
    return None


def step(state: Hashable, b: int) -> Hashable | None:
    stack, mode, sub = state
    if mode == "done":
        return None
    if mode in ("ks", "vs"):
        if sub == "N" and b == 0x22:
            return (stack, ":", None) if mode == "ks" else _after_value(stack)
        r = _string_step(sub, b)
        return None if r is None else (stack, mode, r[0])
    if mode == "num":
        nxt = _num_step(sub, b)
        if nxt is not None:
            return (stack, "num", nxt)
        if sub not in _NUM_DONE:
            return None
        return step(_after_value(stack), b)  # the number ended; this byte continues after it
    if mode == "lit":
        text, i = sub
        if b != text[i]:
            return None
        return _after_value(stack) if i + 1 == len(text) else (stack, "lit", (text, i + 1))
    if b == 0x20 and mode in ("key", "val") and sub == "fresh":
        return (stack, mode, "spaced")  # one space after ":" or "," (json.dumps style), nothing more
    if mode in ("key?", "key"):
        if b == 0x22:
            return (stack, "ks", "N")
        return _close(stack, b) if mode == "key?" else None
    if mode == ":":
        return (stack, "val", "fresh") if b == ord(":") else None
    if mode in ("val?", "val"):
        r = _start_value(stack, b)
        if r is None and mode == "val?":
            return _close(stack, b)
        return r
    if mode == "after":
        if b == ord(","):
            return (stack, "key", "fresh") if stack[-1] == "o" else (stack, "val", "fresh")
        return _close(stack, b)
    return None


def min_close(state: Hashable) -> int:
    """Fewest bytes that complete the top-level value from ``state``."""
    stack, mode, sub = state
    if mode == "done":
        return 0
    n = 0
    if mode in ("ks", "vs"):
        n += {"N": 1, "E": 2}.get(sub, 0) if isinstance(sub, str) else (
            (4 - sub[1]) + 1 if sub[0] == "U" else 4 if sub[0] == "UD" else sub[1] + 1)
        if mode == "ks":
            n += 2  # :0
    elif mode == "num":
        n += 0 if sub in _NUM_DONE else 1
    elif mode == "lit":
        text, i = sub
        n += len(text) - i
    elif mode in ("key", ":"):
        n += {"key": 4, ":": 2}[mode]  # "":0  /  :0
    elif mode == "val":
        n += 1
    return n + len(stack)  # one closing bracket per open container


class JsonObjectConstraint(Constraint):
    def __init__(self, tokenizer: Tokenizer, max_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.lex = lexicon_for(tokenizer)
        self.open_id = tokenizer.encode("{")
        if len(self.open_id) != 1:
            raise ValueError("the tokenizer cannot write '{' as one token")
        if max_tokens is not None and max_tokens < 2:
            raise ValueError("max_tokens must be at least 2 for a JSON object")
        lex = self.lex
        self.cand = np.nonzero((lex.lengths > 0) & ~lex.special)[0]
        self._bytes = lex.byte_matrix[self.cand]
        self._lens = lex.lengths[self.cand]
        self._index: dict[Hashable, int] = {}
        self._states: list[Hashable] = []
        self._table = np.zeros((0, 256), dtype=np.int32)
        self._close = np.zeros(0, dtype=np.int32)
        self._runs: weakref.WeakKeyDictionary[RequestView, list] = weakref.WeakKeyDictionary()

    # -- lazy byte table -----------------------------------------------------------------------------
    def _id(self, s: Hashable) -> int:
        i = self._index.get(s)
        if i is None:
            i = self._index[s] = len(self._states)
            self._states.append(s)
            self._table = np.vstack([self._table, np.full((1, 256), -2, dtype=np.int32)])  # -2: not built
            self._close = np.append(self._close, min_close(s))
        return i

    def _row(self, i: int) -> np.ndarray:
        if self._table[i, 0] == -2:
            s = self._states[i]
            row = [-1] * 256
            for b in range(256):
                t = step(s, b)
                if t is not None:
                    row[b] = self._id(t)
            self._table[i] = row
        return self._table[i]

    def _advance_all(self, i: int) -> np.ndarray:
        """State after each candidate token from state ``i`` (-1 dead)."""
        cur = np.full(self.cand.size, i, dtype=np.int32)
        for col in range(int(self._lens.max())):
            active = (col < self._lens) & (cur >= 0)
            if not active.any():
                break
            for s in np.unique(cur[active]).tolist():
                self._row(s)
            nxt = self._table[np.where(cur >= 0, cur, 0), self._bytes[:, col]]
            cur = np.where(active, nxt, cur)
        return cur

    def _advance(self, i: int, token: int) -> int:
        for b in self.lex.token_bytes(token):
            i = int(self._row(i)[b])
            if i < 0:
                return -1
        return i

    # -- hooks -----------------------------------------------------------------------------------------
    def pinned_tokens(self, state: RequestView) -> dict[int, int]:
        if state.params.stop:
            raise ValueError("stop sequences cannot be combined with structured output (they could cut the JSON)")
        if state.params.max_tokens < 2:
            raise ValueError("max_tokens must be at least 2 for a JSON object")
        start = self._id(((), "val", None))
        first = self._advance(start, self.open_id[0])
        ends = [int(x) for x in state.end_ids.tolist()]
        eos = self.tokenizer.eos_id
        # [machine state at the frontier, frontier position, end id]
        self._runs[state] = [first, state.prompt_len + 1, eos if eos in ends else ends[0]]
        return {state.prompt_len: self.open_id[0]}

    def mask_logits(self, state: RequestView, positions: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        sid, front, end_id = self._runs[state]
        allow = torch.zeros_like(logits, dtype=torch.bool)
        vocab = logits.shape[1]
        done = self._states[sid][1] == "done"
        for i, pos in enumerate(positions.tolist()):
            if bool(state.committed[pos]):
                allow[i, int(state.tokens[pos])] = True
            elif done:
                allow[i, end_id] = True
            elif pos == front:
                left = state.total - pos - 1  # positions after this one
                nxt = self._advance_all(sid)
                ok = (nxt >= 0) & (self._close[np.where(nxt >= 0, nxt, 0)] <= left)
                ids = self.cand[ok]
                allow[i, torch.from_numpy(ids[ids < vocab])] = True
            else:  # later positions: only gated in allow_commits
                ids = self.cand[self.cand < vocab]
                allow[i, torch.from_numpy(ids)] = True
        return logits.masked_fill(~allow, float("-inf"))

    def allow_commits(self, state, positions, tokens, keep):
        run = self._runs[state]
        sid, front, end_id = run
        out = torch.zeros_like(keep)
        by_pos = {int(p): i for i, p in enumerate(positions.tolist())}
        first = True
        while front in by_pos:
            i = by_pos[front]
            if not (bool(keep[i]) or first):
                break
            tok = int(tokens[i])
            if self._states[sid][1] == "done":
                ok = tok == end_id
                nxt = sid
            else:
                nxt = self._advance(sid, tok)
                ok = nxt >= 0 and self._close[nxt] <= state.total - front - 1
            if not ok:
                break
            out[i] = True
            sid, front, first = nxt, front + 1, False
        run[0], run[1] = sid, front
        return out

    def finished(self, state: RequestView) -> bool:
        run = self._runs.get(state)
        return run is not None and self._states[run[0]][1] == "done"

    def validate(self, text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"output is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise StructuredOutputError("output is not a JSON object")
        return value
