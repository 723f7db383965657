"""The decode loop and its pluggable policies."""

from quicksilver.decoding.constraints import Constraint
from quicksilver.decoding.denoise import DEFAULT_PREFILL_CHUNK, Decoder, DecodeState, DecodeStats, GenerationResult
from quicksilver.decoding.prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixCache

__all__ = [
    "DEFAULT_PREFILL_CHUNK", "DEFAULT_PREFIX_CACHE_MB", "Constraint", "DecodeState", "DecodeStats", "Decoder",
    "GenerationResult", "PrefixCache",
]
