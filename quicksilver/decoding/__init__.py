"""The decode loop and its pluggable policies."""

from quicksilver.decoding.constraints import Constraint
from quicksilver.decoding.denoise import Decoder, DecodeState, DecodeStats, GenerationResult

__all__ = ["Constraint", "DecodeState", "DecodeStats", "Decoder", "GenerationResult"]
