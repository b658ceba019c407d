"""Prompt lookup (vLLM's "ngram" method): no extra model. The last n tokens of the sequence
(n from prompt_lookup_max down to prompt_lookup_min) are searched for earlier in the prompt and
output; the tokens that followed the most recent earlier occurrence are proposed. As a
distribution the proposal is a point mass, which is what `rejection_sampler` verifies."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = 4  # bytes per token id in the search buffer (int32)


def ngram_lookup(token_ids: Sequence[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the most recent earlier occurrence of the longest
    suffix of length in [min_n, max_n]; [] when no suffix recurs. The search runs in C
    (bytes.rfind over int32 ids), so a long context costs one copy per call, not a Python loop."""
    num_all = len(token_ids)
    if num_tokens <= 0 or num_all < 2:
        return []
    buf = array("i", token_ids).tobytes()
    for n in range(min(max_n, num_all - 1), min_n - 1, -1):
        pattern = buf[(num_all - n) * _ITEM :]
        end = (num_all - 1) * _ITEM  # a match must end before the last token: something follows it
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % _ITEM == 0:  # a byte match off the token grid is no match
                start = at // _ITEM + n
                return list(token_ids[start : start + num_tokens])
            end = at + len(pattern) - 1
    return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, out) -> None:
        """Fill `spec_token_ids` of every scheduled request that has lookahead slots."""
        for item in out.scheduled:
            if item.num_lookahead_tokens:
                item.spec_token_ids = ngram_lookup(item.request.all_token_ids, self.min_n, self.max_n,
                                                   item.num_lookahead_tokens)

    def kv_bytes_per_block(self) -> int:
        return 0

    def allocate_kv(self, num_blocks: int) -> None:
        pass
