from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.request import RequestStatus
from tests.conftest import assert_no_leak, make_request, make_scheduler


def fake_forward(out, token=7):
    """Stands in for the model runner: every sampling request gets `token`."""
    return {s.request.request_id: (token, None) for s in out.scheduled if s.samples}


def run_to_completion(sched, max_steps=10_000, token=7):
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        out = sched.schedule()
        finished += sched.postprocess(out, fake_forward(out, token))
        sched.block_manager.check_invariants()
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    req = make_request(num_tokens=20, max_tokens=2)
    sched.add_request(req)
    chunks = []
    while sched.has_unfinished():
        out = sched.schedule()
        chunks.append([(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled])
        sched.postprocess(out, fake_forward(out))
    assert chunks == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)], [(20, 1, True)]]
    assert req.output_token_ids == [7, 7] and req.finish_reason == "length"
    assert_no_leak(sched.block_manager)


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=64,
                           enable_chunked_prefill=False)
    a, b = make_request(num_tokens=40, max_tokens=1), make_request(num_tokens=40, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 40)]
    sched.postprocess(out, fake_forward(out))
    run_to_completion(sched)
    assert_no_leak(sched.block_manager)


def test_decodes_and_a_new_prefill_share_a_step():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    a = make_request(num_tokens=6, max_tokens=5)
    sched.add_request(a)
    out = sched.schedule()
    sched.postprocess(out, fake_forward(out))
    b = make_request(list(range(20, 30)), max_tokens=5)  # no prefix shared with a
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 10)]
    assert out.num_batched_tokens == 11
    sched.postprocess(out, fake_forward(out))
    run_to_completion(sched)
    assert_no_leak(sched.block_manager)


def test_max_num_seqs_bounds_the_batch():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    reqs = [make_request(num_tokens=3, max_tokens=3) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        out = sched.schedule()
        assert len(out.scheduled) <= 2
        sched.postprocess(out, fake_forward(out))
    assert all(r.finish_reason == "length" for r in reqs)
    assert_no_leak(sched.block_manager)


def test_out_of_blocks_preempts_the_latest_by_recompute():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b = make_request(num_tokens=8, max_tokens=8), make_request(num_tokens=8, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += out.preempted_request_ids
        sched.postprocess(out, fake_forward(out))
        sched.block_manager.check_invariants()
    assert preempted and preempted[0] == b.request_id
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.output_token_ids == b.output_token_ids == [7] * 8
    assert_no_leak(sched.block_manager)


def test_out_of_blocks_swaps_when_host_space_allows():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, num_host_blocks=8)
    a, b = make_request(num_tokens=8, max_tokens=8), make_request(num_tokens=8, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    swapped_out = swapped_in = 0
    while sched.has_unfinished():
        out = sched.schedule()
        swapped_out += len(out.blocks_to_swap_out)
        swapped_in += len(out.blocks_to_swap_in)
        if out.blocks_to_swap_out:
            assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens > 0  # keeps its progress
        sched.postprocess(out, fake_forward(out))
        sched.block_manager.check_invariants()
    assert swapped_out > 0 and swapped_in == swapped_out
    assert a.output_token_ids == b.output_token_ids == [7] * 8
    assert_no_leak(sched.block_manager)


def test_priority_orders_admission():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    low = make_request(num_tokens=3, max_tokens=1, priority=5)
    high = make_request(num_tokens=3, max_tokens=1, priority=-1)
    mid = make_request(num_tokens=3, max_tokens=1, priority=0)
    for r in (low, high, mid):
        sched.add_request(r)
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [s.request for s in out.scheduled]
        sched.postprocess(out, fake_forward(out))
    assert order == [high, mid, low]
    assert_no_leak(sched.block_manager)


def test_preemption_picks_the_lowest_priority():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    vip = make_request(num_tokens=8, max_tokens=8, priority=-1)
    normal = make_request(num_tokens=8, max_tokens=8, priority=0)
    sched.add_request(normal)
    out = sched.schedule()
    sched.postprocess(out, fake_forward(out))
    sched.add_request(vip)
    victims = []
    while sched.has_unfinished():
        out = sched.schedule()
        victims += out.preempted_request_ids
        sched.postprocess(out, fake_forward(out))
    assert victims and set(victims) == {normal.request_id}
    assert_no_leak(sched.block_manager)


def test_eos_and_stop_tokens_finish_with_stop():
    sched = make_scheduler(eos_token_ids=[7])
    a = make_request(num_tokens=3, max_tokens=10)
    b = make_request(num_tokens=3, max_tokens=3, ignore_eos=True)
    c = make_request(num_tokens=3, max_tokens=10, ignore_eos=True, stop_token_ids=[7])
    for r in (a, b, c):
        sched.add_request(r)
    run_to_completion(sched)
    assert (a.finish_reason, a.output_token_ids) == ("stop", [7])
    assert (b.finish_reason, b.output_token_ids) == ("length", [7, 7, 7])
    assert (c.finish_reason, c.output_token_ids) == ("stop", [7])
    assert_no_leak(sched.block_manager)


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=6)
    req = make_request(num_tokens=4, max_tokens=10, ignore_eos=True)
    sched.add_request(req)
    run_to_completion(sched)
    assert (req.finish_reason, len(req.output_token_ids), req.num_tokens) == ("length", 2, 6)
    assert_no_leak(sched.block_manager)


def test_stepped_lists_the_requests_given_tokens_in_batch_order():
    # out.stepped is what the nodes stream from: requests that sampled this step, in batch order,
    # finished ones included; a prompt chunk that does not reach its last token is not there.
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=10)
    a, b = make_request(num_tokens=4, max_tokens=1), make_request(num_tokens=4, max_tokens=5)
    c = make_request(num_tokens=12, max_tokens=5)  # 2 of its 12 prompt tokens fit the first step
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    finished = sched.postprocess(out, fake_forward(out))
    assert out.stepped == [a, b] and finished == [a]
    out = sched.schedule()  # b decodes, c's chunk continues
    sched.abort(b.request_id)  # aborted while the step ran: reported, nothing appended
    sched.postprocess(out, fake_forward(out))
    assert out.stepped == [b] and b.output_token_ids == [7] and b.finish_reason == "abort"
    while not c.output_token_ids:
        out = sched.schedule()
        sched.postprocess(out, fake_forward(out))
    assert out.stepped == [c]
    sched.abort(c.request_id)
    assert_no_leak(sched.block_manager)


