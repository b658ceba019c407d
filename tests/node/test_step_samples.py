"""Engine step samples in heartbeats (node/step_samples.py): one row per engine step, every
router's heartbeats carry each row once (the rows since that router's last heartbeat, newest
last, at most MAX_STEP_SAMPLES), and the heartbeat names the role served now."""

from __future__ import annotations

import time

from pdserve.node.step_samples import StepSamples
from pdserve.protocol.messages import MAX_STEP_SAMPLES, Heartbeat, PrefillRequest
from tests.kvtransfer.test_node_metrics import make_engine
from tests.node.test_router_links import FakeRouter, make_links


def test_since_hands_out_each_row_once_and_keeps_the_newest():
    samples = StepSamples()
    assert samples.since(0) == ([], 0)
    samples.record(16, 0, 0, 0.5)
    samples.record(0, 2, 40, 0.25)
    rows, seq = samples.since(0)
    assert rows == [[16.0, 0.0, 0.0, 0.5], [0.0, 2.0, 40.0, 0.25]] and seq == 2
    assert samples.since(seq) == ([], 2)  # nothing new
    other, _ = samples.since(0)  # another router's cursor: the same rows
    assert other == rows
    for i in range(MAX_STEP_SAMPLES + 10):
        samples.record(i, 1, 1, 0.0)
    rows, seq = samples.since(2)
    assert len(rows) == MAX_STEP_SAMPLES and rows[-1][0] == MAX_STEP_SAMPLES + 9  # the newest, last
    assert seq == MAX_STEP_SAMPLES + 12
    assert Heartbeat("n", 0, 0, 0, 0, step_samples=rows).wire_error() is None


def test_every_router_gets_every_step_once_with_the_role(tiny_llama, no_leak):
    from pdserve.prefill_node.node import PrefillNode

    routers = [FakeRouter(), FakeRouter()]
    links = make_links([r.addr for r in routers])
    engine = make_engine(tiny_llama)
    node = PrefillNode(engine, links, role="both")  # colocated: prefill and decode steps
    links.register()
    try:
        assert node.steps is links.step_samples
        node.handle(PrefillRequest("r1", list(range(3, 40)), {"max_tokens": 5, "temperature": 0, "ignore_eos": True}))
        while not node.is_idle():
            node.run_once()
        node.link.set_heartbeat(node.heartbeat())
        rows, _ = node.steps.since(0)
        assert len(rows) == node.steps.num_recorded == 5  # one prefill step, four decode steps
        assert rows[0][:3] == [37.0, 0.0, 0.0] and all(r[3] > 0 for r in rows)
        assert [r[:3] for r in rows[1:]] == [[0.0, 1.0, float(37 + i)] for i in range(1, 5)]
        for router in routers:
            deadline = time.monotonic() + 5
            while True:
                router.recv_all(0.2)
                beats = [m for m in router.received if isinstance(m, Heartbeat)]
                got = [row for hb in beats for row in hb.step_samples]
                if len(got) >= len(rows) or time.monotonic() > deadline:
                    break
            assert got == rows  # each step once, in order
            assert all(hb.role == "both" for hb in beats)
    finally:
        links.close()
        for r in routers:
            r.close()
    no_leak(engine.block_manager)
