"""Speculative decoding: a proposer guesses the next k tokens, the target model verifies them in
one forward (query length k+1 per request), and `engine.rejection_sampler` keeps what the target
itself would have sampled. This package holds the pure-Python parts (config, stats, ngram lookup)
and the draft-model proposer; nothing here is imported by the scheduler but `config` and `stats`.
"""


def make_proposer(spec, config, model_config, max_model_len: int):
    """The proposer `spec` (a SpeculativeConfig) names: NgramProposer or DraftProposer."""
    if spec.method == "ngram":
        from pdserve.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.spec_decode.draft import DraftProposer

    return DraftProposer(spec.num_speculative_tokens, resolve_model(spec.model), config, model_config, max_model_len)
