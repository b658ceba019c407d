"""A stream's events built from templates (`sse`) are byte for byte `json.dumps` of `chunks`, the
format every other part of the router and its tests read."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.openai_responses import ChatFormat, CompletionFormat
from pdserve.router.request_state import Delta, TokenLogprob

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_logprob = st.builds(TokenLogprob, st.integers(0, 50_000), _text, st.floats(-9999.0, 0.0),
                     st.lists(st.tuples(_text, st.floats(-9999.0, 0.0)), max_size=3), st.integers(0, 100))


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from([CompletionFormat, ChatFormat]), text=_text,
       token_ids=st.lists(st.integers(0, 200_000), max_size=4), logprobs=st.lists(_logprob, max_size=2),
       finish=st.sampled_from([None, "stop", "length"]), first=st.booleans(), include_usage=st.booleans(),
       top_logprobs=st.sampled_from([None, 0, 2]), return_token_ids=st.booleans(),
       request_id=_text, model=_text, created=st.integers(0, 2**40))
def test_sse_is_json_dumps_of_the_chunks(kind, text, token_ids, logprobs, finish, first, include_usage,
                                         top_logprobs, return_token_ids, request_id, model, created):
    fmt = kind(request_id, model, include_usage=include_usage, top_logprobs=top_logprobs,
               return_token_ids=return_token_ids)
    fmt.created = created
    delta = Delta(text, token_ids, logprobs if top_logprobs is not None else [], finish)
    expected = "".join("data: " + json.dumps(c, ensure_ascii=False) + "\n\n" for c in fmt.chunks(delta, first))
    assert fmt.sse(delta, first) == expected.encode()
