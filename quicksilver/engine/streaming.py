"""Turn committed token ids into append-only text deltas.

A stock OpenAI client concatenates the deltas it receives, so every delta must extend what was already
sent and the concatenation must equal the final answer exactly. Two things could break that:

* a trailing incomplete UTF-8 character (decodes to U+FFFD until its last byte is committed), and
* a suffix that may turn out to be the start of a stop string (the final text is cut before the stop).

Both are held back until the next step tells us more.
"""

from __future__ import annotations

from collections.abc import Sequence

from quicksilver.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


def stop_holdback_start(text: str, stops: Sequence[str]) -> int:
    """Index of the longest suffix of ``text`` that is a proper prefix of some stop string (len if none)."""
    longest = max((len(s) for s in stops), default=0)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[i:]
        if any(s.startswith(tail) for s in stops):
            return i
    return len(text)


class TextStreamer:
    """Per-choice delta builder. ``stop_token`` (e.g. ``<|tool_calls|>``) ends the streamable text early."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (), stop_token: int | None = None):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.stop_token = stop_token
        self.sent = ""
        self.saw_stop_token = False

    def visible_ids(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if self.stop_token is not None and self.stop_token in ids:
            self.saw_stop_token = True
            return ids[: ids.index(self.stop_token)]
        return ids

    def push(self, committed_ids: Sequence[int]) -> str:
        """New safe text given the answer ids committed so far (a growing prefix)."""
        text = self.tokenizer.decode(self.visible_ids(committed_ids))
        safe = text.rstrip(REPLACEMENT_CHAR)
        if self.stops:
            safe = safe[: stop_holdback_start(safe, self.stops)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""  # nothing new, or the decoder is not prefix-stable here: wait for more
        delta = safe[len(self.sent) :]
        self.sent = safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (which extends everything sent so far)."""
        if not final_text.startswith(self.sent):  # cannot happen with prefix-stable decoders; never resend
            return ""
        delta = final_text[len(self.sent) :]
        self.sent = final_text
        return delta
