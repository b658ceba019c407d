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
        self.token_ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already in `text`
        self.text = ""
        self.stopped = False  # a stop string was found; `text` ends right before it

    def add_tokens(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """Feed new tokens; returns the text they add (possibly ''), cut at a stop string.
        `final` emits a trailing incomplete character too (the request has ended)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        decode = self._decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = decode(self.token_ids[self.prefix_offset :])
        if (full.endswith(_INCOMPLETE) and not final) or len(full) <= len(prefix):
            return ""
        new_text = full[len(prefix) :]
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - _WINDOW)
        self.read_offset = len(self.token_ids)
        return self._append(new_text)

    def _append(self, new_text: str) -> str:
        start = len(self.text)
        self.text += new_text
        if self.stop:
            # A stop string may straddle the boundary with earlier text.
            search_from = max(0, start - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i != -1]
            if hits:
                self.stopped = True
                self.text = self.text[: min(hits)]
                return self.text[start:]
        return new_text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def flush_holdback(self) -> int:
        """How many trailing characters of `text` could still become part of a stop string (a
        streaming client should not see them yet)."""
        if not self.stop or self.stopped:
            return 0
        return max(len(s) for s in self.stop) - 1
