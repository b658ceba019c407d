"""Verification of draft tokens: which of a request's k proposals the target keeps, and the token
it adds, such that the output has exactly the target's distribution (greedy: the same tokens).

Both proposers here (ngram lookup, a greedy draft model) propose deterministically: as a
distribution, draft token d_j is a point mass q_j = 1{d_j}. Leviathan et al. / Chen et al.
accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j), and on rejection draw from the
residual norm(max(p_j - q_j, 0)), i.e. p_j with d_j taken out. We run that rule as a coupling:

    x_j = the token the plain sampler draws from p_j (the target's processed distribution at
          position j, given the prefix and d_1..d_j-1) with position j's own uniform;
    emit x_0, x_1, ... and stop after the first j where x_j != d_j+1 (or after x_k, the bonus).

P(x_j == d_j+1) = p_j(d_j+1), the acceptance probability, and given x_j != d_j+1, x_j is
distributed as p_j restricted to other tokens: the residual. Each emitted token is a draw from
the target's conditional given the tokens emitted before it, so the sequence has the target's
joint distribution; the uniforms are independent of the proposals, which are fixed before the
forward. Two properties come for free: greedy rows accept exactly while the draft equals the
argmax, and a seeded row's uniform for output position i is `seeded_uniform(seed, i)` as without
speculation, so seeded outputs are the same tokens with and without it (and however many drafts
were accepted, before or after a preemption). Penalties see the drafts as output, as they would.
tests/engine/test_spec_decode_stats.py checks the distribution, and that a wrong rule fails.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.sampler import Sampler, SamplingInput


def verify_drafts(sampler: Sampler, logits: torch.Tensor, items: Sequence) -> dict[str, tuple | list[tuple]]:
    """`logits` [sum(1 + len(spec)), vocab]: for each sampling item (ScheduledRequest) in order, the
    target's logits at its last token and at each of its draft tokens. Returns request id →
    (token, logprobs) for items without drafts, else → the list of (token, logprobs) it emits:
    its accepted drafts, then one token of the target's (a correction or the bonus). An n > 1
    request about to fork (engine/request.py; never drafted) draws each choice from its one row:
    choice id → (token, logprobs). One sampler call for the whole batch."""
    rows: list[SamplingInput] = []
    picks: list[int] = []  # the logits row of each draw
    num_logits = 0
    for item in items:
        request, spec = item.request, item.spec_token_ids
        prompt, output = request.sampling_view()
        if request.forks:  # parallel sampling: the choices draw from their parent's row
            rows += [SamplingInput(params, prompt, output) for _, params in request.sampling_rows()]
            picks += [num_logits] * request.params.n
        else:
            rows.append(SamplingInput(request.params, prompt, output))
            rows += [SamplingInput(request.params, prompt, [*output, *spec[:j]]) for j in range(1, 1 + len(spec))]
            picks += range(num_logits, num_logits + 1 + len(spec))
        num_logits += 1 + len(spec)
    if logits.shape[0] != num_logits:
        raise ValueError(f"expected {num_logits} logit rows for the drafts, got {logits.shape[0]}")
    if len(picks) != num_logits:  # forks draw several times from one row
        logits = logits[torch.tensor(picks, device=logits.device)]
    result = sampler(logits, rows)
    pairs = list(zip(result.token_ids, result.logprobs))
    verified: dict[str, tuple | list[tuple]] = {}
    row = 0
    for item in items:
        request, spec = item.request, item.spec_token_ids
        if request.forks:
            for key, _ in request.sampling_rows():
                verified[key] = pairs[row]
                row += 1
            continue
        emitted = pairs[row : row + 1 + len(spec)]
        verified[request.request_id] = accept_prefix(emitted, spec) if spec else emitted[0]
        row += 1 + len(spec)
    return verified


def accept_prefix(pairs: list[tuple], spec: Sequence[int]) -> list[tuple]:
    """The target's tokens up to and including the first that differs from the draft's."""
    for j, draft in enumerate(spec):
        if pairs[j][0] != draft:
            return pairs[: j + 1]
    return pairs[: len(spec) + 1]
