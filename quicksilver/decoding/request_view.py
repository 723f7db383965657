"""What the decode loop's hooks read of a request being decoded.

:class:`~quicksilver.decoding.denoise.DecodeState` is the one implementation. Constraints and the self-speculation
see a request through these protocols, so they need not import the loop that imports them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from quicksilver.sampling import SamplingParams


class RequestView(Protocol):
    """A request's canvas as a constraint reads it."""

    params: SamplingParams
    prompt_len: int
    total: int  # end of the answer region (prompt_len + max_tokens)
    tokens: torch.Tensor  # [L] the prompt, then answer tokens and masks
    committed: torch.Tensor  # [L] bool: tokens that stand (prompt, pinned and committed answer tokens)
    fixed: torch.Tensor  # [L] bool: the prompt and pinned tokens, never sampled or revised
    end_ids: torch.Tensor  # the ids that end an answer
