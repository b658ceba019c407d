"""Speculative decoding, offline: the config, ngram lookup, the scheduler's lookahead slots and
their rollback, and the engine's outputs: greedy token-identical with and without speculation
(ngram, a draft model), under preemption too; seeded sampling identical as well (the verification
is a coupling: engine/rejection_sampler.py); metrics."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.ngram import ngram_lookup
from pdserve.engine.spec_decode.stats import SpecDecodeStats
from tests.conftest import assert_no_leak, make_request, make_scheduler
from tests.engine.spec_helpers import assert_idle, copy_prompts, make_llm, noisy_draft

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


# ---- config ---------------------------------------------------------------------------------
def test_config_takes_vllm_keys_and_json():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}')
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == \
        ("ngram", 4, 5, 1)
    draft = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 2})
    assert draft.method == "draft_model" and draft.model == "/some/draft"
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


@pytest.mark.parametrize("value, message", [
    ("{nope", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"num_speculative_tokens": 2, "typo": 1}', "unknown key"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
    ('{"method": "ngram", "model": "x", "num_speculative_tokens": 2}', "takes no"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "<="),
])
def test_bad_config_is_a_clear_value_error(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_cli_refuses_bad_json_in_one_line(capsys):
    from pdserve.cli.main import main

    with pytest.raises(SystemExit):
        main(["generate", "--speculative-config", '{"num_speculative_tokens": 2, "typo": 1}', "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pdserve generate: error: argument --speculative-config: speculative_config: unknown")


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    from tests.conftest import save_tiny_model

    save_tiny_model(tmp_path, "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(tiny_llama, {"model": str(tmp_path), "num_speculative_tokens": 2})


# ---- ngram lookup ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_match():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [7, 1]
    assert ngram_lookup([1, 2, 3, 4, 5, 3], 1, 3, 3) == [4, 5, 3]  # only a 1-gram matches
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 2) == []  # nothing recurs
    assert ngram_lookup([5, 5], 1, 1, 4) == [5]  # what follows is all there is
    assert ngram_lookup([1, 2, 3, 1, 2, 3], 2, 3, 0) == []


def test_ngram_ignores_byte_matches_off_the_token_grid():
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: byte-wise, [1] occurs inside [256, ...]
    assert ngram_lookup([256, 0, 7, 1], 1, 1, 2) == []
    assert ngram_lookup([1, 8, 256, 0, 7, 1], 1, 1, 2) == [8, 256]


# ---- scheduler: lookahead slots and their rollback ---------------------------------------------
def verify_fake(out, num_accept: int, token: int = 7):
    """Stands in for propose + verify: drafts [50, 51, ...]; the first `num_accept` kept, then `token`."""
    sampled = {}
    for s in out.scheduled:
        if not s.samples:
            continue
        s.spec_token_ids = [50 + j for j in range(s.num_lookahead_tokens)]
        kept = s.spec_token_ids[:num_accept]
        sampled[s.request.request_id] = [(t, None) for t in kept] + [(token, None)] if s.num_lookahead_tokens \
            else (token, None)
    return sampled


def test_lookahead_slots_are_allocated_and_rejected_ones_rolled_back():
    sched = make_scheduler(num_blocks=32, block_size=4, num_lookahead_tokens=3)
    req = make_request(num_tokens=8, max_tokens=20)
    sched.add_request(req)
    out = sched.schedule()  # prefill: no lookahead
    assert out.scheduled[0].num_lookahead_tokens == 0
    sched.postprocess(out, verify_fake(out, 0))
    out = sched.schedule()  # decode of token 9 at position 8, drafts at 9..11
    item = out.scheduled[0]
    assert (item.num_computed_tokens, item.num_new_tokens, item.num_lookahead_tokens) == (8, 1, 3)
    assert len(item.block_ids) == 3  # positions 0..11
    sched.postprocess(out, verify_fake(out, 1))  # one draft kept, then the target's own token
    assert req.output_token_ids == [7, 50, 7] and req.num_new_output_tokens == 2
    assert req.num_computed_tokens == 10  # the fed token and the accepted draft
    assert len(sched.block_manager.block_ids(req.request_id)) == 3
    out = sched.schedule()
    sched.postprocess(out, verify_fake(out, 0))  # all rejected: positions 11..13 roll back
    assert req.num_computed_tokens == 11 and len(sched.block_manager.block_ids(req.request_id)) == 3
    assert sched.spec_stats.num_draft_tokens == 6 and sched.spec_stats.num_accepted_tokens == 1
    assert sched.spec_stats.num_accepted_tokens_per_pos == [1, 0, 0]
    sched.abort(req.request_id)
    assert_no_leak(sched.block_manager)


def test_blocks_that_hold_nothing_are_freed_after_a_rejection():
    sched = make_scheduler(num_blocks=32, block_size=4, num_lookahead_tokens=4)
    req = make_request(num_tokens=7, max_tokens=20)
    sched.add_request(req)
    sched.postprocess(out := sched.schedule(), verify_fake(out, 0))
    out = sched.schedule()  # position 7, drafts 8..11: a third block for them
    assert len(out.scheduled[0].block_ids) == 3
    sched.postprocess(out, verify_fake(out, 0))
    assert len(sched.block_manager.block_ids(req.request_id)) == 2  # position 7 is the last computed
    sched.abort(req.request_id)
    assert_no_leak(sched.block_manager)


def test_lookahead_respects_max_tokens_max_model_len_and_the_budget():
    sched = make_scheduler(num_blocks=32, block_size=4, num_lookahead_tokens=4, max_model_len=14)
    short = make_request(num_tokens=6, max_tokens=3)
    sched.add_request(short)
    sched.postprocess(out := sched.schedule(), verify_fake(out, 0))
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_tokens == 1  # 2 more tokens allowed: 1 draft + 1 of the target's
    sched.postprocess(out, verify_fake(out, 1))
    assert short.finish_reason == "length" and short.num_output_tokens == 3
    long = make_request(num_tokens=11, max_tokens=20)
    sched.add_request(long)
    sched.postprocess(out := sched.schedule(), verify_fake(out, 0))
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_tokens == 1  # 12 tokens known, max_model_len 14
    sched.postprocess(out, verify_fake(out, 1))
    assert long.finish_reason == "length" and long.num_tokens == 14
    assert_no_leak(sched.block_manager)


def test_a_stop_token_among_the_accepted_ends_the_request_there():
    sched = make_scheduler(num_blocks=32, block_size=4, num_lookahead_tokens=3, eos_token_ids=[51])
    req = make_request(num_tokens=6, max_tokens=20)
    sched.add_request(req)
    sched.postprocess(out := sched.schedule(), verify_fake(out, 0))
    out = sched.schedule()
    finished = sched.postprocess(out, verify_fake(out, 3))
    assert finished == [req] and req.output_token_ids == [7, 50, 51] and req.finish_reason == "stop"
    assert_no_leak(sched.block_manager)


def test_without_room_for_drafts_a_request_decodes_plainly_before_anything_is_preempted():
    sched = make_scheduler(num_blocks=4, block_size=4, num_lookahead_tokens=4)
    a, b = make_request(num_tokens=6, max_tokens=20), make_request(list(range(100, 108)), max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    sched.postprocess(out := sched.schedule(), verify_fake(out, 0))  # both prefilled: 4 blocks held
    out = sched.schedule()
    # a's drafts would need a third block: a decodes plainly; b needs one to decode at all: preempted
    assert [(s.request, s.num_lookahead_tokens) for s in out.scheduled] == [(a, 0)]
    assert out.preempted_request_ids == [b.request_id]
    sched.postprocess(out, verify_fake(out, 0))
    sched.abort(a.request_id)
    sched.abort(b.request_id)
    assert_no_leak(sched.block_manager)


def test_stats_count_per_position():
    stats = SpecDecodeStats()
    stats.observe(3, 2)
    stats.observe(2, 0)
    stats.observe(0, 0)  # no drafts: not a verification
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.acceptance_rate_per_pos() == [0.5, 0.5, 0.0]
    assert stats.mean_accepted_length == 2.0


# ---- the engine: greedy parity ---------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline(tiny_llama):
    prompts = copy_prompts(6, seed=1)
    return prompts, [o.token_ids for o in make_llm(tiny_llama).generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return noisy_draft(tmp_path_factory.mktemp("noisy-draft"))


def test_greedy_ngram_is_token_identical(tiny_llama, baseline):
    prompts, expected = baseline
    llm = make_llm(tiny_llama, NGRAM)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert_idle(llm)


@pytest.mark.parametrize("which", ["noisy", "target", "random"])
def test_greedy_draft_model_is_token_identical(tiny_llama, baseline, draft_dir, tmp_path, which):
    prompts, expected = baseline
    if which == "random":
        from tests.conftest import save_tiny_model

        save_tiny_model(tmp_path, "llama", num_hidden_layers=1, initializer_range=0.05)
    path = {"noisy": draft_dir, "target": tiny_llama, "random": tmp_path}[which]
    llm = make_llm(tiny_llama, {"model": str(path), "num_speculative_tokens": 4})
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    rate = llm.engine.spec_stats.acceptance_rate
    assert {"target": rate == 1.0, "noisy": 0.1 < rate < 1.0, "random": rate < 0.5}[which], rate
    assert_idle(llm)


@pytest.mark.parametrize("spec", ["ngram", "draft"])
@pytest.mark.parametrize("swap", [0.0, 0.001])
def test_greedy_is_token_identical_under_preemption(tiny_llama, baseline, draft_dir, spec, swap):
    prompts, expected = baseline
    config = NGRAM if spec == "ngram" else {"model": str(draft_dir), "num_speculative_tokens": 3}
    llm = make_llm(tiny_llama, config, num_kv_blocks=24, swap_space_gb=swap)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert_idle(llm)


# ---- the engine: sampling --------------------------------------------------------------------
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_llama, draft_dir):
    prompts = copy_prompts(6, seed=2)
    params = [SamplingParams(max_tokens=24, temperature=0.7, seed=i, frequency_penalty=0.3, top_k=40,
                             ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    plain = make_llm(tiny_llama).generate(prompts, params, use_tqdm=False)
    for config in (NGRAM, {"model": str(draft_dir), "num_speculative_tokens": 3}):
        llm = make_llm(tiny_llama, config)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        for a, b in zip(outs, plain):
            assert [sorted(x) for x in a.logprobs] == [sorted(x) for x in b.logprobs]
            assert all(abs(x[t] - y[t]) < 1e-4 for x, y in zip(a.logprobs, b.logprobs) for t in x)
        assert llm.engine.spec_stats.num_accepted_tokens > 0
        assert_idle(llm)


def test_stop_strings_end_the_output_where_they_would_without_speculation(tiny_llama):
    prompts = copy_prompts(4, seed=3)
    plain_llm = make_llm(tiny_llama)
    free = plain_llm.generate(prompts, GREEDY, use_tqdm=False)
    stops = [o.text[len(o.text) // 2 : len(o.text) // 2 + 2] or "zz" for o in free]
    params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[s]) for s in stops]
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    llm = make_llm(tiny_llama, {"model": str(tiny_llama), "num_speculative_tokens": 4})  # accepts everything
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == \
        [(o.token_ids, o.text, o.finish_reason) for o in plain]
    assert any(o.finish_reason == "stop" for o in outs)
    assert_idle(llm)


def test_metrics_export_the_spec_counters(tiny_llama):
    from pdserve.node.metrics import NodeMetrics, engine_snapshot

    llm = make_llm(tiny_llama, NGRAM)
    llm.generate(copy_prompts(2, seed=4), GREEDY, use_tqdm=False)
    metrics = NodeMetrics("d0", "decode")
    metrics.watch(lambda: engine_snapshot(llm.engine))
    text = metrics.render().decode()
    stats = llm.engine.spec_stats
    assert f'pdserve_spec_decode_num_draft_tokens_total{{node_id="d0",role="decode"}} {float(stats.num_draft_tokens)}' \
        in text
    assert f'pdserve_spec_decode_num_accepted_tokens_total{{node_id="d0",role="decode"}} ' \
        f"{float(stats.num_accepted_tokens)}" in text
    assert 'pdserve_spec_decode_num_accepted_tokens_per_pos_total{node_id="d0",position="0",role="decode"}' in text
    plain = NodeMetrics("d1", "decode")
    plain.watch(lambda: engine_snapshot(make_llm(tiny_llama).engine))
    assert "spec_decode" not in plain.render().decode()


@pytest.mark.parametrize("spec", [None, {"model": "TARGET", "num_speculative_tokens": 4}])
def test_with_stop_strings_the_last_steps_tokens_keep_their_text(tiny_llama, spec):
    """A request that ends by max_tokens in a step that appended several tokens (or one) still has
    the text of all of them when stop strings are set (the detokenizer is fed finished requests too)."""
    spec = spec and {**spec, "model": str(tiny_llama)}
    llm = make_llm(tiny_llama, spec)
    prompt = copy_prompts(1, seed=5)
    free = llm.generate(prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    never = llm.generate(prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, stop=["\x00\x00zz"]),
                         use_tqdm=False)[0]
    assert (never.text, never.token_ids, never.finish_reason) == (free.text, free.token_ids, "length")
    assert_idle(llm)


def test_the_stats_line_reports_draft_acceptance():
    from pdserve.node.metrics import NodeSnapshot
    from pdserve.node.stats import stats_line

    def snap(drafted, accepted):
        return NodeSnapshot(num_running=1, num_waiting=0, num_blocks_used=1, num_blocks_total=10, num_prefix_queries=0,
                            num_prefix_hits=0, num_preemptions=0,
                            spec=SpecDecodeStats(num_draft_tokens=drafted, num_accepted_tokens=accepted))

    assert stats_line("d0", "decode", snap(10, 5), snap(30, 20), 1.0).endswith(
        "draft acceptance 75.0% of 20, KV received 0.0 kB/s")
    assert "draft acceptance" not in stats_line("d0", "decode", NodeSnapshot(1, 0, 1, 10, 0, 0, 0),
                                                NodeSnapshot(1, 0, 1, 10, 0, 0, 0), 1.0)


def test_parallel_sampling_and_speculation_in_one_batch(tiny_llama):
    """An n > 1 request forks in a step where another request verifies drafts; every choice gets
    the same tokens as without speculation (seeded), and nothing leaks."""
    prompts = [copy_prompts(1, seed=6)[0][:6], copy_prompts(1, seed=7)[0] * 2]  # the long one prefills in chunks
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=4, n=3, ignore_eos=True)]
    def run(spec):
        llm = make_llm(tiny_llama, spec, max_num_batched_tokens=16)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle(llm)
        return [[c.token_ids for c in o.outputs] for o in outs], llm.engine.spec_stats

    plain, _ = run(None)
    speculated, stats = run({"model": str(tiny_llama), "num_speculative_tokens": 3})
    assert speculated == plain and len(plain[1]) == 3
    assert stats.num_drafts > 0  # verified beside the fork (accepted rarely: the tiny model is flat at 0.8)


def test_plain_steps_through_the_padded_decode_path_mix_with_verifications(tiny_llama, baseline):
    """With decode graphs on (their padded path runs eagerly on the CPU), steps whose requests have
    no drafts replay the graph path and verification steps run eagerly; the output is unchanged."""
    prompts, expected = baseline
    llm = make_llm(tiny_llama, NGRAM)
    runner = llm.engine.runner
    runner.init_decode_graphs(llm.engine.config.max_model_len)
    replays = []
    run = runner.decode_graphs.run
    runner.decode_graphs.run = lambda *a: replays.append(1) or run(*a)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert replays and llm.engine.spec_stats.num_drafts > 0
    assert_idle(llm)


def test_the_drafts_catch_up_is_split_by_the_token_budget(tiny_llama, baseline):
    """A request's first draft forward covers its whole context; with a 16-token budget it runs in
    pieces over several forwards. The target as its own draft is then still accepted every time,
    so the draft KV the pieces built is right."""
    prompts, expected = baseline
    llm = make_llm(tiny_llama, {"model": str(tiny_llama), "num_speculative_tokens": 3}, max_num_batched_tokens=16)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.engine.spec_stats.acceptance_rate == 1.0
    assert llm.engine.proposer.num_catch_up_tokens > 16
    assert_idle(llm)
