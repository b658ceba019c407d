"""Incremental detokenization with stop strings (pure Python; the router uses it too).

Decoding token by token breaks multi-byte characters and words whose spelling depends on the
previous token (SentencePiece's leading spaces). So each step decodes a short window of recent
tokens twice, with and without the new ones, and emits only the difference once it no longer ends
in an incomplete character (U+FFFD). Stop strings are searched in the text emitted so far; the
output is cut before the stop string, as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"
_WINDOW = 6  # tokens of left context kept for decoding


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        # A streamed piece never ends in the first characters of a possible stop string.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already in `text`
        self.text = ""  # all output text so far, cut before a stop string once one is found
        self.num_emitted = 0  # characters of `text` already returned by add_tokens
        self.stopped = False  # a stop string was found

    def add_tokens(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """Feed new tokens; returns the text that is now safe to show (possibly ''). `final`
        (the request ended) flushes everything, a trailing incomplete character included."""
        if not self.stopped:
            self.token_ids.extend(token_ids)
            self._decode_new(final)
        end = len(self.text) if (final or self.stopped) else max(self.num_emitted, len(self.text) - self.holdback)
        piece, self.num_emitted = self.text[self.num_emitted : end], end
        return piece

    def _decode_new(self, final: bool) -> None:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if (full.endswith(_INCOMPLETE) and not final) or len(full) <= len(prefix):
            return
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - _WINDOW)
        self.read_offset = len(self.token_ids)
        start = len(self.text)
        self.text += full[len(prefix) :]
        if self.stop:
            # A stop string may straddle the boundary with earlier text.
            search_from = max(0, start - self.holdback)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i != -1]
            if hits:
                self.stopped = True
                self.text = self.text[: min(hits)]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
