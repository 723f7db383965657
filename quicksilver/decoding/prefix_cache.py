"""Prefix cache shared across requests: the keys and values of prompt prefixes that earlier requests computed.

Chat turns, agent steps and tool-calling requests resend the same system prompt, tool list and conversation
every time. With an exact cache (block-causal and causal models) a position's keys and values depend only on
the tokens up to it (and, without a causal context, on the rest of its model block), so a request whose
prompt starts with the same tokens can copy them instead of recomputing them.

Entries are chunks of ``chunk`` tokens (a model block for block-causal models, so a chunk's keys never depend
on tokens outside the matched prefix). Each chunk is keyed by a digest of every token before and in it
(vLLM's hash chain), so a chunk matches only after the same whole prefix. A finished request inserts the chunks
its own cache holds (prompt and answer: the next turn's prompt contains this turn's answer); a new request
copies the longest run of matching chunks from the start of its prompt. Least recently used chunks are evicted
first, and a chunk is always touched after the chunks it extends, so the tail of a prefix goes before its head.

Copied keys are the numbers an earlier forward computed. In fp32 they equal a fresh prefill up to rounding;
in bf16 a near-tie can round the other way, as with the per-request cache itself (docs/performance.md).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict

import torch

from quicksilver.config import ModelConfig
from quicksilver.decoding.kv_cache import KVCache

_ROOT = b"quicksilver-prefix"

# what a server gives the cache unless told otherwise: ~85k tokens of the shipped default (3 KB of keys a token)
DEFAULT_PREFIX_CACHE_MB = 256.0
CAUSAL_CHUNK = 32  # chunk of a causal model (any length is exact there): a block-causal default's block


def supports_prefix_cache(cfg: ModelConfig) -> bool:
    """Exact reuse needs keys that never change once written: block-causal and causal models."""
    return cfg.attention_mode in ("block_causal", "causal")


class PrefixCache:
    """Chunks of cached keys and values, keyed by the whole prefix they end, evicted least recently used."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_bytes: int, chunk: int | None = None):
        if not supports_prefix_cache(cfg):
            raise ValueError(f"a {cfg.attention_mode} model has no exact cache to share between requests")
        self.chunk = chunk or (cfg.block_size if cfg.attention_mode == "block_causal" else CAUSAL_CHUNK)
        if cfg.attention_mode == "block_causal" and self.chunk % cfg.block_size:
            raise ValueError(f"prefix cache chunks must be whole model blocks ({cfg.block_size} tokens)")
        self.dtype = dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.chunk_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * self.chunk * cfg.head_dim * itemsize
        self.max_chunks = max_bytes // self.chunk_bytes
        self._chunks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # digest -> [2, layers, heads, chunk, dim]
        self._lock = threading.Lock()  # the engine decodes on a worker thread

    @staticmethod
    def check_size(megabytes: float) -> None:
        """Raise ValueError unless ``megabytes`` is a usable size (a finite number >= 0; 0 turns the cache off)."""
        if not math.isfinite(megabytes) or megabytes < 0:
            raise ValueError(f"the prefix cache size must be a number of MB >= 0 (0: off), got {megabytes:g}")

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype: torch.dtype, megabytes: float) -> PrefixCache | None:
        """The cache a server gets for ``megabytes`` of memory; None when off (0, or less than one chunk) or when
        the model cannot share keys."""
        cls.check_size(megabytes)
        if megabytes == 0 or not supports_prefix_cache(cfg):
            return None
        cache = cls(cfg, dtype, int(megabytes * 2**20))
        return cache if cache.max_chunks else None

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def cached_tokens(self) -> int:
        return len(self._chunks) * self.chunk

    def _digests(self, ids: torch.Tensor) -> list[bytes]:
        """Digest of every whole chunk of ``ids``, each covering all tokens up to its end."""
        raw = ids.to(torch.int64).numpy().tobytes()
        step = self.chunk * 8
        out, prev = [], _ROOT
        for i in range(len(ids) // self.chunk):
            prev = hashlib.blake2b(prev + raw[i * step : (i + 1) * step], digest_size=16).digest()
            out.append(prev)
        return out

    def restore(self, ids: torch.Tensor, cache: KVCache) -> int:
        """Copy into the empty ``cache`` the keys of the longest cached run of whole chunks that starts ``ids``;
        returns its length in tokens."""
        if cache.length:
            raise ValueError("a prefix can only be restored into an empty cache")
        self._check_dtype(cache)
        digests = self._digests(ids)
        with self._lock:
            found: list[torch.Tensor] = []
            for d in digests:
                kv = self._chunks.get(d)
                if kv is None:
                    break
                found.append(kv)
            for d in reversed(digests[: len(found)]):  # the head of a prefix stays longer than its tail
                self._chunks.move_to_end(d)
        if not found:
            return 0
        kv = torch.cat(found, dim=3)  # [2, layers, heads, n, dim]
        n = kv.shape[3]
        cache.write(0, [(kv[0, i][None], kv[1, i][None]) for i in range(kv.shape[1])], slice(0, n))
        return n

    def insert(self, ids: torch.Tensor, cache: KVCache) -> int:
        """Offer the whole chunks of a cache holding the keys of ``ids`` (positions 0..cache.length-1); returns
        how many chunks were new."""
        self._check_dtype(cache)
        n = min(cache.length, len(ids))
        digests = self._digests(ids[:n])
        if not digests or self.max_chunks == 0:
            return 0
        layers = cache.view(len(digests) * self.chunk)
        added = 0
        with self._lock:
            for i, d in enumerate(digests):
                if d not in self._chunks:
                    sl = slice(i * self.chunk, (i + 1) * self.chunk)
                    self._chunks[d] = torch.stack([torch.cat([k[:, :, sl] for k, _ in layers]),
                                                   torch.cat([v[:, :, sl] for _, v in layers])])
                    added += 1
            for d in reversed(digests):  # the head of a prefix stays longer than its tail
                self._chunks.move_to_end(d)
            while len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)
        return added

    def _check_dtype(self, cache: KVCache) -> None:
        if cache.dtype != self.dtype:
            raise ValueError(f"this prefix cache holds {self.dtype} keys, the request's cache {cache.dtype}")
