"""Tokenizer: a Hugging Face ``tokenizers`` BPE plus special tokens and a Jinja chat template.

Works for our own models (byte-level BPE trained locally) and for any Hugging Face folder that has
``tokenizer.json`` and ``tokenizer_config.json`` (the special tokens and ``chat_template`` come from the
latter, as in ``transformers``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers


class TokenizerError(ValueError):
    """A tokenizer folder is missing files or is malformed."""


# Our own special tokens, in id order (ids 0..N-1 in every Quicksilver-trained tokenizer).
MASK, EOS, PAD = "<|mask|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = {r: f"<|{r}|>" for r in ("system", "user", "assistant", "tool")}
TOOL_CALLS = "<|tool_calls|>"
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
# Distinct pad tokens after EOS ("rainbow padding") so the model does not learn that every late
# position is EOS, which otherwise makes it stop early.
RAINBOW_PADS = tuple(f"<|pad_{i}|>" for i in range(8))
SPECIAL_TOKENS: tuple[str, ...] = (
    MASK, EOS, PAD, *ROLE_TOKENS.values(), TOOL_CALLS, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, *RAINBOW_PADS,
)

# Messages: <|role|>content<|eos|>. Tools are listed as JSON in the system turn; an assistant turn
# that calls tools writes <|tool_calls|> then a JSON list of {"name", "arguments"} objects.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>"
    "{%- if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif -%}"
    "You can call these tools:\n{{ tools | tojson }}<|eos|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if not (tools and loop.first and m.role == 'system') %}"
    "<|{{ m.role }}|>"
    "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- if m.tool_calls %}<|tool_calls|>{{ m.tool_calls | tojson }}{% endif %}"
    "<|eos|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict[str, Any] | None = None):
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template: str = self.config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        self._env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        self._env.policies["json.dumps_kwargs"] = {"ensure_ascii": False, "sort_keys": False}
        self._template = self._env.from_string(self.chat_template)
        self.special_ids = {
            i for tok, i in backend.get_vocab(with_added_tokens=True).items()
            if tok in {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        }

    # -- ids of special tokens ------------------------------------------------------------------
    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _named_id(self, key: str, fallback: str | None) -> int | None:
        text = _token_text(self.config.get(key)) or fallback
        return None if text is None else self.backend.token_to_id(text)

    @property
    def mask_id(self) -> int | None:
        return self._named_id("mask_token", MASK)

    @property
    def eos_id(self) -> int | None:
        return self._named_id("eos_token", EOS)

    @property
    def pad_id(self) -> int | None:
        return self._named_id("pad_token", PAD)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- text <-> ids ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(self.config.get("bos_token")) or "",
            eos_token=_token_text(self.config.get("eos_token")) or EOS, **extra,
        )

    # -- files -----------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = {"chat_template": self.chat_template, **self.config}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path}: file not found")
        try:
            backend = HFTokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{tok_path}: cannot be read as a tokenizers file ({exc})") from None
        cfg_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as exc:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({exc})") from None
        return cls(backend, config)


def split_digit_runs(pre_tokenizer: pre_tokenizers.PreTokenizer) -> pre_tokenizers.PreTokenizer:
    """``pre_tokenizer`` after a split of digit runs from what precedes and follows them, so a number is the same
    tokens wherever it stands: " 08:00" in a request and "08:00" in a JSON answer both hold "08" (without it the
    request's is " 0" + "8", which a copy head cannot copy). The space before a number becomes its own token."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=False), pre_tokenizer])


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = SPECIAL_TOKENS) -> Tokenizer:
    """Train a byte-level BPE whose first ids are ``special_tokens`` (mask=0, eos=1, pad=2 for ours), digit runs
    split from their neighbours (``split_digit_runs``)."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = split_digit_runs(pre_tokenizers.ByteLevel(add_prefix_space=False))
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    config = {"mask_token": MASK, "eos_token": EOS, "pad_token": PAD, "chat_template": DEFAULT_CHAT_TEMPLATE}
    return Tokenizer(backend, config)