def test_abort_releases_blocks_from_every_queue():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, num_host_blocks=8, max_num_seqs=2)
    reqs = [make_request(num_tokens=8, max_tokens=20) for _ in range(4)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(6):
        out = sched.schedule()
        sched.postprocess(out, fake_forward(out))
    states = {r.status for r in reqs}
    assert RequestStatus.RUNNING in states and RequestStatus.WAITING in states
    for r in reqs:
        sched.abort(r.request_id)
        sched.block_manager.check_invariants()
    assert all(r.finish_reason == "abort" for r in reqs)
    assert not sched.has_unfinished()
    assert_no_leak(sched.block_manager)


def test_prefix_hits_skip_cached_tokens():
    sched = make_scheduler(num_blocks=32, block_size=4)
    shared = list(range(1, 13))
    a = make_request(shared + [50], max_tokens=1)
    sched.add_request(a)
    run_to_completion(sched)
    b = make_request(shared + [60, 61], max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (12, 2)
    assert b.num_cached_tokens == 12
    sched.postprocess(out, fake_forward(out))
    assert_no_leak(sched.block_manager)


def test_prompt_that_cannot_fit_max_model_len_is_refused():
    sched = make_scheduler(num_blocks=4, block_size=4)
    import pytest

    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request(num_tokens=16))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(-1, 1), st.integers(0, 3)),
             min_size=1, max_size=12),
    st.integers(0, 6),
    st.sampled_from([0, 16]),
    st.booleans(),
    st.lists(st.integers(0, 11), max_size=4),
)
def test_random_workloads_finish_every_request_and_leak_nothing(specs, max_seqs_extra, host_blocks, prefix,
                                                                abort_at):
    """Property: random arrivals (lengths, output lengths, priorities, shared prefixes), aborts at
    random steps, tight pools with preemption by recompute or swap. After every step the books
    balance; at the end every request finished and no block is held."""
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=2 + max_seqs_extra,
                           num_host_blocks=host_blocks, enable_prefix_caching=prefix, eos_token_ids=[3],
                           scheduling_policy="priority")
    reqs = []
    for i, (n, max_tokens, prio, family) in enumerate(specs):
        prompt = [(family * 7 + j) % 11 + 1 for j in range(n)]
        reqs.append(make_request(prompt, max_tokens=max_tokens, priority=prio, request_id=f"p{i}"))
    pending = list(reqs)
    step = 0
    while pending or sched.has_unfinished():
        if pending:  # one arrival per step: requests join while others decode
            sched.add_request(pending.pop(0))
        if step in abort_at and reqs:
            sched.abort(reqs[step % len(reqs)].request_id)
        out = sched.schedule()
        sampled = {s.request.request_id: ((s.request.num_tokens * 5) % 13, None) for s in out.scheduled if s.samples}
        sched.postprocess(out, sampled)
        sched.block_manager.check_invariants()
        step += 1
        assert step < 2000, "no progress"
    assert all(r.is_finished for r in reqs)
    assert_no_leak(sched.block_manager)


