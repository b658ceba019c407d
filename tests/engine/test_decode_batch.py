"""Decode steps as columns (engine/decode_batch.py, engine/scheduler_decode.py): every step in
which the whole running batch decodes one token each is a `DecodeStep`, whether the scheduler
decided it from the columns alone or request by request (a preemption, a swap-in, a copy-on-write);
any other step is a list of per-request chunks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.host_batch import pad_tables
from pdserve.engine.input_batch import PersistentBlockTables
from pdserve.engine.request import RequestStatus
from tests.conftest import assert_no_leak, make_request, make_scheduler


def draw(request):
    """A fake model's token: a function of the request's state only (so both paths agree)."""
    return (request.num_tokens * 5 + len(request.request_id)) % 13


def fake_execute(out):
    """The model runner's return for `out`: columns for a decode step, else the mapping."""
    if out.decode is not None:
        return [draw(r) for r in out.decode.requests], None
    return {s.request.request_id: (draw(s.request), None) for s in out.scheduled if s.samples}


def step_view(out):
    """What the model runner gets: every chunk with its tokens and blocks (a decode step's tokens
    as its columns carry them, not read back from the requests)."""
    fed = (out.decode.token_ids.tolist() if out.decode is not None else
           [s.request.all_token_ids[s.num_computed_tokens] for s in out.scheduled])
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens, list(s.block_ids), s.samples, token)
            for s, token in zip(out.scheduled, fed)]


def steady_batch(num=3, **kw):
    sched = make_scheduler(num_blocks=32, block_size=4, **kw)
    reqs = [make_request(num_tokens=3 + i, max_tokens=12, request_id=f"r{i}") for i in range(num)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()  # the prefills: chunks
    assert out.decode is None
    sched.postprocess(out, fake_execute(out))
    return sched, reqs


def test_a_steady_decode_is_scheduled_as_columns_and_grows_blocks_at_boundaries():
    sched, reqs = steady_batch()
    bm = sched.block_manager
    for _ in range(6):
        before = {r.request_id: r.num_computed_tokens for r in reqs}
        out = sched.schedule()
        assert out.decode is not None and out.num_batched_tokens == 3
        assert [s.request for s in out.scheduled] == reqs  # the per-request items, built on demand
        for s in out.scheduled:
            assert s.num_new_tokens == 1 and s.samples and s.num_computed_tokens == before[s.request.request_id]
            # room for the new token: a request at a block boundary got its next block
            assert len(bm.block_ids(s.request.request_id)) * 4 >= s.num_computed_tokens + 1
        stepped = list(sched.postprocess(out, fake_execute(out)) or [])
        assert out.stepped == reqs and not stepped
        bm.check_invariants()


@pytest.mark.parametrize("case", ["waiting with a seat", "prompt chunk", "drafts"])
def test_anything_but_the_batch_decoding_one_token_each_is_a_step_of_chunks(case):
    if case == "drafts":
        sched, _ = steady_batch(num_lookahead_tokens=2)
    else:
        sched, _ = steady_batch()
    if case == "waiting with a seat":
        sched.add_request(make_request(num_tokens=5, request_id="late"))
    elif case == "prompt chunk":  # a request mid-prompt in the running batch
        sched.running[0].num_computed_tokens -= 1
    assert sched.schedule().decode is None


def test_a_swapped_request_with_a_seat_is_swapped_in_and_the_step_stays_a_decode_step():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=16, num_host_blocks=8)
    reqs = [make_request(num_tokens=n, max_tokens=8, request_id=f"r{i}") for i, n in enumerate((5, 3, 2))]
    for r in reqs:
        sched.add_request(r)
    while not sched.swapped:  # r1 needs a block for its 5th token: r2 (the latest) is swapped out
        out = sched.schedule()
        sched.postprocess(out, fake_execute(out))
    sched.abort("r0")  # room again
    out = sched.schedule()
    assert out.decode is not None and out.decode.grown is None  # decided request by request
    assert out.blocks_to_swap_in and [s.request.request_id for s in out.scheduled] == ["r1", "r2"]


