"""The skeleton constraint: pinned JSON structure, value slots filled in any order, always completable.

How it plugs into the decode loop (``quicksilver.decoding``):

* ``pinned_tokens``: lays the skeleton out for this request's canvas and pins every fixed token (braces,
  quoted keys, punctuation, single-valued consts); pinned runs are committed up front and cost no forward.
* ``mask_logits``: each open slot position may only take tokens with which the slot can still be
  completed to a valid value (exact, whatever order positions are filled in); the filler token (a special
  token that decodes to nothing) pads short values and receives the probability mass of tokens that would
  close the value (the closing quote, ``,``, ``}``, end-of-text), so "I am done" becomes "pad".
  Positions after the skeleton may only take the end token; committed tokens in slots are frozen (self
  correction cannot break the skeleton).
* ``allow_commits``: tokens committed together in one step must be jointly completable; proposals are
  accepted left to right while the slot stays feasible (the first always is).
* ``finished``: all skeleton positions committed.

A tool call for one of several tools first fills the name slot; once it is complete the arguments
skeleton of that tool is pinned behind it ("late pinning").

Layouts (``layout=``):

* ``"lazy"`` (default): the skeleton is laid out as the answer is written. A slot's tokens are committed left
  to right; once its value is complete (no token but the filler fits, or the model picks the filler: the
  "value is over" mass) the slot is cut to the value's length and the next skeleton piece is pinned right
  behind it. No filler ever sits inside the answer, so the model sees text laid out as in training
  (``"age": 52, "city"`` rather than ``"age": 52<pad><pad>..., "city"``), at the price of values being
  written left to right (pinned text still costs no forward). A value of open length (a string, an array) may
  use every canvas position the rest of the skeleton does not need, so a long argument (code, a message body) is
  written in full rather than cut at a default slot width.
* ``"fixed"``: the whole skeleton is pinned up front and each value slot has a fixed width padded with the
  filler (slots are filled in any order, and a model that attends ahead sees the keys after a value).

Slots meet the pinned text where the tokenizer cuts the canonical text (``segmentation.py``).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from quicksilver.decoding.constraints import Constraint
from quicksilver.decoding.request_view import RequestView
from quicksilver.structured.layout import Layout, SlotRun, lay_out
from quicksilver.structured.lexicon import Lexicon, lexicon_for
from quicksilver.structured.schema import Piece
from quicksilver.structured.segmentation import natural_pieces
from quicksilver.tokenizer import Tokenizer

LAYOUTS = ("lazy", "fixed")


class StructuredOutputError(ValueError):
    """Decoded text failed validation (a bug: the constraint should make this impossible)."""


@dataclass
class Plan:
    """The layouts for one canvas size: the head, and per choice a tail pinned once the choice is made."""

    head: Layout
    tails: dict[str, Layout] | None = None  # None: the head is the whole skeleton
    choice_slot: int | None = None  # index of the slot whose value picks the tail
    choice_affix: tuple[int, int] = (0, 0)  # bytes of fixed prefix/suffix around the choice slot's value

    def choice(self, value: bytes) -> Layout:
        pre, suf = self.choice_affix
        return self.tails[value[pre : len(value) - suf].decode("utf-8")]


@dataclass
class _Run:
    base: int  # absolute position of the answer's first token
    plan: Plan
    layout: Layout
    end_id: int
    complete: bool
    slot_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # relative pos -> slot / -1
    active: int = -1  # lazy layout: the slot being written (len(slots) once all are closed); -1: fixed layout
    laid: int = 0  # lazy layout: relative positions below this are laid out (pinned, or in a placed slot)

    def index(self) -> None:
        self.slot_at = np.full(self.layout.length, -1, dtype=np.int64)
        for i, s in enumerate(self.layout.slots):
            self.slot_at[s.offset : s.offset + s.length] = i


def _resized(layout: Layout, s: int, length: int) -> Layout:
    """``layout`` with slot ``s`` cut or widened to ``length`` positions; what follows it moves with its end."""
    slot = layout.slots[s]
    delta = length - slot.length
    end = slot.offset + slot.length
    tokens = layout.tokens[: slot.offset + min(length, slot.length)] + [-1] * max(delta, 0) + layout.tokens[end:]
    slots = [*layout.slots[:s], dataclasses.replace(slot, length=length)]
    slots += [dataclasses.replace(x, offset=x.offset + delta) for x in layout.slots[s + 1 :]]
    return Layout(tokens, slots)


def _concat(head: Layout, tail: Layout) -> Layout:
    shift = head.length
    slots = list(head.slots) + [
        dataclasses.replace(s, offset=s.offset + shift) for s in tail.slots
    ]
    return Layout(head.tokens + tail.tokens, slots)


class StructuredConstraint(Constraint):
    """Pins a compiled skeleton; see the module docstring. ``validate(text)`` checks a final answer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        planner: Callable[[int | None, Lexicon, tuple[int, ...]], Plan],
        validate: Callable[[str], Any],
        max_tokens: int | None = None,
        layout: str = "lazy",
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}")
        self.lazy = layout == "lazy"
        self.tokenizer = tokenizer
        self.lex = lexicon_for(tokenizer)
        self._planner = planner
        self._validate = validate
        self._plans: dict[tuple, Plan] = {}
        self._runs: weakref.WeakKeyDictionary[RequestView, _Run] = weakref.WeakKeyDictionary()
        # fail early (UnsupportedSchema for values no vocabulary string satisfies; ValueError if the
        # skeleton cannot fit max_tokens) rather than when decoding starts
        self.plan(None)
        if max_tokens is not None:
            self.plan(max_tokens)

    def plan(self, max_tokens: int | None, end_ids: tuple[int, ...] = ()) -> Plan:
        key = (max_tokens, end_ids)
        if key not in self._plans:
            self._plans[key] = self._planner(max_tokens, self.lex, end_ids)
        return self._plans[key]

    def skeleton_length(self, max_tokens: int | None = None) -> int:
        """Canvas tokens the (first) skeleton occupies."""
        p = self.plan(max_tokens)
        if p.tails is None:
            return p.head.length
        return p.head.length + max(t.length for t in p.tails.values())

    def validate(self, text: str) -> Any:
        """Parse and validate a final answer; raises StructuredOutputError if it is not valid."""
        return self._validate(text)

    # -- hooks -----------------------------------------------------------------------------------------
    def pinned_tokens(self, state: RequestView) -> dict[int, int]:
        if state.params.stop:
            raise ValueError("stop sequences cannot be combined with structured output (they could cut the JSON)")
        end_ids = tuple(int(x) for x in state.end_ids.tolist())
        plan = self.plan(state.params.max_tokens, end_ids)
        eos = self.tokenizer.eos_id
        end_id = eos if eos in end_ids else end_ids[0]
        layout = plan.head
        run = _Run(state.prompt_len, plan, layout, end_id, complete=plan.tails is None)
        run.index()
        self._runs[state] = run
        if not self.lazy:
            return {run.base + i: t for i, t in enumerate(layout.tokens) if t >= 0}
        run.active = 0
        pins = self._lay_next(state, run)
        pins.update(self._pin_forced_lazy(state, run, {}))
        return pins

    def _slot_cols(self, state: RequestView, run: _Run, slot: SlotRun) -> list[int]:
        a = slot.automaton
        start = run.base + slot.offset
        toks = state.tokens[start : start + slot.length].tolist()
        done = state.committed[start : start + slot.length].tolist()
        return [a.col_of.get(t, -2) if ok else -1 for t, ok in zip(toks, done, strict=True)]

    def mask_logits(self, state: RequestView, positions: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        run = self._runs[state]
        n, vocab = logits.shape
        allow = np.zeros((n, vocab), dtype=bool)
        rel = (positions - run.base).tolist()
        committed = state.committed[positions].tolist()
        current = state.tokens[positions].tolist()
        by_slot: dict[int, list[int]] = {}
        laid = run.laid if self.lazy else run.layout.length
        all_laid = run.complete and (not self.lazy or run.active >= len(run.layout.slots))
        for i, r in enumerate(rel):
            if r >= laid:
                if all_laid and r >= run.layout.length:
                    allow[i, run.end_id] = True  # after the skeleton: only the end of the answer
                else:
                    allow[i] = True  # not laid out yet; never committed (see allow_commits)
                    allow[i, [e for e in state.end_ids.tolist() if e < vocab]] = False
                continue
            s = int(run.slot_at[r])
            if s < 0 or committed[i]:  # pinned, or a committed token: keep it
                allow[i, current[i]] = True
                continue
            by_slot.setdefault(s, []).append(i)
        filler = self.lex.filler_id
        pad_rows: list[int] = []
        pad_closers: list[np.ndarray] = []
        for s, rows in by_slot.items():
            slot = run.layout.slots[s]
            offsets = [rel[i] - slot.offset for i in rows]
            masks = slot.solver.masks(self._slot_cols(state, run, slot), offsets)
            ids = slot.automaton.token_ids
            keep = ids < vocab
            for i, off in zip(rows, offsets, strict=True):
                allow[i, ids[masks[off] & keep]] = True
                if allow[i, filler] and slot.closers.size:
                    pad_rows.append(i)
                    pad_closers.append(np.append(slot.closers[slot.closers < vocab], filler))
        for i, closers in zip(pad_rows, pad_closers, strict=True):
            # "end this value" mass (closing quote, comma, brace, end token) moves to the filler
            logits[i, filler] = torch.logsumexp(logits[i, torch.from_numpy(closers)], dim=0)
        return logits.masked_fill(~torch.from_numpy(allow), float("-inf"))

    def allow_commits(
        self, state: RequestView, positions: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        run = self._runs[state]
        if self.lazy:
            return self._allow_commits_lazy(state, run, positions, tokens, keep)
        out = torch.zeros_like(keep)
        order = positions.argsort().tolist()
        trial: dict[int, list[int]] = {}

        def try_commit(i: int) -> bool:
            r = int(positions[i]) - run.base
            if r >= run.layout.length:
                return run.complete
            s = int(run.slot_at[r])
            if s < 0:
                return False
            slot = run.layout.slots[s]
            cols = trial.get(s)
            if cols is None:
                cols = trial[s] = self._slot_cols(state, run, slot)
            col = slot.automaton.col_of.get(int(tokens[i]))
            if col is None:
                return False
            off = r - slot.offset
            cols[off] = col
            if slot.solver.feasible(cols):
                return True
            cols[off] = -1
            return False

        for i in order:
            if bool(keep[i]) and try_commit(i):
                out[i] = True
        if bool(keep.any()) and not bool(out.any()):
            for i in order:  # the policy's picks all clash: commit the leftmost slot token that fits
                if try_commit(i):
                    out[i] = True
                    break
        # A filler may be one of the model's end tokens (rainbow pads often are): marking it fixed keeps
        # the loop from reading it as the end of the answer. Fixed = never revised, as committed slots are.
        fill = out & (tokens == self.lex.filler_id)
        if bool(fill.any()):
            state.fixed[positions[fill]] = True
        self._pin_forced(state, run, trial, positions, out)
        if not run.complete:
            self._maybe_expand(state, run, positions, tokens, out)
        return out

    def _pin_forced(
        self, state: RequestView, run: _Run, trial: dict[int, list[int]], positions: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Pin open slot positions that have exactly one possible token left (the rest of a filler run,
        the tail of an enum alternative): they then cost no forward at all."""
        touched = {int(run.slot_at[int(p) - run.base]) for p in positions[out].tolist()
                   if 0 <= int(p) - run.base < run.layout.length}
        for s in touched - {-1}:
            slot = run.layout.slots[s]
            cols = list(trial[s])
            # trial columns include rejected tries reset to -1, and accepted ones: exactly the new commitments
            free = [i for i, c in enumerate(cols) if c < 0]
            if not free:
                continue
            masks = slot.solver.masks(cols, free)
            ids = slot.automaton.token_ids
            for off in free:
                allowed = np.flatnonzero(masks[off])
                if allowed.size == 1:
                    p = run.base + slot.offset + off
                    state.tokens[p] = int(ids[allowed[0]])
                    state.committed[p] = state.fixed[p] = True

    def _maybe_expand(
        self, state: RequestView, run: _Run, positions: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Once the choice slot (tool name) is complete, pin the chosen tail behind the head."""
        plan = run.plan
        slot = run.layout.slots[plan.choice_slot]
        start = run.base + slot.offset
        toks = state.tokens[start : start + slot.length].clone()
        done = state.committed[start : start + slot.length].clone()
        for i in out.nonzero().flatten().tolist():
            r = int(positions[i]) - start
            if 0 <= r < slot.length:
                toks[r] = tokens[i]
                done[r] = True
        if not bool(done.all()):
            return
        # the slot's bytes, as its automaton read them (exactly one of the escaped tool names)
        tail = plan.choice(b"".join(self.lex.token_bytes(t) for t in toks.tolist() if t != self.lex.filler_id))
        run.layout = _concat(plan.head, tail)
        run.complete = True
        run.index()
        for r in range(plan.head.length, run.layout.length):
            tok = run.layout.tokens[r]
            if tok >= 0:
                p = run.base + r
                state.tokens[p] = tok
                state.committed[p] = state.fixed[p] = True

    # -- lazy layout -------------------------------------------------------------------------------------
    def _allow_commits_lazy(
        self, state: RequestView, run: _Run, positions: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """Commit the active slot's next positions left to right (the policy's picks, as long as they are
        contiguous and keep the slot completable); the filler there means "the value is over"."""
        out = torch.zeros_like(keep)
        slots = run.layout.slots
        if run.active >= len(slots):  # all laid out: only end tokens after the skeleton (see mask_logits)
            return keep & (positions - run.base >= run.layout.length)
        slot = slots[run.active]
        start = run.base + slot.offset
        cols = self._slot_cols(state, run, slot)
        nxt = _committed_prefix(cols)
        row_of = {int(p): i for i, p in enumerate(positions.tolist())}
        auto = slot.automaton
        ended = False

        def try_next(i: int) -> bool:
            nonlocal nxt, ended
            col = auto.col_of.get(int(tokens[i]))
            if col is None:
                return False
            cols[nxt] = col
            fits = slot.solver.feasible(cols)
            if col == auto.filler_col:
                # the model closes the value here (if it is complete: the token was sampled before this step's
                # earlier commits); the next skeleton piece then goes in this position
                cols[nxt] = -1
                ended = fits
                return False
            if not fits:
                cols[nxt] = -1
                return False
            out[i] = True
            nxt += 1
            return True

        while nxt < slot.length and not ended:
            i = row_of.get(start + nxt)
            if i is None or not bool(keep[i]) or not try_next(i):
                break
        if not ended and not bool(out.any()) and bool(keep.any()) and nxt < slot.length:
            i = row_of.get(start + nxt)  # the policy's picks are all further right: take the slot's next position
            if i is not None:
                try_next(i)
        if bool(out.any()):
            state.fixed[positions[out]] = True  # committed values are never revised (self-correction)
        trial = {run.active: cols}
        if ended:
            self._close_slot(state, run, nxt, trial)
        self._pin_forced_lazy(state, run, trial)
        return out

    def _lay_next(self, state: RequestView, run: _Run) -> dict[int, int]:
        """Pin the skeleton tokens from the end of the last closed slot up to the active slot (or the end)."""
        self._widen_active(state, run)
        slots = run.layout.slots
        prev_end = slots[run.active - 1].offset + slots[run.active - 1].length if run.active > 0 else 0
        if run.active < len(slots):
            upto = slots[run.active].offset
            run.laid = upto + slots[run.active].length
        else:
            upto = run.laid = run.layout.length
        pins = {}
        for r in range(prev_end, upto):
            p, tok = run.base + r, run.layout.tokens[r]
            state.tokens[p] = tok
            state.committed[p] = state.fixed[p] = True
            pins[p] = tok
        return pins

    def _widen_active(self, state: RequestView, run: _Run) -> None:
        """Give the slot about to be written every canvas position the skeleton does not need: the lazy layout
        cuts it to its value's length when the value ends, so room costs nothing unused, and a long value (code,
        a message body) is not cut at a default width. The rest of the skeleton keeps the room it was fitted with,
        and each later open-length slot is widened the same way when its turn comes."""
        slots = run.layout.slots
        if not run.complete or run.active >= len(slots) or not slots[run.active].flexible:
            return
        limit = state.params.max_tokens
        spare = (limit - run.layout.length) if limit is not None else 0
        if spare <= 0:
            return
        run.layout = _resized(run.layout, run.active, slots[run.active].length + spare)
        run.index()

    def _close_slot(self, state: RequestView, run: _Run, length: int, state_cols: dict) -> dict[int, int]:
        """The active slot's value is complete after ``length`` tokens: cut the slot there, pin what follows."""
        s = run.active
        layout = run.layout
        slot = layout.slots[s]
        if length != slot.length:
            layout = _resized(layout, s, length)
        if not run.complete and s == run.plan.choice_slot:
            cols = state_cols.get(s)
            ids = ([int(slot.automaton.token_ids[c]) for c in cols[:length]] if cols is not None
                   else state.tokens[run.base + slot.offset : run.base + slot.offset + length].tolist())
            value = b"".join(self.lex.token_bytes(t) for t in ids)
            layout = _concat(layout, run.plan.choice(value))
            run.complete = True
        run.layout = layout
        run.active = s + 1
        run.index()
        return self._lay_next(state, run)

    def _pin_forced_lazy(self, state: RequestView, run: _Run, trial: dict[int, list[int]]) -> dict[int, int]:
        """Commit the active slot's next position while only one token fits there; close the slot when only
        the filler does (the value is complete); go on into the next slot. ``trial``: columns decided this
        step but not written to the canvas yet."""
        pins: dict[int, int] = {}
        while run.active < len(run.layout.slots):
            slot = run.layout.slots[run.active]
            cols = trial.get(run.active) or self._slot_cols(state, run, slot)
            nxt = _committed_prefix(cols)
            if nxt >= slot.length:
                pins.update(self._close_slot(state, run, slot.length, {run.active: cols}))
                continue
            allowed = np.flatnonzero(slot.solver.masks(cols, [nxt])[nxt])
            if allowed.size != 1:
                break
            col = int(allowed[0])
            if col == slot.automaton.filler_col:
                pins.update(self._close_slot(state, run, nxt, {run.active: cols}))
                continue
            p, tok = run.base + slot.offset + nxt, int(slot.automaton.token_ids[col])
            state.tokens[p] = tok
            state.committed[p] = state.fixed[p] = True
            pins[p] = tok
            cols[nxt] = col
            trial = {run.active: cols}
        return pins

    def filler_token_ids(self) -> frozenset[int]:
        return frozenset() if self.lex.filler_id is None else frozenset({self.lex.filler_id})

    def finished(self, state: RequestView) -> bool:
        run = self._runs.get(state)
        if run is None or not run.complete or (self.lazy and run.active < len(run.layout.slots)):
            return False
        return bool(state.committed[run.base : run.base + run.layout.length].all())


def _committed_prefix(cols: list[int]) -> int:
    """Leading committed positions of a slot (columns >= 0)."""
    n = 0
    while n < len(cols) and cols[n] >= 0:
        n += 1
    return n


def schema_planner(pieces: list[Piece], tokenizer: Tokenizer):
    natural = natural_pieces(pieces, tokenizer)

    def planner(max_tokens: int | None, lex: Lexicon, end_ids: tuple[int, ...]) -> Plan:
        return Plan(lay_out(natural, tokenizer, lex, max_tokens, end_ids))

    return planner


def json_validator(validator: Any | None) -> Callable[[str], Any]:
    def validate(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"output is not valid JSON: {exc}") from None
        if validator is not None:
            err = next(iter(validator.iter_errors(value)), None)
            if err is not None:
                raise StructuredOutputError(f"output does not match the schema: {err.message}")
        return value

    return validate