def test_the_watermark_never_blocks_a_lone_request():
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.scheduler import Scheduler, SchedulerConfig

    bm = BlockManager(10, 4, watermark=0.3)  # 3 blocks held back for growth
    sched = Scheduler(SchedulerConfig(max_model_len=40, max_num_batched_tokens=64), bm)
    req = make_request(num_tokens=36, max_tokens=2)  # needs 9 of 10 blocks, more than 10 - 3
    sched.add_request(req)
    run_to_completion(sched)
    assert req.finish_reason == "length"
    assert_no_leak(bm)


# ---- remote KV (a decode node's requests) -------------------------------------------------
def make_remote(num_tokens=8, max_tokens=4, **kw):
    """A request as a decode node gets it: prompt KV computed elsewhere, first token sampled there."""
    request = make_request(num_tokens=num_tokens, max_tokens=max_tokens, **kw)
    request.append_output(7)
    return request


def test_remote_kv_waits_then_receives_then_runs():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    a, b, c = make_remote(), make_remote(), make_remote()
    for r in (a, b, c):
        sched.add_remote(r)
    assert [r.status for r in (a, b, c)] == [RequestStatus.WAITING_FOR_KV] * 3
    assert sched.block_manager.num_used_blocks == 0 and sched.schedule().is_empty  # nothing to step yet
    assert sched.has_unfinished() and not sched.has_runnable()
    started = sched.schedule_remote_kv()
    assert started == [a, b]  # arrival order; max_num_seqs counts receiving requests
    assert [r.status for r in started] == [RequestStatus.RECEIVING_KV] * 2 and a.kv_pull_started_at is not None
    assert sched.block_manager.block_ids(a.request_id) and (sched.num_waiting_for_kv, sched.num_receiving_kv) == (1, 2)
    assert sched.schedule_remote_kv() == []  # the batch is full
    assert sched.remote_kv_done(a.request_id) is a and a.status is RequestStatus.RUNNING
    assert a.num_computed_tokens == a.num_prompt_tokens
    out = sched.schedule()  # the first token is fed back
    assert [(s.request, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(a, 8, 1)]
    sched.postprocess(out, fake_forward(out))
    assert sched.remote_kv_done(b.request_id) is b
    while sched.has_runnable():  # c waits for room meanwhile
        out = sched.schedule()
        sched.postprocess(out, fake_forward(out))
    assert a.finish_reason == b.finish_reason == "length" and c.status is RequestStatus.WAITING_FOR_KV
    assert sched.schedule_remote_kv() == [c] and sched.remote_kv_done(c.request_id) is c
    run_to_completion(sched)
    assert c.output_token_ids == [7] * 4
    assert_no_leak(sched.block_manager)


def test_remote_kv_waits_for_blocks_in_arrival_order():
    sched = make_scheduler(num_blocks=6, block_size=4)
    big, small = make_remote(num_tokens=16), make_remote(num_tokens=4)
    running = make_request(list(range(100, 108)), max_tokens=8)  # no prefix in common with big
    sched.add_request(running)
    sched.postprocess(out := sched.schedule(), fake_forward(out))  # 2 blocks held
    sched.add_remote(big)  # needs 4 blocks: fits exactly
    sched.add_remote(small)
    assert sched.schedule_remote_kv() == [big]
    assert sched.schedule_remote_kv() == []  # small waits behind: no block left
    assert sched.remote_kv_failed(big.request_id) is big and big.finish_reason == "abort"
    assert sched.schedule_remote_kv() == [small]
    sched.abort(running.request_id)
    assert sched.remote_kv_failed(small.request_id) is small
    assert sched.remote_kv_failed("unknown") is None and not sched.has_unfinished()
    assert_no_leak(sched.block_manager)


def test_remote_kv_takes_the_prefix_its_cache_holds_and_pulls_the_rest():
    sched = make_scheduler(num_blocks=8, block_size=4)
    bm = sched.block_manager
    history = make_request(num_tokens=10, max_tokens=1)  # a turn decoded here: 2 full blocks cached
    sched.add_request(history)
    while sched.has_runnable():
        sched.postprocess(out := sched.schedule(), fake_forward(out))
    follow_up = make_remote(num_tokens=14)  # the history's 10 tokens + 4 new: blocks 0-1 are hits
    sched.add_remote(follow_up)
    assert sched.schedule_remote_kv() == [follow_up]
    table = bm.block_ids(follow_up.request_id)
    assert follow_up.num_cached_tokens == 8 and len(table) == 4
    assert [bm.block_keys[b] is not None for b in table] == [True, True, False, False]  # hits, then fresh
    alone = make_remote(prompt_token_ids=list(range(200, 214)))  # nothing in common: every block pulled
    sched.add_remote(alone)
    assert sched.schedule_remote_kv() == [alone] and alone.num_cached_tokens == 0
    assert sched.remote_kv_done(follow_up.request_id) is follow_up
    sched.abort(follow_up.request_id)
    sched.abort(alone.request_id)
    assert_no_leak(bm)


def test_remote_kv_watermark_only_once_something_runs_or_receives():
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.scheduler import Scheduler, SchedulerConfig

    bm = BlockManager(10, 4, watermark=0.3)  # 3 blocks held back for growth
    sched = Scheduler(SchedulerConfig(max_model_len=40, max_num_batched_tokens=64), bm)
    first, second = make_remote(num_tokens=24), make_remote(num_tokens=8)  # 6 blocks, then 2
    sched.add_remote(first)
    sched.add_remote(second)
    assert sched.schedule_remote_kv() == [first]  # an empty pool keeps no watermark
    assert sched.schedule_remote_kv() == []  # 4 free, 3 held back: 2 blocks do not fit
    sched.abort(first.request_id)
    assert sched.schedule_remote_kv() == [second]
    sched.abort(second.request_id)
    assert_no_leak(bm)


def test_remote_kv_arrived_before_holds_back_later_arrivals():
    sched = make_scheduler(num_blocks=16, block_size=4)
    early, late = make_remote(), make_remote()
    early.arrival_time, late.arrival_time = 10.0, 20.0
    sched.add_remote(early)
    sched.add_remote(late)
    assert sched.schedule_remote_kv(arrived_before=15.0) == [early]
    assert sched.schedule_remote_kv(arrived_before=15.0) == []
    assert sched.schedule_remote_kv(arrived_before=25.0) == [late]
    for r in (early, late):
        sched.abort(r.request_id)
    assert all(r.finish_reason == "abort" for r in (early, late))
    assert_no_leak(sched.block_manager)


def test_remote_kv_refuses_a_duplicate_id():
    import pytest

    sched = make_scheduler(num_blocks=16, block_size=4)
    request = make_remote(request_id="dup")
    sched.add_remote(request)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_remote(make_remote(request_id="dup"))
    sched.abort("dup")
    assert_no_leak(sched.block_manager)


def test_token_counters_for_throughput():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    sched.add_request(make_request(num_tokens=12, max_tokens=3))
    remote = make_remote(num_tokens=8, max_tokens=3)
    sched.add_remote(remote)
    sched.schedule_remote_kv()
    sched.remote_kv_done(remote.request_id)
    run_to_completion(sched)
    # 12 prompt positions computed here (the remote prompt was computed elsewhere); 3 + 2 sampled
    assert (sched.num_prompt_tokens_computed, sched.num_tokens_sampled) == (12, 5)
    assert_no_leak(sched.block_manager)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=10),
    st.integers(1, 4),
    st.sampled_from([0, 16]),
    st.booleans(),
    st.lists(st.integers(0, 11), max_size=3),
    st.integers(0, 1000),
)
def test_random_speculative_workloads_finish_and_leak_nothing(specs, k, host_blocks, prefix, abort_at, salt):
    """Property, with speculative steps: every decode step gets up to k draft slots; a fake verifier
    keeps a pseudo-random number of the drafts and adds one token (EOS among them sometimes), so
    rollbacks, stops mid-draft, preemption (recompute or swap) and aborts all happen. After every
    step the books balance and no running request holds a block past its computed KV plus the
    next token; at the end every request finished and no block is held."""
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                           num_host_blocks=host_blocks, enable_prefix_caching=prefix, eos_token_ids=[3],
                           num_lookahead_tokens=k)
    bm = sched.block_manager
    reqs = [make_request([(family * 7 + j) % 11 + 1 for j in range(n)], max_tokens=max_tokens, request_id=f"s{i}")
            for i, (n, max_tokens, family) in enumerate(specs)]
    pending = list(reqs)
    step = 0
    while pending or sched.has_unfinished():
        if pending:
            sched.add_request(pending.pop(0))
        if step in abort_at and reqs:
            sched.abort(reqs[step % len(reqs)].request_id)
        out = sched.schedule()
        sampled = {}
        for s in out.scheduled:
            if not s.samples:
                continue
            r = s.request
            token = (r.num_tokens * 5 + salt) % 13
            if not s.num_lookahead_tokens:
                sampled[r.request_id] = (token, None)
                continue
            s.spec_token_ids = [(r.num_tokens + j + salt) % 13 for j in range(s.num_lookahead_tokens)]
            kept = s.spec_token_ids[: (r.num_tokens + salt) % (s.num_lookahead_tokens + 1)]
            sampled[r.request_id] = [(t, None) for t in kept] + [(token, None)]
        sched.postprocess(out, sampled)
        bm.check_invariants()
        for r in sched.running:
            assert len(bm.block_ids(r.request_id)) <= bm.num_blocks_for(r.num_computed_tokens + 1)
        step += 1
        assert step < 2000, "no progress"
    assert all(r.is_finished for r in reqs)
    assert_no_leak(bm)
