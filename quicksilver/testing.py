"""Tiny random models and tokenizers for tests and examples (built in memory, seconds on a CPU)."""

from __future__ import annotations

import re
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from quicksilver.checkpoint import save_pretrained
from quicksilver.config import ModelConfig
from quicksilver.model import Transformer
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer, train_bpe

_TEXT = (
    "The quick brown fox jumps over the lazy dog. Diffusion models denoise a canvas of masks. "
    "def add(a, b):\n    return a + b\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}} "
    "0123456789 + - * / = ( ) [ ] , . : ; ? ! yes no true false null"
)


@lru_cache(maxsize=1)
def tiny_tokenizer() -> Tokenizer:
    """A 320-token byte-level BPE with Quicksilver's special tokens."""
    return train_bpe([_TEXT] * 20, vocab_size=320)


def tiny_config(mode: str = "block_causal", **overrides) -> ModelConfig:
    tok = tiny_tokenizer()
    kwargs = dict(
        vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, attention_mode=mode, block_size=8,
        token_shift=mode == "causal", mask_token_id=tok.mask_id, eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id, max_position_embeddings=1024,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def tiny_model(
    mode: str = "block_causal", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(mode, **overrides)).to(dtype).eval()


def save_tiny_model(folder: str | Path, mode: str = "block_causal", seed: int = 0, **overrides) -> Path:
    """Write a tiny random model folder (bf16) in Quicksilver layout; returns the folder."""
    model = tiny_model(mode, seed, **overrides)
    return save_pretrained(folder, model, tiny_tokenizer(), SamplingParams(max_tokens=32))


class HashEmbedder:
    """Fast stand-in for MiniLM in index/RAG tests: hashed bag of words, L2-normalised (word overlap = similarity,
    no model to load)."""

    name = "test-hash"
    dim = 64

    def embed(self, texts):
        single = isinstance(texts, str)
        rows = []
        for t in [texts] if single else texts:
            v = np.zeros(self.dim, np.float32)
            for w in re.findall(r"\w+", t.lower()):
                v[zlib.crc32(w.encode()) % self.dim] += 1
            rows.append(v / (np.linalg.norm(v) or 1))
        out = np.stack(rows) if rows else np.zeros((0, self.dim), np.float32)
        return out[0] if single else out
