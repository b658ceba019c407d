"""Turns one step's logits into next tokens, one row per sequence that samples.

Order (vLLM's): raw logprobs are taken from the unprocessed logits; penalties act on the raw
logits; greedy rows take the argmax; the others are divided by their temperature, then min_p,
top_k and top_p mask tokens, and one token is drawn.

The filters and the draw work on unnormalised probabilities w = exp((x - max) / T), whose row
maximum is exactly 1: min_p is then a plain threshold, and every filter reduces to a per-row
threshold "keep w >= t".

The draw is an inverse CDF with one uniform per row. A seeded row takes its uniform from a
counter-based hash of (seed, output position) computed on the host, so the token depends only on
those two numbers and the logits: the same on every node, process and batch layout, after a move
or a recompute (across device types, up to rounding in the probabilities). Unseeded rows share
the Sampler's own torch generator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.ops.argmax import argmax_rows
from pdserve.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_DRAW_BLOCK = 256  # the CDF is built per block of this many tokens: a full-row cumsum is slow on CPU
_TOP_P_CANDIDATES = 1024  # top_p first looks for its nucleus among this many tokens, then sorts


@dataclass
class SamplingInput:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # sampled so far; len() is the output position of this draw


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, float] | None]  # per row: top-n and the sampled token, raw log_softmax


class Sampler:
    def __init__(self, seed: int = 0):
        self._generator = torch.Generator().manual_seed(seed)  # for rows whose params.seed is None

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingInput]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput([], [])
        logits = logits.float()  # a bf16 model's lm_head output: every filter and the draw in float32
        token_ids = self._sample(logits, rows).tolist()
        return SamplerOutput(token_ids, gather_logprobs(logits, rows, token_ids))

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingInput]) -> torch.Tensor:
        plain = [i for i, r in enumerate(rows) if r.params.greedy and not r.params.needs_penalties]
        if len(plain) == len(rows):
            return argmax_rows(logits)
        # one argmax over every row costs less than selecting the plain ones first
        token_ids = (
            argmax_rows(logits) if plain else torch.empty(len(rows), dtype=torch.long, device=logits.device)
        )
        plain_set = set(plain)
        rest = [i for i in range(len(rows)) if i not in plain_set]
        rest_rows = [rows[i] for i in rest]
        work = _take_rows(logits, rest)  # may be the caller's tensor: copied before any write
        if any(r.params.needs_penalties for r in rest_rows):
            work = apply_penalties(work.to(torch.float32, copy=True), rest_rows)
            # An extreme penalty (1e-40, 1e39) overflows to inf or NaN; keep every logit finite so
            # the draw still sees a distribution (the penalized order is kept).
            work.nan_to_num_(nan=-_LOGIT_LIMIT, posinf=_LOGIT_LIMIT, neginf=-_LOGIT_LIMIT).clamp_(
                -_LOGIT_LIMIT, _LOGIT_LIMIT)
        greedy = [j for j, r in enumerate(rest_rows) if r.params.greedy]
        drawn = [j for j, r in enumerate(rest_rows) if not r.params.greedy]
        if greedy:
            _put(token_ids, [rest[j] for j in greedy], argmax_rows(_take_rows(work, greedy)))
        if drawn:
            drawn_rows = [rest_rows[j] for j in drawn]
            uniforms = self._uniforms(drawn_rows, logits.device)
            _put(
                token_ids, [rest[j] for j in drawn], _draw_rows(_take_rows(work, drawn), drawn_rows, uniforms)
            )
        return token_ids

    def _uniforms(self, rows: Sequence[SamplingInput], device: torch.device) -> torch.Tensor:
        num_unseeded = sum(r.params.seed is None for r in rows)
        unseeded = iter(torch.rand(num_unseeded, dtype=torch.float64, generator=self._generator).tolist())
        values = [
            next(unseeded)
            if r.params.seed is None
            else seeded_uniform(r.params.seed, len(r.output_token_ids))
            for r in rows
        ]
        return torch.tensor(values, dtype=torch.float64, device=device)


_LOGIT_LIMIT = 1e30  # penalized logits are clamped to +-this


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position): splitmix64, stable across processes."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (bits >> 11) * 2.0**-53


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingInput]) -> torch.Tensor:
    """Repetition, then frequency, then presence penalties, in place on float `logits` [S, vocab].

    Works on the (row, token) pairs that occur, never on a dense [S, vocab] matrix. Repeated pairs
    need no dedup for the repetition penalty: every copy writes the same value, computed from
    the logits as they were before the write.
    """
    penalized = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not penalized:
        return logits
    vocab_size = logits.shape[1]
    params = [r.params for r in rows]
    repeat = [i for i in penalized if params[i].repetition_penalty != 1]
    if repeat:
        seen = _token_pairs(
            [rows[i].prompt_token_ids for i in repeat] + [rows[i].output_token_ids for i in repeat],
            repeat + repeat,
            vocab_size,
            logits.device,
        )
        penalty = _column([p.repetition_penalty for p in params], logits.device).squeeze(1)[seen[0]]
        values = logits[seen]
        # HF-style: a division would raise a negative logit, so negatives are multiplied instead
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    additive = [i for i in penalized if params[i].frequency_penalty or params[i].presence_penalty]
    if additive:
        counts = [Counter(_as_ints(rows[i].output_token_ids)) for i in additive]
        pairs = _token_pairs([list(c) for c in counts], additive, vocab_size, logits.device)
        num_seen = torch.tensor(
            [n for c in counts for n in c.values()], dtype=torch.float32, device=logits.device
        )
        freq = _column([p.frequency_penalty for p in params], logits.device).squeeze(1)[pairs[0]]
        presence = _column([p.presence_penalty for p in params], logits.device).squeeze(1)[pairs[0]]
        logits[pairs] -= freq * num_seen + presence
    return logits


def _token_pairs(
    token_lists: Sequence[Sequence[int]], row_ids: Sequence[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row ids, token ids) for every token of every list: an index into [S, vocab]."""
    tokens = [torch.as_tensor(t, dtype=torch.long, device="cpu").reshape(-1) for t in token_lists]
    flat = torch.cat(tokens)
    if flat.numel() and (flat.min() < 0 or flat.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}) to be penalized")
    lens = torch.tensor([t.numel() for t in tokens], dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long), lens)
    return row.to(device), flat.to(device)


