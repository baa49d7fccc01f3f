"""The text of a growing list of token ids, decoded a few ids at a time (pure Python).

Decoding a request's whole output again at every step costs time in proportion to its length,
per request and step, so a generation's text costs the square of its length. IncrementalText
decodes a window instead: the ids new since the last update, after the ids of the update before
as context. Decoders treat the first id of a string specially (SentencePiece drops its leading
space), so the window is decoded with and without the new ids and the difference is the new
text. The scheme is vLLM's ``detokenize_incrementally``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["IncrementalText", "stop_found"]

REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


@dataclass
class IncrementalText:
    """``text`` is ``tokenizer.decode(ids[:read], skip_special_tokens=True)`` for the ids
    passed to :meth:`update`, except where a decoder rewrites text it already returned (a
    clean-up of spaces across a window's edge): then ``text`` is the whole decode, taken again.
    It never ends inside a character: ids whose decode ends in U+FFFD (an incomplete UTF-8
    sequence) stay unread until later ids complete it."""

    text: str = ""
    start: int = 0  # first id of the window's context
    read: int = 0  # ids[:read] are in ``text``

    def update(self, ids: Sequence[int], tokenizer: Any) -> int:
        """Take in ``ids`` (the same list, grown); returns the first index of ``text`` that
        changed (``len(text)`` where nothing did)."""
        if len(ids) < self.read:  # the ids were cut back: start over
            self.text, self.start, self.read = "", 0, 0
        if len(ids) == self.read:
            return len(self.text)
        before = tokenizer.decode(ids[self.start:self.read], skip_special_tokens=True)
        after = tokenizer.decode(ids[self.start:], skip_special_tokens=True)
        if after.endswith(REPLACEMENT) or after == before:
            return len(self.text)  # an incomplete character, or nothing visible yet: wait
        since = len(self.text)
        if after.startswith(before):
            self.text += after[len(before):]
        else:  # the decoder rewrote the context: the whole text again
            full = tokenizer.decode(ids, skip_special_tokens=True)
            if not full.startswith(self.text):
                since = next((i for i, (a, b) in enumerate(zip(self.text, full)) if a != b),
                             min(len(self.text), len(full)))
            self.text = full
        self.start, self.read = self.read, len(ids)
        return since


def stop_found(decoded: IncrementalText, ids: Sequence[int], tokenizer: Any,
               stops: Sequence[str]) -> bool:
    """Whether a stop string appears in the text of ``ids`` once ``decoded`` has taken in the
    new ones; only the changed end of the text is searched (what came before was searched by
    the earlier calls)."""
    since = decoded.update(ids, tokenizer)
    text = decoded.text
    return any(s in text[max(0, since - len(s) + 1):] for s in stops)
