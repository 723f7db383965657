"""Byte automata for value slots, lifted to tokens, and the feasibility engine that fills slots out of order.

A value language (JSON string content, a number in a range, one of some literals, ...) is written as a
small deterministic automaton over bytes: a start state, ``step(state, byte) -> (next, increment) | None``
and ``accept(state)``. States are any hashable values; the reachable ones are enumerated once.

An optional bounded counter rides along (string length in characters, array item count): each byte step
adds ``increment`` to it and acceptance needs ``count_min <= count <= count_max``. Keeping the count out
of the state keeps tables small (a string stays ~12 states whatever its maxLength).

:class:`TokenAutomaton` runs every token's bytes from every state at once (numpy), giving a table
``next[state, token]`` and ``added[state, token]``. A slot of ``n`` canvas positions holds a token
sequence; a dedicated filler token may only follow a complete value and be followed by more filler, so
shorter values are padded. :class:`SlotSolver` answers, for a slot where some positions are committed and
others are free, which tokens each free position may take so that the whole slot can still be completed
to an accepted value (forward reachability x backward co-reachability, exact, any fill order).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from quicksilver.structured.lexicon import Lexicon

Step = Callable[[Hashable, int], "tuple[Hashable, int] | None"]


@dataclass(frozen=True)
class ByteAutomaton:
    start: Hashable
    step: Step
    accept: Callable[[Hashable], bool]
    count_min: int = 0
    count_max: int | None = None  # None: no upper bound (the counter saturates at count_min)
    counted: bool = False  # False: increments are ignored
    exempt: Callable[[Hashable], bool] | None = None  # accepted states that ignore the count bounds


class TooManyStates(ValueError):
    pass


# Bounds on what one value slot may cost to build, checked before anything large is allocated (a request
# that exceeds them is refused: the server answers 400 rather than working for minutes or running out of memory).
MAX_COUNT = 1024  # largest string length / item count a counter tracks (minLength, maxItems, ...)
MAX_RELATION = 1 << 25  # increments x states x states: the [K, S, S] transition relations (2 float32 copies)
MAX_WORK = 1 << 30  # increments x states x states x counter width: one free position's reachability step (~7 s)


def check_counter(auto: ByteAutomaton) -> None:
    """TooManyStates if ``auto``'s counter bound is larger than :data:`MAX_COUNT`."""
    if auto.counted and max(auto.count_min, auto.count_max or 0) > MAX_COUNT:
        raise TooManyStates(f"its length or item count bound is larger than {MAX_COUNT}, too large to enforce")


def enumerate_states(auto: ByteAutomaton, limit: int = 4000) -> tuple[list[Hashable], np.ndarray, np.ndarray]:
    """All states reachable from the start; byte tables next [S, 256] (-1 dead) and increment [S, 256]."""
    index: dict[Hashable, int] = {auto.start: 0}
    states = [auto.start]
    rows_next: list[list[int]] = []
    rows_inc: list[list[int]] = []
    i = 0
    while i < len(states):
        s = states[i]
        nxt = [-1] * 256
        inc = [0] * 256
        for b in range(256):
            r = auto.step(s, b)
            if r is None:
                continue
            t, k = r
            j = index.get(t)
            if j is None:
                j = index[t] = len(states)
                states.append(t)
                if len(states) > limit:
                    raise TooManyStates(f"value automaton has more than {limit} states")
            nxt[b] = j
            inc[b] = k if auto.counted else 0
        rows_next.append(nxt)
        rows_inc.append(inc)
        i += 1
    return states, np.array(rows_next, dtype=np.int32), np.array(rows_inc, dtype=np.int32)


