"""Streaming token ids back into text, one id at a time.

A code point may span several tokens (an emoji is often three or four byte
tokens), so an id does not always complete any text; this module owns holding
the incomplete tail back until it does, so a stream never shows a broken
character, and the streamed pieces add up to `Tokenizer.decode` of all ids
(for a SentencePiece tokenizer after a prompt: with the space its first
token starts with, which a decode from the start would drop)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from trioserve.models.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
CONTEXT = 4  # prompt ids kept as left context (enough for any one character's bytes)


class IncrementalDetokenizer:
    """Text for one output stream. Call `push` per generated id, then `flush`
    once at the end; one instance serves one sequence."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True, context: Sequence[int] = ()) -> None:
        """``context``: the ids the output continues (the prompt's last few),
        read as text already emitted: a SentencePiece decode drops the space
        at the start of a text, and the output's first token's space is not
        at the start of the text (" Paris" after "The capital is", as
        llama.cpp and vLLM stream it)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        if tokenizer.byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            # Re-decode scheme: ids[prefix:read] is text already emitted, kept
            # as left context; ids[read:] is not emitted yet.
            self._ids: list[int] = [i for i in context[-CONTEXT:] if 0 <= i < tokenizer.vocab_size]
            self._prefix = 0
            self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """The text that became complete with `token_id`: '' while it ends
        inside a multi-byte character or when it is a skipped special token."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        if self._tokenizer.byte_level:
            return self._utf8.decode(self._tokenizer.token_bytes(token_id))
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The rest at the end of output: bytes still held back, with an
        incomplete or invalid sequence as U+FFFD. The stream is then done."""
        if self._tokenizer.byte_level:
            return self._utf8.decode(b"", final=True)
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        """Re-decode the window since the last emitted boundary and return what
        it adds beyond the already emitted part, unless (and `final` is false)
        the window ends in U+FFFD — a character still missing its last bytes."""
        decode = self._tokenizer.decode
        emitted = decode(self._ids[self._prefix : self._read], skip_special=self._skip_special)
        window = decode(self._ids[self._prefix :], skip_special=self._skip_special)
        if len(window) <= len(emitted) or (window.endswith(_REPLACEMENT) and not final):
            if final:
                self._prefix = self._read = len(self._ids)
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(emitted) :]
