"""Which states share a batched forward.

A batched forward pads every state's input to the longest one. In continuous batching the lengths differ a
lot: a request being admitted feeds its whole prompt (hundreds of rows), a block-causal state at a block
boundary feeds two blocks, the others one block (or one token for an AR model). Padding everything to the
longest input multiplies the work of the whole batch, so states are grouped by input length and each
group gets its own forward whenever padding would waste more than ``slack`` of the group's rows.
"""

from __future__ import annotations

from collections.abc import Sequence


def group_by_length(lengths: Sequence[int], slack: float = 1.25) -> list[list[int]]:
    """Partition indices into groups whose padded size (count x longest) stays within ``slack`` x their
    real rows. Greedy over lengths sorted longest first; each index appears in exactly one group."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    rows = 0
    for i in order:
        if current:
            longest = lengths[current[0]]
            if longest * (len(current) + 1) > slack * (rows + lengths[i]):
                groups.append(current)
                current, rows = [], 0
        current.append(i)
        rows += lengths[i]
    if current:
        groups.append(current)
    return groups