class TokenAutomaton:
    """A byte automaton lifted to a vocabulary, plus the filler state (index ``fill``, last)."""

    def __init__(self, auto: ByteAutomaton, lex: Lexicon):
        check_counter(auto)
        states, bnext, binc = enumerate_states(auto)
        n = len(states)
        accept = np.array([bool(auto.accept(s)) for s in states] + [True])
        exempt = np.array([bool(auto.exempt(s)) if auto.exempt else False for s in states] + [False])
        # run every (non-special, non-empty) token from every state, byte column by byte column
        cand = np.nonzero((lex.lengths > 0) & ~lex.special)[0]
        live_first = (bnext >= 0).any(axis=0)  # bytes some state can read: prune dead tokens early
        cand = cand[live_first[lex.byte_matrix[cand, 0]]]
        cur = np.tile(np.arange(n, dtype=np.int32)[:, None], (1, cand.size))
        added = np.zeros((n, cand.size), dtype=np.int32)
        lengths = lex.lengths[cand]
        for col in range(int(lengths.max()) if cand.size else 0):
            active = (col < lengths)[None, :] & (cur >= 0)
            if not active.any():
                break
            byte = lex.byte_matrix[cand, col].astype(np.int64)
            safe = np.where(cur >= 0, cur, 0)
            nxt = bnext[safe, byte[None, :].repeat(n, 0)]
            inc = binc[safe, byte[None, :].repeat(n, 0)]
            added = np.where(active, added + inc, added)
            cur = np.where(active, nxt, cur)
        alive = (cur >= 0).any(axis=0)
        self.token_ids = cand[alive].astype(np.int64)  # vocabulary ids of the columns
        nxt_tab = cur[:, alive]
        inc_tab = added[:, alive]
        self.fill = n
        self.filler_col = self.token_ids.size if lex.filler_id is not None else None
        cols = self.token_ids.size + (1 if lex.filler_id is not None else 0)
        # int16 tables: states are capped at 4000 and per-token increments are small (memory with 150k vocabs)
        self.next = np.full((n + 1, cols), -1, dtype=np.int16)
        self.inc = np.zeros((n + 1, cols), dtype=np.int16)
        self.next[:n, : self.token_ids.size] = nxt_tab
        self.inc[:n, : self.token_ids.size] = np.minimum(inc_tab, np.iinfo(np.int16).max)
        if lex.filler_id is not None:
            self.token_ids = np.append(self.token_ids, lex.filler_id)
            # filler only after a complete value; it ends the counted part, so an exempt value (one that
            # ignores the count bounds) pads into its own filler state
            acc = np.nonzero(accept[:n] & ~exempt[:n])[0]
            self.next[acc, self.filler_col] = n
            if exempt.any():
                n_all = n + 2
                self.next = np.vstack([self.next, np.full((1, cols), -1, dtype=np.int16)])
                self.inc = np.vstack([self.inc, np.zeros((1, cols), dtype=np.int16)])
                self.next[np.nonzero(exempt[:n])[0], self.filler_col] = n + 1
                self.next[n + 1, self.filler_col] = n + 1
                accept = np.append(accept, True)
                exempt = np.append(exempt[:n + 1], True)
            else:
                n_all = n + 1
            self.next[n, self.filler_col] = n
        else:
            n_all = n + 1
        self.accept = accept
        self.exempt = exempt
        self.n_states = n_all
        self.counted = auto.counted
        self.count_min = auto.count_min if auto.counted else 0
        self.count_max = auto.count_max if auto.counted else None
        self.cap = (self.count_max if self.count_max is not None else self.count_min) if auto.counted else 0
        self.col_of = {int(t): i for i, t in enumerate(self.token_ids.tolist())}
        # distinct (increment) values and the state->state relation for each, for free positions
        self.max_inc = int(self.inc.max()) if self.inc.size else 0
        live = self.next >= 0
        ks = np.unique(self.inc[live]).tolist() if live.any() else []
        relation_size = len(ks) * self.n_states * self.n_states
        if relation_size > MAX_RELATION or relation_size * self.width > MAX_WORK:
            raise TooManyStates(f"value automaton is too large to enforce ({self.n_states} states, {len(ks)} "
                                f"distinct increments, counter width {self.width})")
        self.relation: dict[int, np.ndarray] = {}  # k -> [S, S] uint8: some token moves s -> s' adding k
        for k in ks:
            rel = np.zeros((self.n_states, self.n_states), dtype=np.uint8)
            rows, cols = np.nonzero(live & (self.inc == k))
            rel[rows, self.next[rows, cols]] = 1
            self.relation[int(k)] = rel
        # the same as stacked float matrices rel[k] [S, S]; the counter moves (c -> add(c, k)) are shifts
        self._ks = [int(k) for k in ks]
        self._rel = np.stack([self.relation[k] for k in self._ks]).astype(np.float32) if ks else np.zeros(
            (0, self.n_states, self.n_states), dtype=np.float32)
        self._rel_t = np.ascontiguousarray(self._rel.transpose(0, 2, 1))
        self.min_length_memo: dict[int, int | None] = {}  # SlotSolver.min_length per limit

    @property
    def width(self) -> int:
        return self.cap + 1

    def add(self, k: int) -> np.ndarray:
        """New counter value for each old value after adding ``k`` (-1 = over the maximum)."""
        new = np.arange(self.width) + k
        if self.count_max is not None:
            return np.where(new <= self.cap, new, -1)
        return np.minimum(new, self.cap)

    def final(self) -> np.ndarray:
        """[states, width] bool: accepted (state, count) pairs."""
        ok = np.zeros((self.n_states, self.width), dtype=bool)
        ok[self.accept, self.count_min:] = True
        ok[self.accept & self.exempt, :] = True
        return ok

    def initial(self) -> np.ndarray:
        r = np.zeros((self.n_states, self.width), dtype=bool)
        r[0, 0] = True
        return r

    # -- one position ---------------------------------------------------------------------------------
    def shift_counts(self, r: np.ndarray, k: int) -> np.ndarray:
        """[S, W] -> [S, W]: out[s, add(c, k)] = OR r[s, c] (each counter value moved up by ``k``)."""
        width = self.width
        out = np.zeros_like(r)
        saturating = self.count_max is None
        if k >= width:
            if saturating:
                out[:, -1] = r.any(axis=1)
            return out
        out[:, k:] = r[:, : width - k]
        if saturating and k > 0:  # the counter saturates at count_min: values past it stay there
            out[:, -1] |= r[:, width - k :].any(axis=1)
        return out

    def pull_counts(self, c: np.ndarray, k: int) -> np.ndarray:
        """[S, W] -> [S, W]: out[s, x] = c[s, add(x, k)] (False where adding ``k`` passes the maximum)."""
        tgt = self.add(k)
        valid = tgt >= 0
        return c[:, np.where(valid, tgt, 0)] & valid

    def forward_free(self, r: np.ndarray) -> np.ndarray:
        """Sets after one free position: out[p, d] = OR_k,s,c rel[k][s, p] & r[s, c] & (add(c, k) == d)."""
        if not self._rel.shape[0]:
            return np.zeros_like(r)
        moved = np.stack([self.shift_counts(r, k) for k in self._ks]).astype(np.float32)  # [K, S, W]
        return (self._rel_t @ moved).sum(axis=0) > 0

    def forward_token(self, r: np.ndarray, col: int) -> np.ndarray:
        out = np.zeros_like(r)
        for s in np.nonzero(r.any(axis=1))[0].tolist():
            t = int(self.next[s, col])
            if t < 0:
                continue
            tgt = self.add(int(self.inc[s, col]))
            ok = (tgt >= 0) & r[s]
            if ok.any():
                out[t, tgt[ok]] = True
        return out

    def backward_free(self, c: np.ndarray) -> np.ndarray:
        """Co-reachable sets one free position earlier: OR_k rel[k] @ c @ moves[k]^T."""
        if not self._rel.shape[0]:
            return np.zeros_like(c)
        pulled = np.stack([self.pull_counts(c, k) for k in self._ks]).astype(np.float32)  # [K, S, W]
        return (self._rel @ pulled).sum(axis=0) > 0

    def backward_token(self, c: np.ndarray, col: int) -> np.ndarray:
        out = np.zeros_like(c)
        nxt = self.next[:, col]
        for s in np.nonzero(nxt >= 0)[0].tolist():
            tgt = self.add(int(self.inc[s, col]))
            ok = tgt >= 0
            out[s, ok] = c[int(nxt[s]), tgt[ok]]
        return out

    def allowed_columns(self, r: np.ndarray, c_next: np.ndarray) -> np.ndarray:
        """Columns t with some reachable (s, n) and (next[s,t], n + inc[s,t]) co-reachable."""
        reach = np.nonzero(r.any(axis=1))[0]
        if not self.counted:  # no counter: t is allowed iff next[s, t] is co-reachable for a reachable s
            table = np.append(c_next[:, 0], False)  # index -1: dead
            return table[self.next[reach]].any(axis=0)
        allowed = np.zeros(self.next.shape[1], dtype=bool)
        targets = self._targets  # [width, max_inc + 1] counter after adding k (-1: over the maximum)
        valid = targets >= 0
        gathered = c_next[:, np.where(valid, targets, 0)] & valid  # [S, width, K]
        for s in reach.tolist():
            ok = (gathered & r[s][None, :, None]).any(axis=1)  # [S, K]: target state and increment that fit
            table = np.vstack([ok, np.zeros((1, ok.shape[1]), dtype=bool)])  # row -1: dead
            allowed |= table[self.next[s], self.inc[s]]
        return allowed

    @property
    def _targets(self) -> np.ndarray:
        t = getattr(self, "_targets_cache", None)
        if t is None:
            t = np.stack([self.add(k) for k in range(self.max_inc + 1)], axis=1)
            self._targets_cache = t
        return t