def test_choices_writing_into_a_shared_block_copy_it_in_a_decode_step():
    sched = make_scheduler(num_blocks=32, block_size=4)
    sched.add_request(make_request(num_tokens=3, max_tokens=6, request_id="n2", n=2, temperature=1.0))
    out = sched.schedule()
    sched.postprocess(out, {"n2#0": (5, None), "n2#1": (6, None)})  # forked: both share block 0
    out = sched.schedule()  # both write position 3, in the shared block: a copy-on-write
    assert out.decode is not None and out.decode.grown is None and len(out.blocks_to_copy) == 1
    sched.postprocess(out, fake_execute(out))
    out = sched.schedule()  # each in a block of its own now
    assert out.decode is not None and [r.request_id for r in out.decode.requests] == ["n2#0", "n2#1"]
    sched.postprocess(out, fake_execute(out))
    sched.block_manager.check_invariants()


def test_a_full_batch_decodes_as_columns_while_requests_wait():
    sched, reqs = steady_batch(max_num_seqs=3)
    sched.add_request(make_request(num_tokens=5, request_id="late"))  # no seat for it
    out = sched.schedule()
    assert out.decode is not None and [s.request for s in out.scheduled] == reqs


def test_a_step_that_must_preempt_is_a_decode_step_of_the_requests_left():
    # 4 blocks of 4 tokens: three requests of 5, 4, 3 tokens hold 2 + 1 + 1 blocks; the second
    # needs a new block for its 5th token and the pool is empty.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=16)
    reqs = [make_request(num_tokens=n, max_tokens=8, request_id=f"r{i}") for i, n in enumerate((5, 3, 2))]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.postprocess(out, fake_execute(out))  # 6, 4, 3 tokens: 2 + 1 + 1 blocks, 5, 3, 2 computed
    out = sched.schedule()  # r1 writes its 4th position (block 0); r0's 6th is in its 2nd block
    assert out.decode is not None
    sched.postprocess(out, fake_execute(out))
    out = sched.schedule()  # r1 (position 4) needs a 2nd block: none free -> preempt r2 (the latest)
    assert out.preempted_request_ids == ["r2"] and out.decode is not None and out.decode.grown is None
    assert out.decode.requests == reqs[:2]
    sched.postprocess(out, fake_execute(out))
    sched.block_manager.check_invariants()


def test_an_abort_while_the_step_runs_is_reported_and_appends_nothing():
    sched, reqs = steady_batch()
    out = sched.schedule()
    assert out.decode is not None
    sampled = fake_execute(out)
    sched.abort("r1")  # e.g. the client went away while the forward ran
    sched.postprocess(out, sampled)
    assert reqs[1].status == RequestStatus.FINISHED_ABORTED and reqs[1].num_output_tokens == 1
    assert out.stepped == reqs  # reported, as a step of chunks does
    assert [r.num_output_tokens for r in (reqs[0], reqs[2])] == [2, 2]
    sched.block_manager.check_invariants()


def test_stop_ids_eos_and_lengths_end_the_flagged_rows_only():
    sched = make_scheduler(num_blocks=32, block_size=4, eos_token_ids=[9], max_model_len=12)
    reqs = [make_request(num_tokens=3, max_tokens=20, request_id="eos"),
            make_request(num_tokens=3, max_tokens=20, request_id="ignores-eos", ignore_eos=True),
            make_request(num_tokens=3, max_tokens=20, request_id="stop-id", stop_token_ids=[4]),
            make_request(num_tokens=3, max_tokens=3, request_id="max-tokens"),
            make_request(num_tokens=9, max_tokens=20, request_id="max-model-len")]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.postprocess(out, {r.request_id: (1, None) for r in reqs})
    out = sched.schedule()
    assert out.decode is not None
    tokens = {"eos": 9, "ignores-eos": 9, "stop-id": 4, "max-tokens": 1, "max-model-len": 1}
    finished = sched.postprocess(out, ([tokens[i] for i in out.decode.request_ids], None))
    assert [r.request_id for r in finished] == ["eos", "stop-id"]
    out = sched.schedule()
    assert out.decode is not None
    finished = sched.postprocess(out, ([1] * len(out.decode), None))
    assert [(r.request_id, r.finish_reason) for r in finished] == [("max-tokens", "length"),
                                                                   ("max-model-len", "length")]
    assert reqs[1].status == RequestStatus.RUNNING and reqs[1].output_token_ids == [1, 9, 1]


