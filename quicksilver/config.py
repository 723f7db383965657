"""Model configuration: one dataclass that is written to and read from ``config.json``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

AttentionMode = Literal["bidirectional", "block_causal", "causal"]
ATTENTION_MODES: tuple[str, ...] = ("bidirectional", "block_causal", "causal")


class ConfigError(ValueError):
    """A config file is missing, malformed, or has fields we do not understand."""


@dataclass
class ModelConfig:
    """Architecture of the one transformer in :mod:`quicksilver.model`.

    Field names follow Hugging Face LLaMA/Qwen configs so that real checkpoints translate with little
    code; the Quicksilver-specific fields (attention_mode, block_size, token_shift, special ids) say how
    the model is decoded.
    """

    vocab_size: int
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int | None = None
    intermediate_size: int = 688
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v projection biases (Qwen2 / Dream)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3 / SDAR)
    # mixture of experts (LLaDA2); 0 experts means a dense SwiGLU MLP everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_layers: int = 0
    moe_router_score: Literal["softmax", "sigmoid"] = "softmax"
    moe_norm_topk_prob: bool = True
    moe_routed_scaling_factor: float = 1.0
    moe_router_bias: bool = False  # expert-bias term added only for top-k selection
    # group-limited routing (LLaDA2 / DeepSeek-V3): experts split into moe_n_group groups, a token may only use
    # experts of its moe_topk_group best groups (a group's score = sum of its two best biased expert scores)
    moe_n_group: int = 1
    moe_topk_group: int = 1
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of each head only (LLaDA2)
    # how the model is decoded
    attention_mode: AttentionMode = "block_causal"
    block_size: int = 16
    token_shift: bool = False  # logits at position i predict token i+1 (Dream, Fast-dLLM v2, AR)
    # block_causal only: finished blocks attend causally among themselves, only the block being decoded is
    # bidirectional ("context-causal", as in Efficient-DLM/NBDiff): the cached context is what an AR model computes
    causal_context: bool = False
    mask_token_id: int = 0
    # a pointer over the context (quicksilver.model.CopyHead): the output mixes the vocabulary distribution with
    # copies of tokens the position can see. Our own models only; no real checkpoint family has one
    copy_head: bool = False
    # the copy head also has induction pointers: each points at a key and copies the token after it (the
    # continuation of a value it is copying)
    copy_head_induction: bool = False
    # block_causal with causal_context only: the noisy rows (drafts) run through layers of their own (a draft tower,
    # reading the shared layers' keys of the clean rows), so the clean causal stream is computed by the shared
    # layers alone: drafts trained with those frozen leave a self-speculative decoder's answers as they were
    draft_layers: bool = False
    eos_token_id: int = 1
    pad_token_id: int = 2
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end a response
    torch_dtype: str = "bfloat16"
    model_type: str = "quicksilver"
    family: str = "quicksilver"

    def __post_init__(self) -> None:
        if self.attention_mode not in ATTENTION_MODES:
            raise ConfigError(f"attention_mode must be one of {ATTENTION_MODES}, got {self.attention_mode!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError("hidden_size must be divisible by num_attention_heads")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ConfigError("partial_rotary_factor must be in (0, 1]")
        groups_ok = self.num_experts % self.moe_n_group == 0 and 1 <= self.moe_topk_group <= self.moe_n_group
        if self.num_experts and not groups_ok:
            raise ConfigError("num_experts must split into moe_n_group groups and 1 <= moe_topk_group <= moe_n_group")
        if self.causal_context and self.attention_mode != "block_causal":
            raise ConfigError("causal_context applies to block_causal models only")
        if self.attention_mode == "causal" and not self.token_shift:
            raise ConfigError("a causal (autoregressive) model must have token_shift=true")
        if self.copy_head_induction and not self.copy_head:
            raise ConfigError("copy_head_induction needs copy_head")
        if self.draft_layers and not (self.attention_mode == "block_causal" and self.causal_context):
            raise ConfigError("draft_layers needs a block_causal model with causal_context (a clean causal stream)")

    @property
    def end_token_ids(self) -> list[int]:
        """Token ids whose commit ends a response."""
        return sorted({self.eos_token_id, self.pad_token_id, *self.stop_token_ids})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown config keys {unknown}")
        if "vocab_size" not in data:
            raise ConfigError(f"{source}: missing required key 'vocab_size'")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: file not found")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(data, source=str(path))
