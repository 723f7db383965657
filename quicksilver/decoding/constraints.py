"""Constraint hooks for the decode loop.

A constraint can pin tokens on the canvas before decoding (a JSON skeleton: braces, keys and
punctuation fixed, value slots left masked), restrict which tokens each masked position may take, and
veto commits (for left-to-right grammar gating). The loop calls these hooks; it knows nothing of JSON.
"""

from __future__ import annotations

import torch

from quicksilver.decoding.request_view import RequestView


class Constraint:
    """Base class: no constraint. Subclasses override what they need."""

    def pinned_tokens(self, state: RequestView) -> dict[int, int]:
        """Canvas positions (absolute) to fix before decoding, as {position: token id}."""
        return {}

    def mask_logits(self, state: RequestView, positions: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Return logits [n, V] for canvas ``positions`` with forbidden tokens set to -inf."""
        return logits

    def allow_commits(
        self, state: RequestView, positions: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """Filter the policy's choice ``keep`` [n]; must leave at least one True if any was True."""
        return keep

    def filler_token_ids(self) -> frozenset[int]:
        """Ids that pad a value slot on the canvas: dropped from the text and not counted as output tokens."""
        return frozenset()

    def finished(self, state: RequestView) -> bool:
        """True once the constraint considers the answer complete (e.g. the skeleton is filled)."""
        return False