def _as_ints(token_ids: Sequence[int]) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """Mask with -inf, in place, what min_p, top_k and top_p drop from float `logits` [S, vocab].

    top_k (-1 or 0 = off), top_p and min_p are per-row lists or tensors, or one scalar for all.
    `logits` are taken as already divided by the temperature. Ties with the last kept token stay.
    """
    num_rows = logits.shape[0]
    weights = (logits - logits.amax(-1, keepdim=True)).exp_()
    keep_from = _filter_weights(
        weights, _per_row(top_k, num_rows), _per_row(top_p, num_rows), _per_row(min_p, num_rows)
    )
    return logits.masked_fill_(weights < keep_from, float("-inf"))


def _filter_weights(weights: torch.Tensor, top_k: list, top_p: list, min_p: list) -> torch.Tensor:
    """Zero, in place, what min_p, top_k and top_p drop from `weights` [S, vocab] (row max 1).

    Returns the per-row threshold t [S, 1]: a token was kept iff its weight >= t.
    """
    vocab_size = weights.shape[1]
    keep_from = _column(min_p, weights.device)  # p / p_max < min_p, and p_max is 1 here
    k_rows = [i for i, k in enumerate(top_k) if 0 < k < vocab_size]
    if k_rows:
        k = torch.tensor([top_k[i] for i in k_rows], device=weights.device)
        top = _take_rows(weights, k_rows).topk(max(top_k[i] for i in k_rows), dim=-1).values
        _put(keep_from, k_rows, torch.maximum(_take_rows(keep_from, k_rows), top.gather(1, k[:, None] - 1)))
    if k_rows or any(m > 0 for m in min_p):
        weights.masked_fill_(weights < keep_from, 0)  # before top_p, which renormalises over what is left
    p_rows = [i for i, p in enumerate(top_p) if p < 1]
    if p_rows:
        cut = torch.zeros_like(keep_from)
        _put(cut, p_rows, _nucleus_cut(_take_rows(weights, p_rows), [top_p[i] for i in p_rows]))
        weights.masked_fill_(weights < cut, 0)
        keep_from = torch.maximum(keep_from, cut)
    return keep_from


