"""Self-speculative decoding: diffusion drafts, causal verification, both in one forward (TiDAR-style).

A block-causal model with a causal context and token shift computes, over finished tokens, exactly what a
causal language model computes: that is its clean stream in training ([x_t || x_0] with the AR loss). So
one forward can carry two copies of the block being decoded:

* the clean copy: the committed tokens followed by the previous step's drafts, attended causally. Its
  output at position p - 1 is the model's next-token distribution for p given the tokens fed before p;
* the noisy copy: the rest of the block from the frontier, masks (and any pinned tokens), attended
  bidirectionally among themselves and causally to the verified tokens. Its outputs are the next drafts.

Verification walks from the frontier. The clean copy's token for the frontier is committed; while it
equals the draft that was fed there, the clean output one position on was computed from committed tokens
only, so the walk goes on. Every committed token is thus a sample of the model's own causal conditional
(greedy: exactly its causal greedy output) whatever the drafts were. Good drafts only save forwards, and
each forward commits at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from quicksilver.config import ModelConfig
from quicksilver.sampling import SamplingParams, sample_tokens

if TYPE_CHECKING:
    from quicksilver.decoding.denoise import DecodeState


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


class SelfSpeculation:
    """Per-request draft buffer, forward layout and verification walk."""

    def __init__(self, length: int, mask_id: int, window: int = 8, span: int | None = None):
        self.mask_id = mask_id
        self.window = window  # drafts verified per forward
        # noisy rows per forward: a little past what the next step can verify (two windows); 0 = rest of block
        self.span = 2 * window + 4 if span is None else span
        self.drafts = torch.full((length,), mask_id, dtype=torch.long)

    def layout(self, state: DecodeState) -> tuple[Layout, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward for this step: (layout, input ids, positions, attention mask [T, cached + T])."""
        mb, f, be = state.model_block, state.frontier, state.block_end
        bs = f // mb * mb  # start of the model block being decoded
        c0 = min(state.cache.length, f - 1) if state.cache is not None else 0
        stop = min(be, f + self.window)
        known = state.committed[f:stop] | (self.drafts[f:stop] != self.mask_id)
        ce = f + int(known.long().cumprod(0).sum())
        fed = torch.where(state.committed[c0:ce], state.tokens[c0:ce], self.drafts[c0:ce])
        clean_pos = torch.arange(c0, ce)
        # the noisy copy starts at the frontier: the verified tokens before it are read from their clean keys
        # (training showed the noisy block its committed tokens in-block; on the test suite reading them from
        # the cache instead saves most of the block's rows for a small loss in accepted drafts). It ends at
        # ``span`` rows: docs/performance.md section 7 has the measured trade-offs.
        ns = f
        ne = bs + mb if self.span == 0 else min(bs + mb, ns + self.span)
        noisy_pos = torch.arange(ns, ne)
        # the clean copy predicts the frontier and every fed position after it (not past the block's end)
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

    def apply(self, state: DecodeState, lay: Layout, logits: torch.Tensor) -> int:
        """Verify and commit from the frontier, store new drafts; returns how many tokens were committed."""
        params, constraint = state.params, state.constraint
        logits[:, self.mask_id] = float("-inf")
        n_verify = lay.verify_positions.numel()
        verify_logits, draft_logits = logits[:n_verify], logits[n_verify:]
        if constraint is None:
            ar_tokens = sample_tokens(verify_logits, params, state.generator)[0]
        stop_on_end = not params.ignore_eos
        ends = set(state.end_ids.tolist())
        c0, ce = lay.clean_start, lay.clean_end
        committed = 0
        for i, pos in enumerate(lay.verify_positions.tolist()):
            if not bool(state.committed[pos]):
                if constraint is None:
                    tok = int(ar_tokens[i])
                else:
                    at = torch.tensor([pos])
                    row = constraint.mask_logits(state, at, verify_logits[i : i + 1].clone())
                    pick = sample_tokens(row, params, state.generator)[0]
                    if not bool(constraint.allow_commits(state, at, pick, torch.ones(1, dtype=torch.bool))[0]):
                        break
                    tok = int(pick[0])
                state.tokens[pos] = tok
                state.committed[pos] = True
                committed += 1
                if stop_on_end and tok in ends:
                    break
            # the next clean output was computed from what was fed here: usable only if that is what stands
            if pos >= ce or int(lay.fed[pos - c0]) != int(state.tokens[pos]):
                break
        if lay.draft_positions.numel():
            self.drafts[lay.draft_positions] = sample_tokens(draft_logits, params, state.generator)[0]
        return committed
