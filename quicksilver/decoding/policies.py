"""Pluggable decoding policies: which masked positions to commit, and which committed ones to revise.

Each unmasking policy is one small class with ``select``: given the confidence (probability of the
sampled token) and the full distribution at every candidate position, return a boolean mask of the
positions to commit this step. Every policy commits at least one position, so a block always finishes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quicksilver.sampling import SamplingParams


@dataclass
class StepContext:
    """What a policy may know about the block being decoded."""

    step_in_block: int  # 0 for the first forward of this block
    block_len: int  # positions in the unmask region


def _at_least_best(keep: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    keep = keep.clone()
    keep[score.argmax()] = True
    return keep


class UnmaskPolicy:
    name = "base"

    def select(self, conf: torch.Tensor, probs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError


class LowConfidence(UnmaskPolicy):
    """LLaDA: a fixed schedule of ``steps`` per block; each step commits the k most confident."""

    name = "low_confidence"

    def __init__(self, steps: int | None):
        self.steps = steps

    def select(self, conf, probs, ctx):
        steps = self.steps or ctx.block_len
        remaining = max(1, steps - ctx.step_in_block)
        k = min(conf.numel(), max(1, math.ceil(conf.numel() / remaining)))
        keep = torch.zeros_like(conf, dtype=torch.bool)
        keep[conf.topk(k).indices] = True
        return keep


class Threshold(UnmaskPolicy):
    """Fast-dLLM: commit every position whose confidence >= tau, and always the most confident one."""

    name = "threshold"

    def __init__(self, tau: float):
        self.tau = tau

    def select(self, conf, probs, ctx):
        return _at_least_best(conf >= self.tau, conf)


class LeftToRight(UnmaskPolicy):
    """Threshold with a semi-autoregressive fallback: commit every position whose confidence >= tau, and always
    the leftmost one. When nothing is sure the next token in reading order is committed, not a far-off guess
    (say a closing brace) that the rest of the block would then be built around; a model adapted from an AR
    model (token shift, causal context) is at its best on that left-to-right conditional."""

    name = "left_to_right"

    def __init__(self, tau: float):
        self.tau = tau

    def select(self, conf, probs, ctx):
        keep = conf >= self.tau
        keep[0] = True  # candidates come in position order
        return keep


class Factor(UnmaskPolicy):
    """Fast-dLLM factor rule: sort confidences c(1) >= c(2) >= ...; commit the largest n such that
    c(i) >= 1 - f / (i + 1) for every i <= n (Theorem 1: parallel greedy = joint greedy)."""

    name = "factor"

    def __init__(self, factor: float):
        self.factor = factor

    def select(self, conf, probs, ctx):
        sorted_conf, order = conf.sort(descending=True)
        i = torch.arange(1, conf.numel() + 1, dtype=conf.dtype)
        ok = sorted_conf >= 1 - self.factor / (i + 1)
        n = max(1, int(ok.long().cumprod(0).sum()))
        keep = torch.zeros_like(conf, dtype=torch.bool)
        keep[order[:n]] = True
        return keep


class EntropyBounded(UnmaskPolicy):
    """EB-sampler: commit the lowest-entropy positions while sum(H) - max(H) <= bound."""

    name = "entropy"

    def __init__(self, bound: float):
        self.bound = bound

    def select(self, conf, probs, ctx):
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
        sorted_h, order = entropy.sort()
        excess = sorted_h.cumsum(0) - sorted_h  # sorted ascending, so the max so far is the last one
        n = max(1, int((excess <= self.bound).sum()))
        keep = torch.zeros_like(conf, dtype=torch.bool)
        keep[order[:n]] = True
        return keep


class Margin(UnmaskPolicy):
    """Commit positions whose top-1 minus top-2 probability >= margin (always the widest one)."""

    name = "margin"

    def __init__(self, margin: float):
        self.margin = margin

    def select(self, conf, probs, ctx):
        top2 = probs.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        return _at_least_best(gap >= self.margin, gap)


def make_unmask_policy(params: SamplingParams) -> UnmaskPolicy:
    match params.policy:
        case "low_confidence":
            return LowConfidence(params.steps_per_block)
        case "threshold":
            return Threshold(params.threshold)
        case "left_to_right" | "self_speculative":  # the latter commits by verification (speculative.py)
            return LeftToRight(params.threshold)
        case "factor":
            return Factor(params.factor)
        case "entropy":
            return EntropyBounded(params.entropy_bound)
        case "margin":
            return Margin(params.margin)
    raise ValueError(f"unknown policy {params.policy!r}")


class SelfCorrection:
    """Token-to-token editing and remasking of committed tokens in the current block.

    A committed token whose probability under the latest forward drops below ``remask_threshold`` is
    masked again; one the model now confidently replaces (new choice >= ``edit_threshold``) is edited in
    place. Each revision spends one unit of a per-block budget, so decoding always terminates.
    """

    def __init__(self, remask_threshold: float | None, edit_threshold: float | None, budget: int):
        self.remask_threshold = remask_threshold
        self.edit_threshold = edit_threshold
        self.budget = budget

    @classmethod
    def from_params(cls, params: SamplingParams, block_len: int) -> SelfCorrection | None:
        if params.remask_threshold is None and params.edit_threshold is None:
            return None
        budget = params.max_remasks_per_block if params.max_remasks_per_block is not None else block_len
        return cls(params.remask_threshold, params.edit_threshold, budget)

    def revise(
        self, current: torch.Tensor, probs: torch.Tensor, used: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For committed tokens ``current`` [n] with fresh ``probs`` [n, V], return (edit, remask) masks
        and their replacement tokens are ``probs.argmax``; never more than the remaining budget."""
        left = self.budget - used
        n = current.numel()
        edit = torch.zeros(n, dtype=torch.bool)
        remask = torch.zeros(n, dtype=torch.bool)
        if left <= 0 or n == 0:
            return edit, remask
        p_current = probs.gather(-1, current.unsqueeze(-1)).squeeze(-1)
        best_p, best = probs.max(-1)
        if self.edit_threshold is not None:
            edit = (best != current) & (best_p >= self.edit_threshold)
        if self.remask_threshold is not None:
            remask = (p_current < self.remask_threshold) & ~edit
        chosen = (edit | remask).nonzero().flatten()
        if chosen.numel() > left:  # spend the budget on the least likely tokens first
            worst = p_current[chosen].argsort()[:left]
            allowed = torch.zeros(n, dtype=torch.bool)
            allowed[chosen[worst]] = True
            edit, remask = edit & allowed, remask & allowed
        return edit, remask