class SlotSolver:
    """Which tokens each position of one slot may take, given the committed ones (-1 = free).

    Reachable sets are memoised by the committed prefix (forward) and suffix (backward), and masks by
    the pair of sets, so a decode step only recomputes what its commits changed.
    """

    _MEMO_LIMIT = 4096  # reachable-set entries (small arrays)
    _MASK_LIMIT = 64  # vocabulary-sized masks

    def __init__(self, automaton: TokenAutomaton):
        self.a = automaton
        self._fwd: dict[tuple, np.ndarray] = {}
        self._bwd: dict[tuple, np.ndarray] = {}
        self._masks: dict[bytes, np.ndarray] = {}

    def _trim(self) -> None:
        for memo in (self._fwd, self._bwd):
            if len(memo) > self._MEMO_LIMIT:
                memo.clear()
        if len(self._masks) > self._MASK_LIMIT:
            self._masks.clear()

    def _forward(self, cols: list[int]) -> list[np.ndarray]:
        a = self.a
        out = [a.initial()]
        key: tuple = ()
        steady = False  # the last free position left the set unchanged: further free positions do too
        for col in cols:
            if col < 0 and steady:  # long free runs (a wide lazy slot) cost nothing past this point
                out.append(out[-1])
                continue
            key = key + (col,)
            r = self._fwd.get(key)
            if r is None:
                r = a.forward_free(out[-1]) if col < 0 else a.forward_token(out[-1], col)
                self._fwd[key] = r
            steady = col < 0 and np.array_equal(r, out[-1])
            out.append(r)
        return out

    def _backward(self, cols: list[int]) -> list[np.ndarray]:
        a = self.a
        out = [a.final()]
        key: tuple = ()
        steady = False
        for col in reversed(cols):
            if col < 0 and steady:
                out.append(out[-1])
                continue
            key = (col,) + key
            c = self._bwd.get(key)
            if c is None:
                c = a.backward_free(out[-1]) if col < 0 else a.backward_token(out[-1], col)
                self._bwd[key] = c
            steady = col < 0 and np.array_equal(c, out[-1])
            out.append(c)
        out.reverse()
        return out

    def feasible(self, cols: list[int]) -> bool:
        self._trim()
        return bool((self._forward(cols)[-1] & self.a.final()).any())

    def masks(self, cols: list[int], wanted: list[int]) -> dict[int, np.ndarray]:
        """Allowed-column masks for the slot offsets in ``wanted`` (all treated as free)."""
        self._trim()
        fwd, bwd = self._forward(cols), self._backward(cols)
        out: dict[int, np.ndarray] = {}
        for i in wanted:
            key = fwd[i].tobytes() + bwd[i + 1].tobytes()
            m = self._masks.get(key)
            if m is None:
                m = self._masks[key] = self.a.allowed_columns(fwd[i], bwd[i + 1])
            out[i] = m
        return out

    def min_length(self, limit: int = 512) -> int | None:
        """Fewest tokens that form an accepted value (None if none within ``limit``); kept on the automaton,
        which is shared by every layout of the same value (each canvas size, each request)."""
        memo = self.a.min_length_memo
        if limit not in memo:
            memo[limit] = self._min_length(limit)
        return memo[limit]

    def _min_length(self, limit: int) -> int | None:
        a = self.a
        r = a.initial()
        fin = a.final()
        for n in range(limit + 1):
            if (r & fin).any():
                return n
            r = a.forward_free(r)
            if not r.any():
                return None
        return None
