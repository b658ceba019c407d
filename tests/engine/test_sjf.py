"""Scheduling policies: shortest job first admits the shortest estimated jobs first, its aging bounds
every wait (a fake clock makes that exact), fcfs and priority keep their order, bad values are
refused in one line."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.engine.scheduling_policy import SchedulingPolicy
from tests.conftest import assert_no_leak, make_scheduler

_TOKEN = 5  # what every fake forward samples (no EOS configured)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sjf_scheduler(clock: FakeClock, *, aging_s: float = math.inf, factor: float = 1.0, **kw):
    kw.setdefault("num_blocks", 256)
    kw.setdefault("max_num_batched_tokens", 512)
    sched = make_scheduler(block_size=4, scheduling_policy="sjf", sjf_length_factor=factor, sjf_aging_s=aging_s,
                           **kw)
    sched.clock = clock
    return sched


def job(prompt_len: int, max_tokens: int, arrival_time: float = 0.0, name: str | None = None) -> Request:
    """A request created at `arrival_time` on the fake clock (create them in arrival order)."""
    request = Request(name or f"job-{prompt_len}-{max_tokens}-{arrival_time}", list(range(1, prompt_len + 1)),
                      SamplingParams(max_tokens=max_tokens), arrival_time=arrival_time)
    return request


def step(sched) -> list[Request]:
    """One schedule + fake forward + postprocess; returns the requests admitted from `waiting`."""
    waiting_before = list(sched.waiting)
    out = sched.schedule()
    admitted = [r for r in waiting_before if r.status is RequestStatus.RUNNING]
    sampled = {s.request.request_id: (_TOKEN, None) for s in out.scheduled if s.samples}
    sched.postprocess(out, sampled)
    return admitted


def admission_order(sched, requests: list[Request]) -> list[str]:
    for r in requests:
        sched.add_request(r)
    order = []
    while sched.has_unfinished():
        order += [r.request_id for r in step(sched)]
    assert_no_leak(sched.block_manager)
    return order


# ---- the estimate and the order ---------------------------------------------------------------------
@pytest.mark.parametrize(("prompt_len", "max_tokens", "factor", "expected"), [
    (8, 100, 1.0, 8),  # the prompt times the factor is the smaller
    (8, 2, 1.0, 2),  # max_tokens is the smaller
    (8, 100, 4.0, 32),
    (8, 20, 4.0, 20),
    (10, 100, 0.25, 2.5),
])
def test_estimate_is_the_articles(prompt_len, max_tokens, factor, expected):
    policy = SchedulingPolicy("sjf", sjf_length_factor=factor)
    assert policy.estimated_len(job(prompt_len, max_tokens)) == expected


def test_sjf_admits_shorter_estimated_jobs_first():
    clock = FakeClock()
    sched = sjf_scheduler(clock, max_num_seqs=1)
    # Created (arrived) in this order; estimates 8, 4, 2, 4: ties keep arrival order.
    reqs = [job(8, 100, name="e8"), job(4, 50, name="e4a"), job(8, 2, name="e2"), job(6, 4, name="e4b")]
    assert admission_order(sched, reqs) == ["e2", "e4a", "e4b", "e8"]


def test_the_factor_changes_the_estimate_and_the_order():
    # Factor 1: estimates min(4, 30)=4 and min(8, 6)=6. Factor 10: min(40, 30)=30 and min(80, 6)=6.
    for factor, expected in ((1.0, ["short-prompt", "long-prompt"]), (10.0, ["long-prompt", "short-prompt"])):
        sched = sjf_scheduler(FakeClock(), factor=factor, max_num_seqs=1)
        reqs = [job(4, 30, name="short-prompt"), job(8, 6, name="long-prompt")]
        assert admission_order(sched, reqs) == expected


def test_fcfs_is_arrival_order_and_priority_is_unchanged():
    def reqs():
        return [job(8, 100, name="a"), job(4, 50, name="b"), job(8, 2, name="c")]

    assert admission_order(make_scheduler(num_blocks=256, max_num_seqs=1), reqs()) == ["a", "b", "c"]
    prio = make_scheduler(num_blocks=256, max_num_seqs=1, scheduling_policy="priority")
    first, second, third = reqs()
    first.priority, second.priority, third.priority = 2, 1, 1
    assert admission_order(prio, [first, second, third]) == ["b", "c", "a"]


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_a_priority_needs_the_priority_policy(policy):
    sched = make_scheduler(scheduling_policy=policy)
    request = job(4, 4, name="vip")
    request.priority = -1
    with pytest.raises(ValueError) as e:
        sched.add_request(request)
    assert str(e.value) == f"request vip: priority=-1 needs scheduling_policy='priority' (this engine runs {policy!r})"
    assert not sched.has_unfinished()


def test_sjf_orders_a_decode_nodes_waiting_for_kv():
    clock = FakeClock()
    sched = sjf_scheduler(clock, max_num_seqs=1)
    remote = [job(8, 64, name="long"), job(8, 3, name="short")]
    for r in remote:
        r.append_output(_TOKEN)  # the prefill node's first token
        sched.add_remote(r)
    assert [r.request_id for r in sched.schedule_remote_kv()] == ["short"]
    for r in remote:
        sched.abort(r.request_id)
    assert_no_leak(sched.block_manager)


# ---- aging ----------------------------------------------------------------------------------------
def stream_of_short_jobs(aging_s: float, num_steps: int) -> tuple[Request, list[tuple[float, Request]]]:
    """One seat; at t=0 a short job and a long one arrive, then one short job every second (1 s per
    step; a short job holds the seat for 2 steps, so the short ones alone keep the seat busy and
    their queue grows). Returns the long job and every (time, request) admission."""
    clock = FakeClock()
    sched = sjf_scheduler(clock, aging_s=aging_s, max_num_seqs=1)
    long_job = job(64, 64, 0.0, name="long")  # estimate 64
    sched.add_request(job(8, 2, 0.0, name="short-0"))  # estimate 2
    sched.add_request(long_job)
    admissions = []
    for i in range(1, num_steps + 1):
        admissions += [(clock.now, r) for r in step(sched)]
        clock.now = float(i)
        sched.add_request(job(8, 2, clock.now, name=f"short-{i}"))
    return long_job, admissions


def test_aging_admits_a_long_job_within_the_limit_under_a_stream_of_short_ones():
    aging_s = 10.0
    long_job, admissions = stream_of_short_jobs(aging_s, num_steps=40)
    admitted_at = {r.request_id: t for t, r in admissions}
    # SJF first: short jobs that arrived after the long one went ahead of it...
    assert sum(1 for t, r in admissions if r is not long_job and r.arrival_time > 0 and t < admitted_at["long"]) >= 3
    # ...until its estimate, aged, fell below theirs; at the latest once it had waited the aging
    # limit, then at the next free seat (a short job holds the seat 2 s).
    assert admitted_at["long"] - long_job.arrival_time <= aging_s + 2.0


def test_without_aging_the_long_job_starves():
    """The test above can fail: with aging off, the same stream never lets the long job in."""
    long_job, admissions = stream_of_short_jobs(math.inf, num_steps=40)
    assert long_job not in [r for _, r in admissions] and long_job.status is RequestStatus.WAITING


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 24), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=16),
    st.sampled_from([1.0, 3.0, 8.0]),
    st.integers(1, 3),
    st.sampled_from([10, 24]),
)
def test_no_request_is_overtaken_after_waiting_the_aging_limit(specs, aging_s, max_num_seqs, num_blocks):
    """Property: random arrivals (lengths, output lengths, gaps), one step a second, a pool tight
    enough to preempt. Whenever a request is admitted from the waiting queue, no request still
    waiting that arrived before it has waited the aging limit. Everything finishes, nothing leaks."""
    clock = FakeClock()
    sched = sjf_scheduler(clock, aging_s=aging_s, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                          max_num_batched_tokens=16, max_model_len=num_blocks * 4)
    arrivals, t = [], 0.0
    for i, (prompt_len, max_tokens, gap) in enumerate(specs):
        t += gap
        arrivals.append(job(prompt_len, max_tokens, t, name=f"r{i}"))
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0].arrival_time <= clock.now:
            sched.add_request(arrivals.pop(0))
        still = list(sched.waiting)
        for admitted in step(sched):
            for other in still:
                if other.status is RequestStatus.WAITING and other.arrival_time < admitted.arrival_time:
                    assert clock.now - other.arrival_time < aging_s, (other.request_id, admitted.request_id)
        sched.block_manager.check_invariants()
        clock.now += 1.0
        assert clock.now < 10_000, "the workload did not finish"
    assert_no_leak(sched.block_manager)


# ---- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"scheduling_policy": "sjf2"}, "scheduling_policy must be one of fcfs, priority, sjf, got 'sjf2'"),
    ({"sjf_length_factor": 0}, "sjf_length_factor must be a finite number > 0, got 0"),
    ({"sjf_length_factor": math.inf}, "sjf_length_factor must be a finite number > 0, got inf"),
    ({"sjf_length_factor": "2"}, "sjf_length_factor must be a finite number > 0, got '2'"),
    ({"sjf_aging_s": 0.0}, "sjf_aging_s must be a number > 0 (inf: no aging), got 0.0"),
    ({"sjf_aging_s": math.nan}, "sjf_aging_s must be a number > 0 (inf: no aging), got nan"),
    ({"sjf_aging_s": True}, "sjf_aging_s must be a number > 0 (inf: no aging), got True"),
])
def test_config_values_are_checked_with_one_line_errors(kwargs, message):
    from pdserve.engine.config import EngineConfig

    for make in (lambda: SchedulerConfig(**kwargs), lambda: EngineConfig(model_path="unused", **kwargs)):
        with pytest.raises(ValueError) as e:
            make()
        assert str(e.value) == message and "\n" not in str(e.value)


def test_inf_aging_is_accepted():
    assert SchedulerConfig(scheduling_policy="sjf", sjf_aging_s=math.inf).policy.sjf_aging_s == math.inf


# ---- through the engine -----------------------------------------------------------------------------
def test_llm_engine_runs_shortest_job_first(tiny_llama):
    from pdserve.engine.llm import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_threads=2, max_num_seqs=1, kv_cache_memory_gb=0.05,
              scheduling_policy="sjf", sjf_length_factor=1.0)
    engine = llm.engine
    for name, prompt_len, max_tokens in (("long", 8, 8), ("short", 8, 2), ("mid", 4, 8)):  # estimates 8, 2, 4
        engine.add_request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           request_id=name)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["short", "mid", "long"]
    assert_no_leak(engine.block_manager)
    with pytest.raises(ValueError, match="^scheduling_policy must be one of fcfs, priority, sjf, got 'lifo'$"):
        LLM(str(tiny_llama), dtype="float32", scheduling_policy="lifo")
