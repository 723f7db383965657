"""What every family adapter shares: reading the HF folder, the tokenizer, streaming weights, the summary line.

A family adapter is small: it turns the family's ``config.json`` into our :class:`ModelConfig`, renames (and
where needed splits) checkpoint tensors into our module names, and says how the model is decoded by default.
Loading itself is common: the model is built on the meta device in the target dtype, then filled one tensor
at a time from memory-mapped safetensors shards, so peak memory is about the size of the weights.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from quicksilver.checkpoint import CheckpointError, LoadedModel, iter_safetensors, load_state_into, weight_files
from quicksilver.config import ConfigError, ModelConfig
from quicksilver.model import Transformer
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import Tokenizer, TokenizerError

Tensors = Iterable[tuple[str, torch.Tensor]]

# Qwen2 / Qwen3 pre-tokenizer split (the regex of their tokenizer.json), used when a folder only has
# vocab.json + merges.txt (Dream ships its tokenizer that way).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: file not found")
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def as_id_list(value: Any) -> list[int]:
    """generation_config / config store token ids as an int or a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise CheckpointError(f"expected a token id or a list of token ids, got {value!r}")


def _bpe_from_vocab_merges(folder: Path):
    """A Qwen-style byte-level BPE built from vocab.json + merges.txt (no tokenizer.json in the folder)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    bpe = models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    backend = HFTokenizer(bpe)
    backend.normalizer = normalizers.NFC()  # as in Qwen2's own tokenizer.json
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    return backend


def load_tokenizer(folder: Path) -> Tokenizer:
    """The family's own tokenizer: tokenizer.json (or vocab.json + merges.txt), tokenizer_config.json, and
    chat_template.jinja when the template lives in its own file (newer transformers layout)."""
    from tokenizers import AddedToken

    config = read_json(folder / "tokenizer_config.json", required=False)
    template_file = folder / "chat_template.jinja"
    if not config.get("chat_template") and template_file.is_file():
        config["chat_template"] = template_file.read_text()
    if isinstance(config.get("chat_template"), list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        config["chat_template"] = named.get("default") or next(iter(named.values()), None)
    if (folder / "tokenizer.json").is_file():
        try:
            return Tokenizer(Tokenizer.load(folder).backend, config)
        except TokenizerError as exc:
            raise CheckpointError(str(exc)) from None
    if not ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        raise CheckpointError(f"{folder}: no tokenizer.json (nor vocab.json + merges.txt)")
    try:
        backend = _bpe_from_vocab_merges(folder)
    except Exception as exc:  # tokenizers raises bare Exceptions on malformed files
        raise CheckpointError(f"{folder}: cannot build the tokenizer from vocab.json/merges.txt ({exc})") from None
    # added / special tokens keep the ids the checkpoint was trained with
    decoder = config.get("added_tokens_decoder") or {
        str(i): {"content": t, "special": True}  # older layout: added_tokens.json maps text -> id
        for t, i in read_json(folder / "added_tokens.json", required=False).items()
    }
    added = sorted(((int(i), t) for i, t in decoder.items()), key=lambda item: item[0])
    for token_id, tok in added:
        content = tok["content"] if isinstance(tok, dict) else str(tok)
        special = bool(tok.get("special", True)) if isinstance(tok, dict) else True
        if backend.token_to_id(content) is None:
            if backend.get_vocab_size(with_added_tokens=True) != token_id:
                raise CheckpointError(
                    f"{folder / 'tokenizer_config.json'}: added token {content!r} has id {token_id}, but the "
                    f"vocabulary would give it {backend.get_vocab_size(with_added_tokens=True)}"
                )
            token = AddedToken(content, special=special, normalized=False)
            if special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])
    return Tokenizer(backend, config)


def token_id(tokenizer: Tokenizer, text: str | None) -> int | None:
    return None if text is None else tokenizer.token_id(text)


class Family:
    """One family of checkpoints. Subclasses set the class attributes and implement the three hooks."""

    name: str = ""
    model_types: tuple[str, ...] = ()  # config.json model_type values (compared case-insensitively)
    description: str = ""

    # -- hooks ------------------------------------------------------------------------------------------
    def translate(self, hf: dict[str, Any], gen: dict[str, Any], tok: Tokenizer, source: str) -> dict[str, Any]:
        """ModelConfig fields from config.json (``hf``), generation_config.json (``gen``) and the tokenizer."""
        raise NotImplementedError

    def map_tensor(self, key: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        """Our (name, tensor) pairs for one checkpoint tensor; [] for tensors we deliberately ignore; an
        unknown name is returned unchanged so the strict loader reports it."""
        raise NotImplementedError

    def defaults(self, cfg: ModelConfig) -> SamplingParams:
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------------------
    def model_config(self, folder: Path) -> tuple[ModelConfig, Tokenizer]:
        hf = read_json(folder / "config.json")
        gen = read_json(folder / "generation_config.json", required=False)
        tok = load_tokenizer(folder)
        source = str(folder / "config.json")
        fields = self.translate(hf, gen, tok, source)
        fields.setdefault("model_type", "quicksilver")
        fields["family"] = self.name
        try:
            return ModelConfig(**fields), tok
        except (ConfigError, TypeError) as exc:
            raise CheckpointError(f"{source}: {exc}") from None

    def tensors(self, folder: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in iter_safetensors(weight_files(folder)):
            yield from self.map_tensor(key, tensor, cfg)

    def load(self, folder: Path, dtype: torch.dtype | None = None, quiet: bool = False) -> LoadedModel:
        cfg, tok = self.model_config(folder)
        dtype = dtype or torch.bfloat16
        cfg.torch_dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype]
        # meta -> dtype -> empty: memory is allocated once, directly in the target dtype
        with torch.device("meta"):
            model = Transformer(cfg)
        model = model.to(dtype).to_empty(device="cpu")
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        load_state_into(model, self.tensors(folder, cfg), str(folder), dtype)
        model.eval()
        loaded = LoadedModel(model, tok, self.defaults(cfg), folder, folder.name)
        if not quiet:
            print(summary_line(loaded), file=sys.stderr)
        return loaded


def summary_line(loaded: LoadedModel) -> str:
    """One line saying what was loaded (family, parameters, dtype, attention)."""
    cfg = loaded.model.config
    n = loaded.model.num_parameters()
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"
    attn = cfg.attention_mode + (f" (block {cfg.block_size})" if cfg.attention_mode == "block_causal" else "")
    extras = [f"mask id {cfg.mask_token_id}", f"end ids {cfg.end_token_ids}"]
    if cfg.token_shift:
        extras.append("token shift")
    if cfg.num_experts:
        extras.append(f"MoE {cfg.num_experts} experts top-{cfg.num_experts_per_tok}")
    return (f"loaded {cfg.family} model {loaded.name}: {size} parameters, {cfg.torch_dtype}, {attn} attention; "
            + ", ".join(extras))


def llama_layout_key(key: str) -> str:
    """HF LLaMA/Qwen names (``model.layers.N...``) -> ours (``layers.N...``); the names below are identical."""
    if key.startswith("model."):
        return key[len("model."):]
    return key


def need(hf: dict[str, Any], key: str, source: str) -> Any:
    if key not in hf or hf[key] is None:
        raise CheckpointError(f"{source}: missing required key {key!r}")
    return hf[key]


def reject(condition: bool, source: str, what: str) -> None:
    if condition:
        raise CheckpointError(f"{source}: unsupported architecture: {what}")


def end_ids(tok: Tokenizer, gen: dict[str, Any], hf: dict[str, Any], extra_tokens: tuple[str, ...] = ()) -> list[int]:
    """Every id that ends a response: generation_config/config eos ids plus the family's end-of-turn tokens."""
    ids = as_id_list(gen.get("eos_token_id")) or as_id_list(hf.get("eos_token_id"))
    for text in extra_tokens:
        tid = tok.token_id(text)
        if tid is not None:
            ids.append(tid)
    return list(dict.fromkeys(ids))


def resolve_mask_id(hf: dict[str, Any], tok: Tokenizer, texts: tuple[str, ...], fallback: int | None,
                    source: str) -> int:
    """Mask id: config.json's mask_token_id, else the tokenizer's mask token, else the family's known id."""
    if isinstance(hf.get("mask_token_id"), int):
        return hf["mask_token_id"]
    named = tok.config.get("mask_token")
    candidates = ([named.get("content") if isinstance(named, dict) else named] if named else []) + list(texts)
    for text in candidates:
        tid = token_id(tok, text)
        if tid is not None:
            return tid
    if fallback is None:
        raise CheckpointError(f"{source}: cannot find the mask token id (no mask_token_id, no mask token)")
    return fallback


def check_rope_scaling(hf: dict[str, Any], source: str) -> None:
    scaling = hf.get("rope_scaling")
    reject(scaling not in (None, {}), source, f"rope_scaling {scaling!r} (only plain RoPE is implemented)")
