"""Training recipes: a YAML file validated by pydantic (unknown keys are errors, not silently ignored)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from quicksilver.sampling import PolicyName


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    """Architecture; vocab size, special ids and attention mode come from tokenizer/objective (token shift too,
    except that the block objective may opt in)."""

    hidden_size: int = Field(256, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(688, gt=0)
    block_size: int = Field(32, gt=0)
    max_position_embeddings: int = Field(2048, gt=0)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    qk_norm: bool = False
    # block objective only: hidden i predicts token i + 1, as in an AR model (Fast-dLLM v2 / SDAR style), so a
    # block-diffusion model can start from an AR model's weights and keep its output alignment
    token_shift: bool = False
    # block objective only: finished blocks attend causally (the clean stream is an AR model), see objectives.py
    causal_context: bool = False
    # a pointer over the context mixed into the output (quicksilver.model.CopyHead): lets a small model copy
    # names and numbers from its prompt. Weights without one can be extended (--init-from)
    copy_head: bool = False
    # with copy_head: induction pointers too, which copy the token after the one they point at
    copy_head_induction: bool = False
    # block objective with causal_context: the noisy rows run through layers of their own (a draft tower); weights
    # without one can be extended (--init-from: the tower starts as a copy of the shared layers)
    draft_layers: bool = False


class DataSpec(_Strict):
    source: Literal["corpus", "synthetic"] = "corpus"  # quicksilver.data.training_stream or toy tasks
    vocab_size: int = Field(4096, gt=0)  # BPE size when the tokenizer is built
    tokenizer: str | None = None  # tokenizer folder to use (built and saved there when missing)
    seed: int = 0
    mix: dict[str, float] | None = None  # passed to training_stream
    samples: str | None = None  # JSON-lines samples file that the mixture's "samples" entry draws from
    seq_len: int = Field(256, gt=8)
    pad_weight: float = Field(1.0, ge=0)


class TrainSpec(_Strict):
    batch_size: int = Field(8, gt=0)  # rows per micro-batch per process
    grad_accum: int = Field(1, gt=0)
    max_steps: int = Field(1000, gt=0)  # optimizer steps; also the end of the cosine schedule
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping
    bf16: bool = True  # bf16 autocast (fp32 master weights)
    threads: int | None = Field(None, gt=0)
    seed: int = 0
    t_min: float = Field(1e-3, gt=0, le=1)
    t_max: float = Field(1.0, gt=0, le=1)
    weighting: Literal["elbo", "flat"] = "elbo"
    ar_weight: float = Field(0.0, ge=0)  # block objective with causal_context: weight of the clean stream's AR loss
    draft_fraction: float = Field(0.0, ge=0, le=1)  # block objective, causal_context: blocks in the draft layout
    draft_span: int = Field(0, ge=0)  # noisy rows of a draft-layout block from its cut (0: to the block end)
    # KL from a frozen teacher (a model folder or shipped name) to the causal stream over answer tokens
    distill_weight: float = Field(0.0, ge=0)
    teacher: str | None = None
    # learning rate of a copy head's weights relative to ``lr``: a head grafted onto trained weights starts with
    # little of the output's mass, so its gradients are small while the rest is already trained
    copy_head_lr_scale: float = Field(1.0, gt=0)
    # copy head: weight of the pointers' own NLL of every scored target they could copy, whatever the gate gives
    # them (the mixture's loss alone trains pointers only as far as the gate already trusts them)
    pointer_weight: float = Field(0.0, ge=0)
    # "drafts": train only the draft tower (model.draft_layers), every shared weight frozen, so the clean
    # stream, and with it a self-speculative decoder's answers, stay exactly those of the weights started from
    trainable: Literal["all", "drafts"] = "all"
    # every linear layer that int8 serving quantises sees its weights and inputs rounded as int8 rounds them
    # (quicksilver.variants.Int8AwareLinear, straight-through gradients): weights that lose less in int8
    int8_aware: bool = False
    checkpoint_every: int = Field(100, gt=0)
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(1, gt=0)

    @model_validator(mode="after")
    def _check(self) -> TrainSpec:
        if self.t_min > self.t_max:
            raise ValueError("t_min must be <= t_max")
        if (self.distill_weight > 0) != (self.teacher is not None):
            raise ValueError("distill_weight > 0 and teacher go together")
        return self


class GenerationSpec(_Strict):
    """generation_config.json of the exported model."""

    max_tokens: int = Field(256, gt=0)
    policy: PolicyName = "threshold"
    threshold: float = Field(0.9, ge=0, le=1)


class Recipe(_Strict):
    name: str
    objective: Literal["mdlm", "block", "ar"]
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    generation: GenerationSpec = GenerationSpec()

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.model.copy_head_induction and not self.model.copy_head:
            raise ValueError("model.copy_head_induction needs model.copy_head: true")
        if self.train.trainable == "drafts":
            if not self.model.draft_layers:
                raise ValueError("train.trainable: drafts needs a draft tower (model.draft_layers: true)")
            if self.train.ar_weight or self.train.distill_weight or self.train.pointer_weight:
                raise ValueError("train.trainable: drafts trains no shared weight: ar_weight, distill_weight and "
                                 "pointer_weight must be 0")
        if self.train.pointer_weight > 0 and not self.model.copy_head:
            raise ValueError("train.pointer_weight needs a copy head (model.copy_head: true)")
        return self

    @classmethod
    def from_dict(cls, data: Any, source: str = "recipe") -> Recipe:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping at the top level")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "recipe"
            more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
            raise ValueError(f"{source}: {where}: {first['msg']}{more}") from None

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        return cls.from_dict(read_recipe_data(Path(path)), source=str(path))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``: mappings merge key by key, anything else (lists included) is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_recipe_data(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file as a mapping, with ``base: OTHER.yaml`` (relative to the file) resolved first.

    Why: a training round usually changes two or three keys of the last one; naming the base keeps a round's
    recipe to its changes instead of a copy of everything."""
    if not path.is_file():
        where = f" (base of {_chain[-1]})" if _chain else ""
        raise FileNotFoundError(f"{path}: recipe not found{where}")
    if path.resolve() in _chain:
        raise ValueError(f"{path}: recipe bases form a cycle")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ValueError(f"{path}: base: expected a recipe path, got {base!r}")
    return _merge(read_recipe_data(path.parent / base, (*_chain, path.resolve())), data)
