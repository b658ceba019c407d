"""A request continued elsewhere (the router's re-dispatch: the prompt plus the tokens already
streamed, with num_prior_output_tokens = how many) samples exactly what the undisturbed request
would have: seeded draws are keyed on the output position and penalties count those tokens as
output, not prompt."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 3, 42, 200, 7, 64, 128, 11]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model_path=tiny_llama, dtype="float32", num_kv_blocks=64, num_threads=1))


def generate(engine, prompt, params, **kw) -> list[int]:
    rid = engine.add_request(prompt, params, **kw)
    out = None
    while engine.has_unfinished():
        for request in engine.step_requests():
            if request.request_id == rid:
                out = request
    return list(out.output_token_ids)


@pytest.mark.parametrize("params", [
    dict(temperature=0.9, seed=7),
    dict(temperature=1.0, seed=3, frequency_penalty=0.8, presence_penalty=0.4, top_p=0.9),
    dict(temperature=0.0, repetition_penalty=1.3),
])
def test_continuation_samples_what_the_undisturbed_request_would(engine, params):
    full = generate(engine, PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params))
    for k in (1, 5, 12):
        rest = generate(engine, PROMPT + full[:k], SamplingParams(max_tokens=MAX_TOKENS - k, ignore_eos=True, **params),
                        num_prior_output_tokens=k)
        assert rest == full[k:], k
    assert engine.block_manager.num_used_blocks == 0


def test_without_the_count_a_seeded_continuation_diverges(engine):
    """The check above can fail: treating streamed tokens as prompt changes the draws."""
    params = dict(temperature=1.0, seed=11, frequency_penalty=1.0)
    full = generate(engine, PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params))
    rest = generate(engine, PROMPT + full[:5], SamplingParams(max_tokens=MAX_TOKENS - 5, ignore_eos=True, **params))
    assert rest != full[5:]


def test_bad_count_is_refused(engine):
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=2), num_prior_output_tokens=len(PROMPT))
    assert not engine.has_unfinished()
