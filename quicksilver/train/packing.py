"""Turn Samples into fixed-length training rows.

A row holds several segments (one per Sample) back to back; each segment restarts its positions at 0 and
attends only to itself, so packing wastes no compute on padding and a segment looks exactly like one
decode request (prompt at positions 0..P-1, answer after it, blocks at absolute positions).

Segment layout: ``prompt | response (ends with EOS) | rainbow pads up to the next block boundary``.
Why these pads: a block-causal decoder fills whole blocks, so the block that holds EOS also has positions
after it that the model must predict before EOS is committed. Filling them with EOS (LLaDA) makes EOS
the most likely token at every late position and the model stops early ("EOS overflow"); cycling
distinct ``<|pad_i|>`` tokens (Rainbow Padding) spreads that mass so EOS itself keeps a sharp, content-
driven position. Only the rest of the block is padded (at most block_size - 1 tokens), since later blocks
are never decoded once EOS is out. The shipped configs list the pad ids as stop tokens.

Regions (per token): PROMPT (clean context, never noised or scored), RESPONSE (noised/scored), PAD
(rainbow pads after EOS; noised/scored with the recipe's pad weight), FILLER (end of row, ignored).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

PROMPT, RESPONSE, PAD, FILLER = 0, 1, 2, 3


@dataclass
class Batch:
    ids: torch.Tensor  # [B, L] token ids (clean)
    positions: torch.Tensor  # [B, L] position inside the token's segment
    doc: torch.Tensor  # [B, L] segment index inside the row (filler has its own)
    region: torch.Tensor  # [B, L] PROMPT / RESPONSE / PAD / FILLER
    samples: int  # Samples packed into this batch

    @property
    def tokens(self) -> int:
        return self.ids.numel()

    def to(self, device: torch.device) -> Batch:
        return Batch(self.ids.to(device), self.positions.to(device), self.doc.to(device), self.region.to(device),
                     self.samples)

    def same_doc(self) -> torch.Tensor:
        """[B, L, L] True where query and key are in the same segment."""
        return self.doc.unsqueeze(-1) == self.doc.unsqueeze(-2)


def build_segment(
    prompt_ids: list[int], response_ids: list[int], eos_id: int, pad_ids: list[int], block_size: int, max_len: int
) -> tuple[list[int], list[int]] | None:
    """(ids, regions) of one Sample, or None when its prompt leaves no room for an answer."""
    if not response_ids or len(prompt_ids) >= max_len - 1:
        return None
    ids = list(prompt_ids) + list(response_ids)
    region = [PROMPT] * len(prompt_ids) + [RESPONSE] * len(response_ids)
    if response_ids[-1] == eos_id and pad_ids:
        n = (-len(ids)) % block_size
        ids += [pad_ids[i % len(pad_ids)] for i in range(n)]
        region += [PAD] * n
    return ids[:max_len], region[:max_len]


class RowPacker:
    """Packs a deterministic Sample stream into batches of rows; ``position`` = next Sample index.

    A Sample that does not fit in the last row of a batch is not consumed: it opens the next batch, and
    after a resume the stream is restarted at ``position`` and yields the same Sample again.
    """

    def __init__(
        self,
        stream_factory: Callable[[int], Iterator[Any]],
        start: int,
        seq_len: int,
        rows: int,
        eos_id: int,
        pad_ids: list[int],
        filler_id: int,
        block_size: int,
    ):
        self.stream_factory = stream_factory
        self.position = start
        self.seq_len, self.rows = seq_len, rows
        self.eos_id, self.pad_ids, self.filler_id, self.block_size = eos_id, pad_ids, filler_id, block_size
        self._stream: Iterator[Any] | None = None
        self._pending: tuple[list[int], list[int]] | None = None
        self.skipped = 0

    def _next_segment(self) -> tuple[list[int], list[int]]:
        if self._pending is not None:
            return self._pending
        if self._stream is None:
            self._stream = iter(self.stream_factory(self.position))
        while True:
            sample = next(self._stream)
            seg = build_segment(sample.prompt_ids, sample.response_ids, self.eos_id, self.pad_ids,
                                self.block_size, self.seq_len)
            if seg is not None:
                self._pending = seg
                return seg
            self.position += 1  # unusable sample: skip it for good
            self.skipped += 1

    def next_batch(self) -> Batch:
        L = self.seq_len
        ids = torch.full((self.rows, L), self.filler_id, dtype=torch.long)
        pos = torch.zeros((self.rows, L), dtype=torch.long)
        doc = torch.zeros((self.rows, L), dtype=torch.long)
        region = torch.full((self.rows, L), FILLER, dtype=torch.long)
        samples = 0
        for r in range(self.rows):
            used, n_doc = 0, 0
            while True:
                seg_ids, seg_region = self._next_segment()
                n = len(seg_ids)
                if used + n > L and used > 0:
                    break
                ids[r, used : used + n] = torch.tensor(seg_ids)
                region[r, used : used + n] = torch.tensor(seg_region)
                pos[r, used : used + n] = torch.arange(n)
                doc[r, used : used + n] = n_doc
                used += n
                n_doc += 1
                samples += 1
                self._pending = None
                self.position += 1
                if used >= L:
                    break
            if used < L:  # filler is one more segment that attends only to itself
                doc[r, used:] = n_doc
                pos[r, used:] = torch.arange(L - used)
        return Batch(ids, pos, doc, region, samples)
