"""Quicksilver: diffusion language models with block-wise parallel decoding."""

from quicksilver.config import ModelConfig
from quicksilver.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["ModelConfig", "SamplingParams", "__version__"]
