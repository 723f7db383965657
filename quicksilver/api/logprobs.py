"""OpenAI's ``logprobs`` shapes, from the token log-probabilities of :mod:`quicksilver.decoding.scoring`.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}`` over the tokens of
the message content. Legacy completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, the echoed
prompt's tokens first (the very first has no log-probability: nothing comes before it). The numbers are the model's
own distribution, before temperature, penalties and ``logit_bias`` (as vLLM reports them by default), computed by one
extra forward over prompt + answer once the answer is done (a streamed answer gets them in one chunk per choice at
its end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quicksilver.decoding.scoring import TokenLogprob
from quicksilver.structured.lexicon import Lexicon


def _text(lex: Lexicon, token_id: int) -> tuple[str, bytes]:
    raw = lex.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), raw


def content_tokens(lex: Lexicon, ids: Sequence[int], content: str) -> int:
    """How many of the answer tokens ``ids`` make up ``content`` (special tokens write nothing; a stop string may
    end the content inside a token, which then still counts)."""
    written, size = 0, len(content.encode("utf-8"))
    for n, token_id in enumerate(ids):
        if written >= size:
            return n
        written += len(lex.token_bytes(token_id))
    return len(ids)


def chat_logprobs(lex: Lexicon, scored: Sequence[TokenLogprob], content: str | None) -> dict[str, Any]:
    if content is None:  # tool calls only: no content tokens to report
        return {"content": None, "refusal": None}
    entries = []
    for s in scored[: content_tokens(lex, [s.token_id for s in scored], content)]:
        text, raw = _text(lex, s.token_id)
        top = []
        for token_id, logprob in s.top:
            t, r = _text(lex, token_id)
            top.append({"token": t, "logprob": logprob, "bytes": list(r)})
        entries.append({"token": text, "logprob": s.logprob, "bytes": list(raw), "top_logprobs": top})
    return {"content": entries, "refusal": None}


def completion_logprobs(
    lex: Lexicon, prompt_ids: Sequence[int] | None, scored_prompt: Sequence[TokenLogprob],
    scored_answer: Sequence[TokenLogprob], text_after_echo: str, want_top: bool,
) -> dict[str, Any]:
    """``prompt_ids``: the echoed prompt (None without echo); its first token has logprob None, the others
    ``scored_prompt``. ``text_after_echo``: the completion text, which the answer tokens are cut to."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0

    def add(token_id: int, logprob: float | None, alternatives: tuple[tuple[int, float], ...] | None) -> None:
        nonlocal offset
        text, raw = _text(lex, token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append(None if alternatives is None else {_text(lex, t)[0]: lp for t, lp in alternatives})
        offsets.append(offset)
        offset += len(raw.decode("utf-8", errors="ignore"))

    if prompt_ids:
        add(prompt_ids[0], None, None)
        for s in scored_prompt:
            add(s.token_id, s.logprob, s.top)
    keep = content_tokens(lex, [s.token_id for s in scored_answer], text_after_echo)
    for s in scored_answer[:keep]:
        add(s.token_id, s.logprob, s.top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top if want_top else None,
            "text_offset": offsets}
