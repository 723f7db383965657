"""Per-sequence key/value cache.

Keys and values of positions ``0..length-1`` for every layer, in preallocated buffers that grow by
doubling, so appending a finished block is a copy into place rather than a re-allocation per step.

* exact cache (``block_causal`` and ``causal`` models): only finished blocks are stored, and their keys
  and values never change, so cached decoding equals uncached decoding.
* approximate caches (``bidirectional`` models, Fast-dLLM style): the whole prefix (and for the dual
  cache, the masked suffix too) is recomputed at each block start and reused, slightly stale, for the
  other steps of that block.
"""

from __future__ import annotations

import torch

from quicksilver.model import KV


class KVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity: int = 256,
        device: torch.device | str | None = None,  # the model's device (None: the CPU)
    ):
        self.num_layers = num_layers
        self.shape = (kv_heads, head_dim)
        self.dtype = dtype
        self.device = torch.device(device or "cpu")
        self.length = 0
        self._k = [self._empty(capacity) for _ in range(num_layers)]
        self._v = [self._empty(capacity) for _ in range(num_layers)]

    def _empty(self, capacity: int) -> torch.Tensor:
        # always a normal tensor, also when the cache grows during a step (in inference mode): a compiled forward
        # guards on whether its inputs are inference tensors, and one kind of past keeps one graph per shape
        with torch.inference_mode(False):
            return torch.empty(1, self.shape[0], capacity, self.shape[1], dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self._k[0].shape[2]

    def _grow(self, needed: int) -> None:
        cap = self.capacity
        while cap < needed:
            cap *= 2
        for i in range(self.num_layers):
            for buf in (self._k, self._v):
                new = self._empty(cap)
                new[:, :, : self.length] = buf[i][:, :, : self.length]
                buf[i] = new

    def write(self, start: int, new_kv: list[KV], rows: slice) -> None:
        """Write rows ``rows`` of each layer's new (k, v) [1, H, T, D] at positions start.. ."""
        n = rows.stop - rows.start
        if n <= 0:
            return
        end = start + n
        if start > self.length:
            raise ValueError("KV cache writes must be contiguous")
        if end >= self.capacity:  # never full: a view of the keys then always has the same strides' layout
            self._grow(end + 1)
        for i, (k, v) in enumerate(new_kv):
            self._k[i][:, :, start:end] = k[:, :, rows]
            self._v[i][:, :, start:end] = v[:, :, rows]
        self.length = max(self.length, end)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def view(self, end: int) -> list[KV]:
        """Per-layer (k, v) of positions 0..end-1 (views, no copy)."""
        return [(k[:, :, :end], v[:, :, :end]) for k, v in zip(self._k, self._v, strict=True)]

    def view_without(self, start: int, stop: int) -> list[KV]:
        """Per-layer (k, v) of positions [0, start) followed by [stop, length) (dual cache)."""
        if stop >= self.length:
            return self.view(start)
        return [
            (torch.cat([k[:, :, :start], k[:, :, stop : self.length]], 2),
             torch.cat([v[:, :, :start], v[:, :, stop : self.length]], 2))
            for k, v in zip(self._k, self._v, strict=True)
        ]
