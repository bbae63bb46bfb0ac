"""Incremental detokenization and stop strings: token ids in, printable text deltas out.

Text comes from tokenizers' DecodeStream: it re-decodes a short window (a few tokens before the
unread ones, so tokenizers that merge spaces across tokens get the boundary right) and holds back
a delta ending in U+FFFD, an incomplete UTF-8 sequence, until the next token completes it, so no
half character is ever emitted. Stop strings are matched on the accumulated text, across token
boundaries; text that might still turn out to be the start of a stop string is held back, and the
stop string itself is never emitted. No torch.
"""

from __future__ import annotations

from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    @property
    def backend(self) -> HFTokenizer: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._read = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        """The last ids whose text is out (the prompt's, at first): context for the next ones."""
        self._unread: list[int] = []
        self._stream = self._new_stream()

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self._unread.extend(token_ids)
        text = self._stream.step(self._tokenizer.backend, list(token_ids))
        if text is None:
            return ""
        self._mark_read()
        return text

    def flush(self) -> str:
        """The request ended: whatever the unread tokens decode to (an invalid byte tail stays
        as U+FFFD, as a full decode would show it; DecodeStream would hold it forever)."""
        if not self._unread:
            return ""
        prefix = self._decode(self._read)
        full = self._decode(self._read + self._unread)
        self._mark_read()
        self._stream = self._new_stream()
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _new_stream(self) -> DecodeStream:
        """A stream positioned after self._read. A context that ends inside a character (a prompt
        cut mid-UTF-8) is cut before it: DecodeStream would emit the whole context once the
        character completes; this way the orphan bytes decode as they would on their own."""
        context = list(self._read)
        while context and self._decode(context).endswith(_REPLACEMENT):
            context.pop()
        return DecodeStream(ids=context, skip_special_tokens=self._skip_special)

    def _mark_read(self) -> None:
        self._read = (self._read + self._unread)[-_CONTEXT_TOKENS:]
        self._unread = []

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
