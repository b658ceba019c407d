"""RouterRequest: re-sequencing, detokenization, stop strings, logprobs, timing (no sockets)."""

from __future__ import annotations

import random

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.messages import Token
from pdserve.router.request_state import RouterError, RouterRequest, RouterRequestStatus


def make(tokenizer, prompt: str = "Say: ", **params) -> RouterRequest:
    req = RouterRequest("r", tokenizer.encode(prompt), SamplingParams(**params), tokenizer)
    req.mark_dispatched("p", "d")
    return req


def tokens_for(tokenizer, text: str, finish: str | None = "length") -> list[Token]:
    ids = tokenizer.encode(text)
    return [Token("r", i, t, None, finish if i == len(ids) - 1 else None) for i, t in enumerate(ids)]


def collect(req: RouterRequest, tokens: list[Token]) -> str:
    deltas = [d for d in (req.receive(t) for t in tokens) if d is not None]
    return "".join(d.text for d in deltas)


def test_in_order_tokens_give_the_text(tokenizer):
    req = make(tokenizer, max_tokens=64)
    assert collect(req, tokens_for(tokenizer, "héllo wörld")) == "héllo wörld"
    assert req.status is RouterRequestStatus.FINISHED and req.finish_reason == "length"
    assert req.node_ids == ["p", "d"]


def test_any_arrival_order_gives_the_same_text(tokenizer):
    text = "naïve café ☕ done"
    for seed in range(5):
        tokens = tokens_for(tokenizer, text)
        random.Random(seed).shuffle(tokens)
        req = make(tokenizer, max_tokens=64)
        assert collect(req, tokens) == text
        assert req.output_token_ids == tokenizer.encode(text)
        assert len(req.timing.token_times) == len(req.output_token_ids)


def test_nothing_is_delivered_before_the_first_token(tokenizer):
    req = make(tokenizer, max_tokens=64)
    tokens = tokens_for(tokenizer, "abc")
    assert req.receive(tokens[2]) is None and req.receive(tokens[1]) is None
    assert req.status is RouterRequestStatus.PREFILLING
    delta = req.receive(tokens[0])
    assert delta.token_ids == tokenizer.encode("abc") and delta.text == "abc" and delta.finish_reason == "length"


def test_duplicates_and_out_of_range_indices_are_dropped(tokenizer):
    req = make(tokenizer, max_tokens=3)
    assert req.receive(Token("r", 5, 70)) is None  # past max_tokens
    assert req.receive(Token("r", 0, 70)) is not None
    assert req.receive(Token("r", 0, 71)) is None  # already delivered
    assert req.receive(Token("r", 2, 72)) is None
    assert req.receive(Token("r", 2, 73)) is None  # already buffered
    assert req.output_token_ids == [70]


def test_stop_string_across_tokens_cuts_the_text_and_asks_for_abort(tokenizer):
    req = make(tokenizer, max_tokens=64, stop=["lo w"])
    tokens = tokens_for(tokenizer, "hello world and more")
    text = collect(req, tokens)
    assert text == "hel"
    assert req.finish_reason == "stop" and req.stopped_by_router
    assert len(req.output_token_ids) == len("hello w")  # the token completing the stop string is the last one


def test_holdback_keeps_a_possible_stop_prefix_until_it_is_decided(tokenizer):
    req = make(tokenizer, max_tokens=64, stop=["xyz"])
    pieces = [req.receive(t) for t in tokens_for(tokenizer, "abxy", finish=None)]
    assert "".join(p.text for p in pieces) == "ab"  # "xy" might start "xyz"
    last = req.receive(Token("r", 4, tokenizer.encode("q")[0], None, "length"))
    assert last.text == "xyq" and last.finish_reason == "length" and not req.stopped_by_router


def test_logprobs_entries(tokenizer):
    req = make(tokenizer, max_tokens=64, logprobs=2)
    a, b = tokenizer.encode("ab")
    delta = req.receive(Token("r", 0, a, {a: -0.5, b: -1.0, 3: -2.0}))
    delta2 = req.receive(Token("r", 1, b, {a: -0.25, b: -0.75, 3: float("-inf")}, "length"))
    (e0,), (e1,) = delta.logprobs, delta2.logprobs
    assert (e0.token, e0.logprob, e0.text_offset) == ("a", -0.5, 0)
    assert [lp for _, lp in e0.top] == [-0.5, -1.0, -2.0]
    assert (e1.token, e1.logprob, e1.text_offset) == ("b", -0.75, 1)
    assert e1.top[-1][1] == -9999.0  # -inf is not JSON


def test_fail_and_abort_end_the_request_once(tokenizer):
    req = make(tokenizer)
    delta = req.fail(RouterError("boom", 500, "InternalServerError"))
    assert delta.error.message == "boom" and req.status is RouterRequestStatus.FAILED
    assert req.fail(RouterError("again", 500, "x")) is None and not req.abort()
    assert req.receive(Token("r", 0, 70, None, "length")) is None
    other = make(tokenizer)
    assert other.abort() and other.status is RouterRequestStatus.ABORTED and other.timing.finished is not None


def _delta_view(d) -> tuple:
    return d.text, d.token_ids, d.finish_reason, [(e.token_id, e.token, e.logprob, e.top) for e in d.logprobs]


def test_a_batch_delivers_as_its_tokens_one_by_one_would(tokenizer):
    """Several tokens of one request in one batch (in order, shuffled, duplicated, past the end,
    around a stop string), mixed with other requests: each request's batch delta is what its
    tokens one by one give, merged."""
    from pdserve.router.request_state import receive_batch

    text = "ab stop cd ☕ naïve"
    for seed in range(8):
        rng = random.Random(seed)
        params = dict(max_tokens=14, stop=["stop"] if seed % 2 else [], logprobs=1 if seed % 3 == 0 else None)
        one, batched = [make(tokenizer, **params) for _ in range(2)], [make(tokenizer, **params) for _ in range(2)]
        streams = []
        for r in range(2):
            tokens = [Token("r", t.index, t.token_id, {t.token_id: -0.5} if params["logprobs"] else None,
                            t.finish_reason) for t in tokens_for(tokenizer, text[r:])]
            tokens += [tokens[rng.randrange(len(tokens))], Token("r", 99, 5)]  # a duplicate, past max_tokens
            streams.append(tokens)
        while any(streams):
            batch = []
            for r in range(2):
                k = rng.randint(0, 3)
                take, streams[r] = streams[r][:k], streams[r][k:]
                rng.shuffle(take)
                batch += [(r, t) for t in take]
            rng.shuffle(batch)
            expected = {}
            for r, t in batch:
                d = one[r].receive(t)
                if d is not None:
                    prev = expected.get(r)
                    expected[r] = d if prev is None else type(d)(prev.text + d.text, prev.token_ids + d.token_ids,
                                                                  prev.logprobs + d.logprobs,
                                                                  d.finish_reason or prev.finish_reason)
            got = receive_batch([(batched[r], t) for r, t in batch])
            assert {batched.index(req): _delta_view(d) for req, d in got.items()} == \
                {r: _delta_view(d) for r, d in expected.items()}
        for a, b in zip(one, batched):
            assert (a.output_token_ids, a.status, a.finish_reason) == (b.output_token_ids, b.status, b.finish_reason)
