"""Incremental detokenization and stop strings: token ids in, printable text deltas out.

Text is re-decoded over a short window (a few tokens before the unread ones, so tokenizers that
merge spaces across tokens get the boundary right). A delta ending in U+FFFD is an incomplete
UTF-8 sequence: it waits for the next token, so no half character is ever emitted. Stop strings
are matched on the accumulated text, across token boundaries; text that might still turn out to
be the start of a stop string is held back, and the stop string itself is never emitted.
No torch.
"""

from __future__ import annotations

from typing import Protocol

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset > 4 * _CONTEXT_TOKENS:  # keep the window short: trim old ids
            drop = self._prefix_offset - _CONTEXT_TOKENS
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return full[len(prefix) :]

    def flush(self) -> str:
        """The request ended: whatever the unread tokens decode to (an invalid byte tail stays
        as U+FFFD, as a full decode would show it)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


class StopStringFilter:
    """Holds back text that could begin a stop string; cuts the text at the first stop string."""

    def __init__(self, stop: list[str]) -> None:
        self._stop = list(stop)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        """All text so far, stop string excluded."""
        self._emitted = 0

    def add(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to emit now, whether a stop string was found)."""
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        cut = min((p for p in (self.text.find(s, search_from) for s in self._stop) if p >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return self.flush(), True
        return self._emit(len(self.text) - self._hold), False

    def flush(self) -> str:
        """The request ends for another reason: emit everything held back."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out, self._emitted = self.text[self._emitted : end], end
        return out
