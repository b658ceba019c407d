"""Parallel sampling (n > 1): one prefill, n choices sharing the prompt's blocks by refcount, a
copy-on-write of the partly filled last block, per-choice seeded streams, and no block left
behind whatever ends the choices (pure-Python scheduler tests, then the engine on a tiny model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import RequestStatus, child_id
from tests.conftest import assert_no_leak, make_block_manager, make_request, make_scheduler
from tests.engine.test_generate_parity import hf_greedy, make_prompts


def fake_forward(out, token=7):
    """Stands in for the model runner: every draw (n of them for a request about to fork) gets `token`."""
    return {key: (token, None) for s in out.scheduled if s.samples for key, _ in s.request.sampling_rows()}


def step(sched, token=7):
    out = sched.schedule()
    finished = sched.postprocess(out, fake_forward(out, token))
    sched.block_manager.check_invariants()
    return out, finished


# ---- block manager ---------------------------------------------------------------------
def test_fork_shares_blocks_and_copy_on_write_gives_a_private_copy():
    bm = make_block_manager(num_blocks=8, block_size=4)
    bm.allocate("p", 6)  # two blocks, the second one half full
    first, last = bm.block_ids("p")
    bm.fork("p", "a")
    bm.fork("p", "b")
    bm.free("p")
    assert bm.block_ids("a") == bm.block_ids("b") == [first, last]
    assert bm.ref_counts[first] == bm.ref_counts[last] == 2 and bm.num_used_blocks == 2
    assert bm.can_allocate("a", 7, write_from=6)
    bm.allocate("a", 7)
    copies = bm.copy_on_write("a", 6, 7)  # a writes position 6, inside the shared last block
    assert len(copies) == 1 and copies[0][0] == last and bm.block_ids("a") == [first, copies[0][1]]
    assert bm.copy_on_write("b", 6, 7) == []  # b is now the last holder: it writes in place
    assert bm.ref_counts[first] == 2 and bm.ref_counts[last] == 1 and bm.num_used_blocks == 3
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert_no_leak(bm)


def test_copy_on_write_counts_against_free_blocks():
    bm = make_block_manager(num_blocks=2, block_size=4)
    bm.allocate("p", 6)
    bm.fork("p", "a")
    assert not bm.can_allocate("a", 7, write_from=6)  # a copy of the last block needs a free one
    assert bm.can_allocate("a", 7)  # without the write it would fit: the check is what counts
    bm.free("p")
    assert bm.can_allocate("a", 7, write_from=6)  # last holder: no copy
    bm.free("a")
    assert_no_leak(bm)


# ---- scheduler -------------------------------------------------------------------------
def test_four_choices_of_a_300_token_prompt_hold_its_blocks_once():
    """Blocks by hand, block_size 16: the prompt fills 18 blocks and 12 slots of a 19th. The 18
    full blocks stay shared (refcount 4); each choice holds its own copy of the 19th and its own
    blocks after it. After decode step k a choice holds ceil((300 + k) / 16) blocks, of which
    18 are shared: used = 18 + 4 * (ceil((300 + k) / 16) - 18), against 4 * ceil((300 + k) / 16)
    for four separate requests."""
    sched = make_scheduler(num_blocks=128, block_size=16, max_num_batched_tokens=512, max_model_len=2048)
    req = make_request(num_tokens=300, max_tokens=40, n=4, ignore_eos=True)
    sched.add_request(req)
    out, _ = step(sched)  # the prefill: one row of logits, four draws, a fork
    children = out.forked[req.request_id]
    assert [c.request_id for c in children] == [child_id(req.request_id, i) for i in range(4)]
    assert sched.block_manager.num_used_blocks == 19  # the prompt's blocks, once
    assert all(c.output_token_ids == [7] for c in children) and req.request_id not in sched.requests
    bm = sched.block_manager
    for k in range(1, 39):  # the 39th decode step samples the 40th token and ends them
        out, _ = step(sched)
        assert len(out.scheduled) == 4
        num_blocks = -(-(300 + k) // 16)
        assert bm.num_used_blocks == 18 + 4 * (num_blocks - 18), k
        assert bm.num_used_blocks < 4 * num_blocks
        # a copy only on the first write into the shared 19th block: 3 copies, the 4th writes in place
        assert len(out.blocks_to_copy) == (3 if k == 1 else 0)
        shared = bm.block_ids(children[0].request_id)[:18]
        assert all(bm.ref_counts[b] == 4 for b in shared)
    _, finished = step(sched)
    assert set(finished) == set(children)
    assert all(c.finish_reason == "length" and c.num_output_tokens == 40 for c in children)
    assert_no_leak(bm)


def test_a_parent_counts_n_against_max_num_seqs():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4)
    a = make_request(num_tokens=5, max_tokens=3, n=3)
    b = make_request(num_tokens=5, max_tokens=3, n=2)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert [s.request for s in out.scheduled] == [a]  # 3 + 2 > 4: b waits
    while sched.has_unfinished():
        out, _ = step(sched)
        assert sum(s.request.params.n for s in out.scheduled) <= 4
    assert_no_leak(sched.block_manager)


def test_a_parent_in_chunked_prefill_counts_n_for_every_admission():
    """While an n = 3 parent prefills over several steps, an n = 1 request must not take a seat its
    choices need: the batch never exceeds max_num_seqs, before or after the fork."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=4)
    sched.add_request(make_request(num_tokens=10, max_tokens=3, n=3))
    sched.add_request(make_request(num_tokens=2, max_tokens=3))
    while sched.has_unfinished():
        out, _ = step(sched)
        assert len(out.scheduled) <= 3 and len(sched.running) <= 3
    assert_no_leak(sched.block_manager)