def test_logprobs_columns_are_appended_per_row():
    sched, reqs = steady_batch()
    out = sched.schedule()
    sched.postprocess(out, ([5, 6, 7], [{5: -0.1}, None, {7: -0.3}]))
    assert [r.output_logprobs for r in reqs] == [[{5: -0.1}], [], [{7: -0.3}]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 14), st.integers(1, 14), st.integers(0, 3), st.booleans(), st.booleans()),
             min_size=1, max_size=10),
    st.integers(0, 4),
    st.sampled_from([0, 16]),
    st.booleans(),
    st.lists(st.integers(0, 30), max_size=4),
    st.lists(st.integers(0, 30), max_size=3),
    st.integers(1, 4),
)
def test_random_workloads_keep_the_block_tables_and_the_pool_sound(specs, max_seqs_extra, host_blocks, prefix,
                                                                    abort_at, abort_mid_step, arrivals_every):
    """Property: a workload (bursts of arrivals, some with their prompt KV from elsewhere as a
    decode node's join the batch, EOS and stop ids, max_tokens, a tight pool with preemption by
    recompute or swap, prefix caching, aborts between steps and while a step runs): the runner's
    block tables kept across steps match the live ones at every step, a decode step feeds each
    request's last token at its computed position, every request ends, and nothing leaks."""
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=2 + max_seqs_extra,
                           num_host_blocks=host_blocks, enable_prefix_caching=prefix, eos_token_ids=[3])
    reqs = [make_request([(family * 7 + j) % 11 + 1 for j in range(n)], max_tokens=max_tokens, request_id=f"q{i}",
                         stop_token_ids=[5] if stops else [])
            for i, (n, max_tokens, family, stops, _) in enumerate(specs)]
    for r, (*_, remote) in zip(reqs, specs):
        if remote:  # prompt KV computed elsewhere: its first token drawn there
            r.append_output((len(r.prompt_token_ids) * 5) % 13)
    pending = list(reqs)
    kept = PersistentBlockTables(2)  # the runner's block tables
    for step in range(3000):
        if not (pending or sched.has_unfinished()):
            break
        if pending and step % arrivals_every == 0:
            request = pending.pop(0)
            sched.add_remote(request) if request.num_output_tokens else sched.add_request(request)
        for request in sched.schedule_remote_kv():  # its KV arrives at once: it joins the batch
            sched.remote_kv_done(request.request_id)
        if step in abort_at:
            sched.abort(reqs[step % len(reqs)].request_id)
        out = sched.schedule()
        if out.decode is not None:
            assert out.decode.requests == sched.running
            assert [t for *_, t in step_view(out)] == [r.all_token_ids[-1] for r in sched.running]
            assert out.decode.positions.tolist() == [r.num_computed_tokens for r in sched.running]
        if not out.is_empty:
            tables = kept.gather_decode(out.decode) if out.decode is not None else kept.gather(out.scheduled)
            assert tables.tolist() == pad_tables([s.block_ids for s in out.scheduled]).tolist()
        sampled = fake_execute(out)
        if step in abort_mid_step:
            sched.abort(reqs[(step + 1) % len(reqs)].request_id)
        sched.postprocess(out, sampled)
        sched.block_manager.check_invariants()
    else:
        raise AssertionError("no progress")
    assert all(r.is_finished for r in reqs)
    assert_no_leak(sched.block_manager)