def _nucleus_cut(weights: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Smallest weight of the nucleus of each row of `weights` [rows, vocab], as [rows, 1].

    The nucleus usually sits among the top few hundred tokens, so a top-k stands in for a full
    sort; rows whose nucleus reaches past the candidates retry with 8x more, then with a full sort.
    """
    vocab_size = weights.shape[1]
    total = weights.sum(-1, keepdim=True)
    p = torch.tensor(top_p, dtype=torch.float32, device=weights.device)[:, None]
    cut = torch.empty_like(p)
    pending = list(range(len(top_p)))
    num_candidates = min(vocab_size, _TOP_P_CANDIDATES)
    while pending:
        candidates = _take_rows(weights, pending).topk(num_candidates, dim=-1).values
        found, complete = _cut_among(
            candidates, _take_rows(total, pending), _take_rows(p, pending), num_candidates == vocab_size
        )
        _put(cut, pending, found)
        pending = [i for i, ok in zip(pending, complete.tolist(), strict=True) if not ok]
        grown = num_candidates * 8
        num_candidates = grown if grown <= vocab_size // 4 else vocab_size
    return cut


def _cut_among(sorted_weights: torch.Tensor, total: torch.Tensor, p: torch.Tensor, exhaustive: bool):
    """Cut inside descending candidates; `complete` says whether the nucleus ended among them."""
    probs = sorted_weights / total
    before = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
    num_keep = (before < p).sum(-1, keepdim=True).clamp_(min=1)  # the top token always stays
    complete = (num_keep.squeeze(1) < sorted_weights.shape[1]) | exhaustive
    return sorted_weights.gather(1, num_keep - 1), complete


def _draw_rows(logits: torch.Tensor, rows: Sequence[SamplingInput], uniforms: torch.Tensor) -> torch.Tensor:
    """Temperature, filters and the draw for `logits` [rows, vocab] (left untouched)."""
    params = [r.params for r in rows]
    logits = logits.float()
    weights = logits - logits.amax(-1, keepdim=True)  # out of place: the first write copies the input
    if any(p.temperature != 1 for p in params):
        weights.div_(_column([p.temperature for p in params], logits.device))
    weights.exp_()
    _filter_weights(weights, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
    return draw(weights, uniforms)


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: row i picks the token where its CDF passes uniforms[i] * row total.

    `weights` [rows, vocab] are non-negative, each row with a positive entry; `uniforms` [rows] in
    [0, 1), float64. The CDF is two-level (block sums, then one block) so that no full-row cumsum
    runs; targets are kept strictly below each total, which guarantees a zero-weight token is never
    picked whatever the rounding.
    """
    num_rows, vocab_size = weights.shape
    num_blocks = -(-vocab_size // _DRAW_BLOCK)
    padding = num_blocks * _DRAW_BLOCK - vocab_size
    blocks = (F.pad(weights, (0, padding)) if padding else weights).reshape(num_rows, num_blocks, _DRAW_BLOCK)
    block_cdf = blocks.sum(-1).double().cumsum_(-1)  # a float64 sum of the row would be 10x slower
    total = block_cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target[:, None], right=True)  # [rows, 1]
    ahead = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0).squeeze(1)
    inner_cdf = blocks[torch.arange(num_rows, device=weights.device), block.squeeze(1)].cumsum(
        -1, dtype=torch.float64
    )
    inner_target = torch.minimum(
        (target - ahead).clamp_(min=0), torch.nextafter(inner_cdf[:, -1], torch.zeros_like(total))
    )
    offset = torch.searchsorted(inner_cdf, inner_target[:, None], right=True).squeeze(1)
    return block.squeeze(1) * _DRAW_BLOCK + offset


def gather_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingInput], token_ids: list[int]
) -> list[dict[int, float] | None]:
    """Top-n and sampled-token logprobs of the raw distribution, for rows that asked for them."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[dict[int, float] | None] = [None] * len(rows)
    if not wanted:
        return result
    logprobs = torch.log_softmax(_take_rows(logits, wanted).float(), dim=-1)
    sampled = _index([token_ids[i] for i in wanted], logits.device)[:, None]
    sampled_values = logprobs.gather(1, sampled).squeeze(1).tolist()
    num_top = min(max(rows[i].params.logprobs for i in wanted), logits.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], sampled[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        entry = dict(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        entry[token_ids[i]] = sampled_values[j]
        result[i] = entry
    return result


def _per_row(values, num_rows: int) -> list:
    """A list of one value per row from a list, a tensor or one scalar for every row."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return list(values) if isinstance(values, (list, tuple)) else [values] * num_rows


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _take_rows(t: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """Rows `ids` of t: t itself when that is every row in order, else a copy."""
    if len(ids) == t.shape[0] and all(i == j for j, i in enumerate(ids)):
        return t
    return t[_index(ids, t.device)]  # advanced indexing: index_select is far slower on CPU


def _put(t: torch.Tensor, ids: Sequence[int], values: torch.Tensor) -> None:
    t[_index(ids, t.device)] = values