def test_aborting_the_parent_id_aborts_every_choice():
    sched = make_scheduler(num_blocks=64, block_size=4)
    req = make_request(num_tokens=10, max_tokens=20, n=3)
    sched.add_request(req)
    out, _ = step(sched)
    step(sched)
    children = out.forked[req.request_id]
    sched.abort(children[1].request_id)  # one choice alone (the router found its stop string)
    assert children[1].status == RequestStatus.FINISHED_ABORTED and children[0].status == RequestStatus.RUNNING
    aborted = sched.abort(req.request_id)
    assert sorted(aborted, key=lambda r: r.choice_index) == [children[0], children[2]]
    assert all(c.is_finished for c in children) and sched.abort(req.request_id) == []
    assert_no_leak(sched.block_manager)


def test_remote_kv_parent_forks_with_the_prefill_nodes_first_tokens():
    sched = make_scheduler(num_blocks=32, block_size=4)
    req = make_request(num_tokens=10, max_tokens=2, n=3)
    req.choice_first_tokens = [(11, None), (12, None), (13, None)]
    sched.add_remote(req)
    assert sched.schedule_remote_kv() == [req]
    sched.remote_kv_done(req.request_id)
    children = [sched.requests[child_id(req.request_id, i)] for i in range(3)]
    assert [c.output_token_ids for c in children] == [[11], [12], [13]]
    assert sched.block_manager.num_used_blocks == 3  # 10 tokens, once
    out, finished = step(sched)
    assert len(out.blocks_to_copy) == 2 and {r.request_id for r in finished} == {c.request_id for c in children}
    assert_no_leak(sched.block_manager)


@settings(max_examples=40, deadline=None)
@given(
    ns=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    num_blocks=st.integers(10, 30),
    num_host_blocks=st.sampled_from([0, 12]),
    abort_every=st.sampled_from([0, 3, 7]),
)
def test_property_forks_under_preemption_and_aborts_never_leak(ns, num_blocks, num_host_blocks, abort_every):
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, num_host_blocks=num_host_blocks,
                           max_num_batched_tokens=16, max_model_len=40)
    reqs = [make_request(num_tokens=5 + 3 * i, max_tokens=12, n=n, ignore_eos=True) for i, n in enumerate(ns)]
    for r in reqs:
        sched.add_request(r)
    for k in range(2000):
        if not sched.has_unfinished():
            break
        if abort_every and k % abort_every == abort_every - 1:
            sched.abort(reqs[k % len(reqs)].request_id)
        out = sched.schedule()
        written = {d for _, d in out.blocks_to_copy}
        held = {b for s in out.scheduled for b in s.block_ids}
        assert written <= held, "a copy-on-write target that no scheduled request holds"
        sched.postprocess(out, fake_forward(out))
        sched.block_manager.check_invariants()
    else:
        raise AssertionError("did not finish")
    assert_no_leak(sched.block_manager)


# ---- the engine, on a tiny model ---------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_threads=2, block_size=16, kv_cache_memory_gb=0.05)