def test_random_workloads_do_take_decode_steps():
    """The property above is only worth something if its workloads reach steady decodes."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    for i in range(6):
        sched.add_request(make_request(num_tokens=3 + i, max_tokens=10, request_id=f"w{i}"))
    kinds = []
    while sched.has_unfinished():
        out = sched.schedule()
        kinds.append(out.decode is not None)
        sched.postprocess(out, fake_execute(out))
    assert sum(kinds) >= 10 and not all(kinds)
    assert_no_leak(sched.block_manager)


# ---- the runner's block tables, from columns ------------------------------------------------
def test_block_tables_of_a_decode_batch_rewrite_only_grown_rows_while_trusted():
    sched, reqs = steady_batch()
    kept = PersistentBlockTables(2, 1)
    seen = []
    for _ in range(8):
        out = sched.schedule()
        assert out.decode is not None
        seen.append(bool(out.decode.grown))
        assert kept.gather_decode(out.decode).tolist() == pad_tables(out.decode.block_lists).tolist()
        sched.postprocess(out, fake_execute(out))
    assert any(seen) and not all(seen)
    # A gather of chunks in between ends the trust: the next decode step compares every row.
    bm = sched.block_manager
    rid = reqs[0].request_id
    out = sched.schedule()
    kept.gather(out.scheduled)
    bm.tables[rid][0], bm.tables[rid][-1] = bm.tables[rid][-1], bm.tables[rid][0]  # as a copy-on-write would
    assert kept.gather_decode(out.decode).tolist() == pad_tables(out.decode.block_lists).tolist()


def test_a_following_batch_has_the_constants_of_a_fresh_one():
    """`DecodeBatch.following` (requests left, others joined at the end) against a batch built
    afresh: the same ids, prompt lengths, max_tokens and greedy flag; stop ids a superset (rows
    drawing one get the exact check); the carried columns cut to the rows still there; anything
    but removals then arrivals is built afresh with nothing carried."""
    import random

    import numpy as np

    from pdserve.engine.decode_batch import DecodeBatch

    rng, eos = random.Random(5), frozenset([3])
    pool = [make_request(num_tokens=rng.randint(1, 9), max_tokens=rng.randint(1, 50), request_id=f"f{i}",
                         stop_token_ids=rng.sample(range(20), rng.randint(0, 2)), ignore_eos=rng.random() < 0.5,
                         temperature=rng.choice([0, 0, 0.7])) for i in range(60)]
    for _ in range(200):
        old_reqs = rng.sample(pool, rng.randint(1, 12))
        old = DecodeBatch(old_reqs, eos)
        carried = tuple(np.arange(len(old_reqs)) * k for k in (1, 2, 3))
        kept = [r for r in old_reqs if rng.random() < 0.8]
        joined = rng.sample([r for r in pool if r not in old_reqs], rng.randint(0, 3))
        running = kept + joined if rng.random() < 0.9 else joined + kept
        batch, cut = DecodeBatch.following(old, running, eos, carried)
        fresh = DecodeBatch(running, eos)
        assert batch.request_ids == fresh.request_ids and batch.all_plain_greedy == fresh.all_plain_greedy
        assert (batch.prompt_lens == fresh.prompt_lens).all() and (batch.max_tokens == fresh.max_tokens).all()
        assert set(fresh.stop_ids.tolist()) <= set(batch.stop_ids.tolist())
        prefix_kept = running[: len(kept)] == kept and kept
        if cut is None:
            assert not prefix_kept or not running
        else:
            assert prefix_kept
            rows = [old_reqs.index(r) for r in kept]
            assert [c.tolist() for c in cut] == [[k * i for i in rows] for k in (1, 2, 3)]
