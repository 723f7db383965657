"""Self-speculative decoding: diffusion drafts, causal verification, both in one forward (TiDAR-style).

A block-causal model with a causal context and token shift computes, over finished tokens, exactly what a
causal language model computes: that is its clean stream in training ([x_t || x_0] with the AR loss). So
one forward can carry two copies of the block being decoded:

* the clean copy: the committed tokens followed by the previous step's drafts, attended causally. Its
  output at position p - 1 is the model's next-token distribution for p given the tokens fed before p;
* the noisy copy: a span of positions from the frontier, masks (and any pinned tokens), attended
  bidirectionally among themselves and causally to the verified tokens. Its outputs are the next drafts.

Since the clean stream is causal, neither copy stops at a model block's end: the walk commits, and the noisy
copy drafts, straight across it (training only ever showed the noisy rows one block at a time, but drafts are
proposals; on the suite this gained 5% tokens per forward, docs/performance.md section 7).

Verification walks from the frontier. The clean copy's token for the frontier is committed; while it
equals the draft that was fed there, the clean output one position on was computed from committed tokens
only, so the walk goes on. Every committed token is thus a sample of the model's own causal conditional
(greedy: exactly its causal greedy output) whatever the drafts were. Good drafts only save forwards, and
each forward commits at least one token.

``accept_ratio`` < 1 relaxes the walk for greedy requests (constrained ones too, among the tokens the
constraint allows): a draft the causal stream finds at least that fraction as likely as its top token is
committed as it stands, unless the top token ends the answer. The answer is then no longer exactly the
causal one; the speed it buys and the accuracy it costs are measured in docs/performance.md section 7.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from quicksilver.config import ModelConfig
from quicksilver.decoding.constraints import Constraint
from quicksilver.decoding.kv_cache import KVCache
from quicksilver.decoding.request_view import RequestView
from quicksilver.sampling import SamplingParams, adjust_logits, sample_tokens

if TYPE_CHECKING:
    from quicksilver.tokenizer import Tokenizer


class SpeculatingRequest(RequestView, Protocol):
    """A request as the speculation reads it: its canvas, where its walk stands, and its cache."""

    frontier: int  # first position not yet committed
    block_end: int  # end of the region being decoded (a speculating request's answer end)
    model_block: int
    cache: KVCache | None
    constraint: Constraint | None
    generator: torch.Generator | None

    def answer_counts(self, end: int, vocab_size: int) -> torch.Tensor: ...


def can_verify(cfg: ModelConfig) -> bool:
    """Whether a model's finished tokens are computed as a causal LM computes them (so it can check drafts)."""
    return cfg.attention_mode == "block_causal" and cfg.causal_context and cfg.token_shift


def check_supported(cfg: ModelConfig, params: SamplingParams) -> None:
    """Raise ValueError unless a model with ``cfg`` can verify its own drafts under ``params``."""
    if not can_verify(cfg):
        raise ValueError(
            "policy 'self_speculative' needs a block-causal model with causal_context and token_shift "
            "(its causal stream verifies the drafts)"
        )
    if params.remask_threshold is not None or params.edit_threshold is not None:
        raise ValueError("policy 'self_speculative' commits only verified tokens: remasking does not apply")


@dataclass
class Layout:
    """Where the two copies sit in one forward's rows (clean rows first, then noisy rows)."""

    clean_start: int  # position of the first clean row (everything before it is in the KV cache)
    fed: torch.Tensor  # tokens of the clean rows: committed tokens, then drafts up to clean_end
    verify_positions: torch.Tensor  # positions the clean rows predict, from the frontier on
    draft_positions: torch.Tensor  # open positions the noisy rows predict
    noisy_start: int  # position of the first noisy row

    @property
    def clean_end(self) -> int:
        return self.clean_start + self.fed.numel()


# Draft window by how many speculating requests share a forward. Every request adds about 2 x window + 3 rows,
# and on this CPU a forward's time jumps once its rows pass a few dozen. `benchmarks/speculative_layout.py
# --batches 1,2,4,8,32` on the 12,400-step default (session 12, under training load, noisy), tokens/s for
# windows 8 / 4 / 2: 1 request 216 / 225 / 174, 2: 238 / 260 / 245, 4: 288 / 361 / 389, 8: 400 / 459 / 381,
# 32: 369 / 376 / 395; one request alone, 2 rounds of the layout table: 175 / 158 / 162 (docs/performance.md;
# measured with the noisy span of that time, 2 x window + 4).
WINDOWS = ((1, 8), (8, 4))  # (up to this many requests, window); more requests: 2