def test_greedy_choices_all_equal_transformers(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    prompts = make_prompts(n=4, lengths=(300, 17, 33, 7))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()
    want = hf_greedy(model, prompts, max_tokens=20)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, n=4), use_tqdm=False)
    for out, expected in zip(outs, want, strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert [c.token_ids for c in out.outputs] == [expected] * 4
    assert_no_leak(llm.engine.block_manager)


def test_seeded_choice_i_equals_one_request_seeded_seed_plus_i(llm):
    prompts = make_prompts(n=2, lengths=(300, 21), seed=3)
    params = dict(max_tokens=24, temperature=1.0, top_p=0.95, ignore_eos=True)
    outs = llm.generate(prompts, SamplingParams(n=3, seed=100, **params), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        alone = [llm.generate([prompt], SamplingParams(seed=100 + i, **params), use_tqdm=False)[0].token_ids
                 for i in range(3)]
        assert [c.token_ids for c in out.outputs] == alone
        assert len({tuple(t) for t in alone}) > 1  # the streams differ
    assert_no_leak(llm.engine.block_manager)


@pytest.mark.parametrize("swap_gb", [0.0, 0.01])
def test_seeded_choices_survive_preemption(tiny_llama, llm, swap_gb):
    prompts = make_prompts(n=3, lengths=(40, 30, 50), seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=9, n=3, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_llama), dtype="float32", num_threads=2, block_size=16, num_kv_blocks=14,
                swap_space_gb=swap_gb)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert_no_leak(tight.engine.block_manager)


def test_abort_mid_generation_frees_every_block(llm):
    engine = llm.engine
    rid = engine.add_request(make_prompts(n=1, lengths=(300,))[0],
                             SamplingParams(max_tokens=50, n=4, temperature=1.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len([r for r in engine.scheduler.requests.values() if r.parent_id == rid]) == 4
    assert set(engine.detokenizers) >= {child_id(rid, i) for i in range(4)}
    engine.abort(rid)
    assert not engine.has_unfinished() and not engine.detokenizers
    assert_no_leak(engine.block_manager)


def test_stop_strings_end_each_choice_on_its_own(llm):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=1, n=4, ignore_eos=True)
    full = llm.generate(["Hello"], params, use_tqdm=False)[0]
    stop = full.outputs[0].text[3:5]
    cut = llm.generate(["Hello"], SamplingParams(max_tokens=30, temperature=1.0, seed=1, n=4, ignore_eos=True,
                                                 stop=[stop]), use_tqdm=False)[0]
    for before, after in zip(full.outputs, cut.outputs, strict=True):
        if stop in before.text:
            assert after.finish_reason == "stop" and stop not in after.text
            assert after.token_ids == before.token_ids[: len(after.token_ids)]
        else:  # (text compared by tokens: a random model's bytes are not all valid UTF-8)
            assert after.token_ids == before.token_ids and after.finish_reason == "length"
    assert cut.outputs[0].finish_reason == "stop"
    assert_no_leak(llm.engine.block_manager)


def test_n_is_validated():
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=1.5)
    assert SamplingParams(n=3, seed=7).for_choice(2) == SamplingParams(n=1, seed=9)
    assert SamplingParams(n=3).for_choice(2).seed is None


def test_n_above_max_num_seqs_is_refused(tiny_llama):
    small = LLM(str(tiny_llama), dtype="float32", num_threads=2, max_num_seqs=2, kv_cache_memory_gb=0.01)
    with pytest.raises(ValueError, match="exceeds max_num_seqs"):
        small.generate([[1, 2, 3]], SamplingParams(n=3), use_tqdm=False)
    assert_no_leak(small.engine.block_manager)


@pytest.mark.parametrize("swap_gb", [0.0, 0.001])
def test_a_choice_preempted_in_the_step_of_its_copy_on_write_keeps_its_kv(tiny_llama, llm, swap_gb):
    """Four blocks for four choices of a 40-token prompt (3 blocks, the last one partly filled):
    the first decode step copies the last block for choice 0, then finds no block for choice 1's
    copy and preempts choice 0 (the latest, first among equals), whose copy is cancelled: swapped
    out, its host blocks get the original; recomputed, it starts over. Outputs stay the same."""
    prompt = make_prompts(n=1, lengths=(40,), seed=11)[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=4, n=4, ignore_eos=True)
    want = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    tight = LLM(str(tiny_llama), dtype="float32", num_threads=2, block_size=16, num_kv_blocks=4, swap_space_gb=swap_gb)
    assert [c.token_ids for c in tight.generate([prompt], params, use_tqdm=False)[0].outputs] == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert_no_leak(tight.engine.block_manager)


def test_a_fork_in_a_step_that_verifies_drafts_draws_every_choice():
    """A batch may verify another request's drafts in the step where an n > 1 request draws its
    choices' first tokens: each choice draws from its parent's logits row, seeded per choice."""
    from types import SimpleNamespace

    import torch

    from pdserve.engine.rejection_sampler import verify_drafts
    from pdserve.engine.sampler import Sampler

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    drafted = SimpleNamespace(request=make_request(num_tokens=4, temperature=0), spec_token_ids=[3, 4])
    parent = SimpleNamespace(request=make_request(num_tokens=4, n=3, seed=5), spec_token_ids=[])
    got = verify_drafts(Sampler(), logits, [drafted, parent])
    assert got[drafted.request.request_id] == verify_drafts(Sampler(), logits[:3], [drafted])[drafted.request.request_id]
    for i in range(3):
        alone = SimpleNamespace(request=make_request(num_tokens=4, seed=5 + i), spec_token_ids=[])
        want = verify_drafts(Sampler(), logits[3:], [alone])[alone.request.request_id]
        assert got[child_id(parent.request.request_id, i)] == want
