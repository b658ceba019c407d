"""Incremental detokenization with stop strings (the router uses it too).

Decoding token by token breaks multi-byte characters and words whose spelling depends on the
previous token (SentencePiece's leading spaces). So each step decodes a short window of recent
tokens twice, with and without the new ones, and emits only the difference once it no longer ends
in an incomplete character (U+FFFD). Stop strings are searched in the text emitted so far; the
output is cut before the stop string, as OpenAI and vLLM do.

The decodes go straight to the `tokenizers` library (`TokenDecoder`), not through transformers'
Python wrapper, which cost more than the decode itself; `add_tokens_batch` feeds one token to each
of many detokenizers (a router's step: one token per stream) in one pass.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

_INCOMPLETE = "\ufffd"
_WINDOW = 6  # tokens of left context kept for decoding


class TokenDecoder:
    """`tokenizer.decode` without the wrapper: the fast tokenizer's Rust `decode` when transformers
    would do nothing more (no clean-up of tokenization spaces), else the tokenizer's own decode.
    `decode_one` caches single tokens (logprob entries name the same tokens again and again)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._one: dict[int, str] = {}

    @functools.cached_property  # picked at the first decode, then a plain attribute
    def decode(self) -> Callable[..., str]:
        """decode(ids, skip_special_tokens=...) -> str"""
        tokenizer = self._tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        if hasattr(backend, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            return backend.decode
        return tokenizer.decode

    def decode_one(self, token_id: int) -> str:
        """The token alone, special tokens included (as `tokenizer.decode([token_id])`)."""
        text = self._one.get(token_id)
        if text is None:
            text = self._one[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text


_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_decoder(tokenizer) -> TokenDecoder:
    """The one `TokenDecoder` of `tokenizer` (its single-token cache is shared by every request)."""
    try:
        return _decoders[tokenizer]
    except KeyError:
        decoder = _decoders[tokenizer] = TokenDecoder(tokenizer)
        return decoder
    except TypeError:  # not weak-referenceable: no sharing
        return TokenDecoder(tokenizer)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.decoder = token_decoder(tokenizer)
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        # A streamed piece never ends in the first characters of a possible stop string.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already in `text`
        # The output text so far (`text`), cut before a stop string once one is found, kept as the
        # pieces already returned plus the rest: appending to one growing string would copy it
        # all at every token.
        self._emitted: list[str] = []
        self._unemitted = ""
        self.num_emitted = 0  # characters of `text` already returned by add_tokens
        self.stopped = False  # a stop string was found

    @property
    def text(self) -> str:
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return (self._emitted[0] if self._emitted else "") + self._unemitted

    def add_tokens(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """Feed new tokens; returns the text that is now safe to show (possibly ''). `final`
        (the request ended) flushes everything, a trailing incomplete character included."""
        if not self.stopped:
            ids = self.token_ids
            ids.extend(token_ids)
            decode, skip, start = self.decoder.decode, self.skip_special_tokens, self.prefix_offset
            # the window decoded without and with the new tokens
            self._apply(decode(ids[start : self.read_offset], skip_special_tokens=skip),
                        decode(ids[start:], skip_special_tokens=skip), final)
        return self._piece(final)

    def _apply(self, prefix: str, full: str, final: bool) -> None:
        if (full.endswith(_INCOMPLETE) and not final) or len(full) <= len(prefix):
            return
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - _WINDOW)
        self.read_offset = len(self.token_ids)
        start = len(self._unemitted)  # where the new text starts, in the part not yet returned
        rest = self._unemitted = self._unemitted + full[len(prefix) :]
        if self.stop:
            # A stop string may straddle the boundary with earlier text (never with text already
            # returned: the last `holdback` characters are held back until more text follows).
            search_from = max(0, start - self.holdback)
            hits = [i for i in (rest.find(s, search_from) for s in self.stop) if i != -1]
            if hits:
                self.stopped = True
                self._unemitted = rest[: min(hits)]

    def _piece(self, final: bool) -> str:
        rest = self._unemitted
        cut = len(rest) if (final or self.stopped) else max(0, len(rest) - self.holdback)
        if not cut:
            return ""
        piece, self._unemitted = rest[:cut], rest[cut:]
        self._emitted.append(piece)
        self.num_emitted += cut
        return piece


def add_tokens_batch(items: Sequence[tuple[IncrementalDetokenizer, int, bool]]) -> list[str]:
    """One new token for each of many detokenizers: `(detokenizer, token_id, final)` →
    the text each may now show (`add_tokens((token_id,), final=final)` of each)."""
    return [detok.add_tokens((token_id,), final=final) for detok, token_id, final in items]