def window_for_batch(n_states: int) -> int:
    for most, window in WINDOWS:
        if n_states <= most:
            return window
    return 2


class SelfSpeculation:
    """Per-request draft buffer, forward layout and verification walk."""

    def __init__(self, length: int, mask_id: int, window: int | None = None, span: int | None = None):
        self.mask_id = mask_id
        self.fixed_window = window  # None: chosen per step from the batch size (see window_for_batch)
        self.window = window or WINDOWS[0][1]  # drafts verified per forward
        self.fixed_span = span
        self.drafts = torch.full((length,), mask_id, dtype=torch.long)

    @classmethod
    def for_request(cls, length: int, mask_id: int, params: SamplingParams) -> SelfSpeculation:
        """The speculation for one request. Lossy acceptance makes the answer depend on the drafts, so such a
        request keeps the one-request window whatever the load; an exact one follows the batch size."""
        return cls(length, mask_id, WINDOWS[0][1] if params.accept_ratio < 1 else None)

    def set_batch(self, n_states: int) -> None:
        """Fit the layout to a forward shared by ``n_states`` speculating requests."""
        if self.fixed_window is None:
            self.window = window_for_batch(n_states)

    @property
    def span(self) -> int:
        """Noisy rows per forward: the window and two more; 0 = the rest of the model block. Runs of right
        drafts are short (benchmarks/draft_accuracy.py), so drafts further out seldom pay for their rows:
        against two windows + 4 this gave ~5% fewer tokens per forward and 8-11% more tokens/s alone and in
        batches (session 15, docs/performance.md section 7)."""
        return self.window + 2 if self.fixed_span is None else self.fixed_span

    def layout(self, state: SpeculatingRequest) -> tuple[Layout, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward for this step: (layout, input ids, positions, attention mask [T, cached + T])."""
        mb, f, be = state.model_block, state.frontier, state.block_end
        c0 = min(state.cache.length, f - 1) if state.cache is not None else 0
        stop = min(be, f + self.window)
        known = state.committed[f:stop] | (self.drafts[f:stop] != self.mask_id)
        ce = f + int(known.long().cumprod(0).sum())
        fed = torch.where(state.committed[c0:ce], state.tokens[c0:ce], self.drafts[c0:ce])
        clean_pos = torch.arange(c0, ce)
        # the noisy copy starts at the frontier: the verified tokens before it are read from their clean keys
        # (training showed the noisy block its committed tokens in-block; on the test suite reading them from
        # the cache instead saves most of the block's rows for a small loss in accepted drafts). It ends at
        # ``span`` rows, running on into the next model block when the frontier is near a block's end (the
        # clean stream is causal, so nothing needs the block to be finished first); span 0: the rest of the
        # model block. docs/performance.md section 7 has the measured trade-offs.
        ns = f
        ne = (f // mb + 1) * mb if self.span == 0 else min(len(state.tokens), ns + self.span)
        noisy_pos = torch.arange(ns, ne)
        # the clean copy predicts the frontier and every fed position after it (not past the answer's end, which is
        # a speculating state's block end)
        verify = torch.arange(f, min(ce, be - 1) + 1)
        de = min(be, ne + 1)
        later = torch.arange(f + 1, de)
        drafts = later[~state.committed[f + 1 : de]]
        keys = torch.arange(0, ce)
        n_clean, n_noisy = ce - c0, ne - ns
        mask = torch.cat([
            torch.cat([keys[None, :] <= clean_pos[:, None], torch.zeros(n_clean, n_noisy, dtype=torch.bool)], 1),
            torch.cat([(keys < ns)[None, :].expand(n_noisy, -1), torch.ones(n_noisy, n_noisy, dtype=torch.bool)], 1),
        ])
        ids = torch.cat([fed, state.tokens[ns:ne]])
        positions = torch.cat([clean_pos, noisy_pos])
        return Layout(c0, fed, verify, drafts, ns), ids, positions, mask

    @staticmethod
    def logit_rows(lay: Layout) -> torch.Tensor:
        """Rows whose outputs are read: the clean rows before each verified position, then the noisy rows
        before each drafted one (token shift: row p - 1 predicts p)."""
        clean_rows = lay.verify_positions - 1 - lay.clean_start
        noisy_rows = lay.fed.numel() + lay.draft_positions - 1 - lay.noisy_start
        return torch.cat([clean_rows, noisy_rows])

    def apply(self, state: SpeculatingRequest, lay: Layout, logits: torch.Tensor, tokenizer: Tokenizer) -> torch.Tensor:
        """Verify and commit from the frontier, store new drafts; returns the positions committed.

        Only the committed positions draw from the request's generator, one draw each, in order, so a seeded
        answer does not depend on the draft window (or on what else shares the forward). Drafts are greedy:
        they are proposals, and verification makes the answer the same whatever they are. With
        ``accept_ratio`` < 1 (greedy requests only) it does depend on them, which is why such a request keeps
        a fixed window whatever the load (``for_request``)."""
        params, constraint = state.params, state.constraint
        logits[:, self.mask_id] = float("-inf")
        n_verify = lay.verify_positions.numel()
        verify_logits, draft_logits = logits[:n_verify], logits[n_verify:]
        # penalties count the answer's tokens before each verified position, as one-at-a-time decoding would
        counts = state.answer_counts(state.frontier, logits.shape[-1]) if params.adjusts_logits else None
        plain_greedy = params.temperature == 0 and constraint is None and counts is None
        greedy = verify_logits.argmax(-1) if plain_greedy else None
        stop_on_end = not params.ignore_eos
        ends = set(state.end_ids.tolist())
        c0, ce = lay.clean_start, lay.clean_end
        lossy = params.accept_ratio < 1.0 and params.temperature == 0
        committed: list[int] = []
        for i, pos in enumerate(lay.verify_positions.tolist()):
            if not bool(state.committed[pos]):
                draft = int(lay.fed[pos - c0]) if lossy and pos < ce else None
                row = verify_logits[i : i + 1]
                if counts is not None:
                    row = adjust_logits(row.clone(), params, counts)
                if constraint is None and params.temperature == 0:
                    top = int(greedy[i]) if greedy is not None else int(row[0].argmax())
                    tok = _near_top(row[0], top, draft, params.accept_ratio, ends, stop_on_end)
                elif constraint is None:
                    tok = int(sample_tokens(row, params, state.generator)[0][0])
                else:
                    at = torch.tensor([pos])
                    row = constraint.mask_logits(state, at, row.clone())
                    if lossy:  # greedy under a constraint: the draft must also be allowed there (finite logit)
                        best = int(row[0].argmax())
                        pick = torch.tensor([_near_top(row[0], best, draft, params.accept_ratio, ends, stop_on_end)])
                    else:
                        pick = sample_tokens(row, params, state.generator)[0]
                    if not bool(constraint.allow_commits(state, at, pick, torch.ones(1, dtype=torch.bool))[0]):
                        break
                    tok = int(pick[0])
                state.tokens[pos] = tok
                state.committed[pos] = True
                committed.append(pos)
                if counts is not None:
                    counts[tok] += 1
                # stop where one-token-at-a-time decoding would: at an end token, when the constraint is
                # satisfied, or once a stop string has appeared
                if stop_on_end and tok in ends:
                    break
                if constraint is not None and constraint.finished(state):
                    break
                if params.stop and _stop_seen(state, pos, tokenizer):
                    break
            elif counts is not None:  # a pinned token the walk passes
                counts[int(state.tokens[pos])] += 1
            # the next clean output was computed from what was fed here: usable only if that is what stands
            if pos >= ce or int(lay.fed[pos - c0]) != int(state.tokens[pos]):
                break
        if lay.draft_positions.numel():
            self.drafts[lay.draft_positions] = draft_logits.argmax(-1)
        return torch.tensor(committed, dtype=torch.long)


def _near_top(row: torch.Tensor, top: int, draft: int | None, ratio: float, ends: set[int], stop_on_end: bool) -> int:
    """Lossy acceptance: the fed draft if its logit is within log(ratio) of the top token's, else the top token.
    A top end token is kept: a draft must not overrule the model's decision to stop."""
    if draft is None or draft == top or (stop_on_end and top in ends) or not bool(torch.isfinite(row[draft])):
        return top
    return draft if float(row[draft] - row[top]) >= math.log(ratio) else top


def _stop_seen(state: SpeculatingRequest, pos: int, tokenizer: Tokenizer) -> bool:
    text = tokenizer.decode(state.tokens[state.prompt_len : pos + 1].tolist())
    return any(stop in text for stop in state.params.stop)
