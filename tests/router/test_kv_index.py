"""The exact KV index: the keys a router computes match the engine's, events and snapshots keep it
equal to the nodes' caches (through the node's publisher, with a fake link), gaps ask for a
resync, nodes that leave are forgotten, and routing reads it."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.node.kv_events import KVEventPublisher
from pdserve.protocol.messages import Deregister, Heartbeat, KVEvents, KVResync, Register, decode
from pdserve.router.kv_index import KVIndex, prompt_keys
from pdserve.router.registry import Registry
from tests.router.test_node_messages import Parts

pytestmark = pytest.mark.timeout(60)

BS = 4


class FakeLink:
    """What the publisher reads of a RouterLink: it registered, how often, and what it sent
    (encoded and decoded, as on the wire)."""

    def __init__(self, addr: str = "tcp://r0") -> None:
        self.router_addr = addr
        self.registered = True
        self.num_registers = 1
        self.kv_resync = False
        self.sent: list[KVEvents] = []

    def send(self, msg) -> bool:
        self.sent.append(decode(msg.encode()))
        return True

    def each(self) -> list[FakeLink]:
        return [self]

    def take(self) -> list[KVEvents]:
        out, self.sent = self.sent, []
        return out


def _fill(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """A request prefilled whole, then finished: its full blocks stay cached (evictable)."""
    hits = bm.get_computed_blocks(tokens)
    bm.allocate(rid, len(tokens), hits)
    bm.cache_full_blocks(rid, tokens, len(tokens))
    bm.free(rid)


def test_router_keys_are_the_engines_keys():
    bm = BlockManager(64, BS)
    tokens = list(range(100, 123))  # 5 full blocks and 3 tokens
    bm.allocate("r", len(tokens))
    bm.cache_full_blocks("r", tokens, len(tokens))
    assert prompt_keys(tokens + [7], BS) == bm.keys["r"]  # with one more token, every full block counts
    assert prompt_keys(tokens[:20], BS) == bm.keys["r"][:4]  # the last token is always computed: 4 of 5
    assert prompt_keys(tokens[:4], BS) == []


def test_keys_are_equal_across_processes():
    tokens = list(range(50_000, 50_040))
    code = f"from pdserve.router.kv_index import prompt_keys; print(prompt_keys({tokens!r}, 16))"
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": seed}).stdout for seed in ("0", "12345")]
    assert out[0] == out[1] == f"{prompt_keys(tokens, 16)}\n"


def test_index_applies_snapshots_and_deltas_and_sees_gaps():
    index = KVIndex()
    index.reset_node("n")
    assert not index.apply(KVEvents("n", seq=3, prev_seq=2, stored=[1]))  # no snapshot yet: ask for one
    assert index.apply(KVEvents("n", seq=3, prev_seq=0, stored=[1, 2, 3], reset=True))
    assert index.apply(KVEvents("n", seq=5, prev_seq=3, stored=[4], removed=[2]))
    assert index.nodes["n"].tiers["memory"] == {1, 3, 4}
    assert index.apply(KVEvents("n", seq=6, prev_seq=5, tier="disk", stored=[2]))
    assert index.cached_tokens("n", [1, 2, 3, 9], BS) == 3 * BS  # block 2 is on disk: still held
    assert not index.apply(KVEvents("n", seq=9, prev_seq=7, stored=[5]))  # 7 != 6: a gap
    assert index.num_gaps == 2 and not index.knows(["n"]) and index.cached_tokens("n", [1], BS) == 0
    assert index.apply(KVEvents("n", seq=9, prev_seq=0, stored=[5], reset=True))
    assert index.nodes["n"].tiers["memory"] == {5}
    assert index.cached_tokens("n", [1], 8) == 0  # another block size: the keys mean other blocks
    index.drop("n")
    assert index.num_blocks == 0 and index.cached_tokens("n", [5], BS) == 0


def test_publisher_keeps_the_index_equal_to_the_cache_through_evictions_and_resyncs():
    rng = random.Random(0)
    bm = BlockManager(24, BS)
    pub = KVEventPublisher(bm, "n", interval_s=0.0, max_keys=7)  # small messages: snapshots are split
    link, index = FakeLink(), KVIndex()
    index.reset_node("n")

    def deliver() -> None:
        pub.publish(link, force=True)
        for msg in link.take():
            if not index.apply(msg):
                link.kv_resync = True  # the router's KVResync, as the link's poll would note it

    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((9, 17, 30)))] for _ in range(12)]
    for step in range(200):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(6))]
        _fill(bm, f"r{step}", tokens)
        bm.check_invariants()
        if step % 3 == 0:
            deliver()
            assert index.nodes["n"].tiers["memory"] == set(bm.cached), step
        if step == 50:  # a message lost: the index sees the gap and the node sends a snapshot
            pub.publish(link, force=True)
            link.take()
            _fill(bm, "lost", rng.choice(prefixes) + [1, 2, 3, 4, 5])
            deliver()  # the gap is seen here ...
            deliver()  # ... and the snapshot mends it
            assert index.nodes["n"].tiers["memory"] == set(bm.cached)
        if step == 120:  # the node registers again (the router restarted): a snapshot follows
            link.num_registers += 1
            index.reset_node("n")
            deliver()
            assert index.nodes["n"].tiers["memory"] == set(bm.cached)
    deliver()
    assert index.nodes["n"].tiers["memory"] == set(bm.cached)
    assert pub.num_snapshots == 3  # the first, after the gap, after the new Register
    assert len(pub.log._events) == 0  # every router read everything: the log is trimmed


def test_a_reader_that_fell_behind_the_log_gets_a_snapshot():
    bm = BlockManager(16, BS)
    pub = KVEventPublisher(bm, "n", interval_s=0.0)
    pub.log.max_events = 4
    slow, fast = FakeLink("tcp://slow"), FakeLink("tcp://fast")

    class Links:
        @staticmethod
        def each():
            return [slow, fast]

    pub.publish(Links, force=True)
    slow.registered = False  # not published to (its router went quiet)
    for i in range(6):
        _fill(bm, f"r{i}", [i * 10 + j for j in range(9)])
        pub.publish(Links, force=True)
    slow.registered = True
    slow.take()
    pub.publish(Links, force=True)
    (snapshot,) = slow.take()
    assert snapshot.reset and set(snapshot.stored) == set(bm.cached)


def _registry_with_caches(prefill_loads=(0, 0)) -> Registry:
    reg = Registry()
    for i, load in enumerate(prefill_loads):
        reg.register(Register(f"p{i}", "prefill", "m", num_total_blocks=100, block_size=BS), f"p{i}".encode())
        reg.heartbeat(Heartbeat(f"p{i}", 100, 100, 0, 0, num_outstanding_tokens=load))
    for i in range(2):
        reg.register(Register(f"d{i}", "decode", "m", kv_addr=f"tcp://d{i}", num_total_blocks=100, block_size=BS),
                     f"d{i}".encode())
        reg.heartbeat(Heartbeat(f"d{i}", 100, 100, 0, 0))
    for node_id in reg.nodes:
        reg.kv_index.apply(KVEvents(node_id, 0, 0, reset=True))
    return reg


def _hold(reg: Registry, node_id: str, tokens: list[int]) -> None:
    cache = reg.kv_index.nodes[node_id]
    cache.tiers["memory"] |= set(prompt_keys(tokens + [0], BS))  # every full block of `tokens`


def test_prefill_goes_where_the_prefix_is_unless_its_queue_costs_more():
    history = list(range(1, 41))  # 40 tokens: 10 blocks, cached for a prompt that extends it
    prompt = history + [99, 98]
    reg = _registry_with_caches(prefill_loads=(0, 10))
    _hold(reg, "p1", history)
    route = reg.route(prompt, 8)
    assert route.prefill.node_id == "p1" and route.cached_tokens == 40 and route.prompt_tokens == 42
    reg = _registry_with_caches(prefill_loads=(0, 100))  # p1's queue costs more than its 40 cached tokens
    _hold(reg, "p1", history)
    assert reg.route(prompt, 8).prefill.node_id == "p0"


def test_a_follow_up_turn_is_prefilled_on_the_decode_node_that_holds_its_history():
    history = list(range(1, 61))
    reg = _registry_with_caches()
    _hold(reg, "d1", history)
    route = reg.route(history + [7] * 10, 8)
    assert route.local and route.prefill.node_id == "d1" and route.path.reason == "cached"
    long_new = history + [7] * 300  # more new tokens than --cached-prefill-max-tokens: a prefill node
    route = reg.route(long_new, 8)
    assert not route.local and route.decode.node_id == "d1"  # still decoded where the history is
    reg.path.cached_prefill_max_tokens = 0  # off
    assert not reg.route(history + [7] * 10, 8).local
    reg.path.cached_prefill_max_tokens = 256
    for _ in range(5):  # d1 carries DECODE_SLACK more requests than d0: load wins over the cache
        reg.nodes["d1"].request_ids.add(f"x{_}")
    assert reg.route(history + [7] * 10, 8).decode.node_id == "d0"


def test_auto_counts_only_the_tokens_each_node_must_compute():
    from pdserve.router.disagg import NodeLoad, PathPolicy
    from pdserve.router.speed import StepModel

    speed = StepModel()
    speed.add([[512, 0, 0, 0.5]] * 40 + [[0, 8, 800, 0.02]] * 40)
    policy = PathPolicy("auto", cached_prefill_max_tokens=0)
    d, p = NodeLoad("d", speed, 0, 8, 800), NodeLoad("p", speed, 0, 0, 0)
    assert not policy.choose(4000, d, p, prefill_cached=3900).local  # 100 tokens there beat 4000 here
    assert policy.choose(4000, d, p, decode_cached=3900).local  # 100 tokens here beat 4000 + a hand-off
    assert not policy.choose(4000, d, p, decode_cached=2000, prefill_cached=3900).local


def test_the_index_forgets_nodes_that_leave():
    parts = Parts(heartbeat_timeout_s=5.0)
    reg = parts.registry
    parts.handle(Register("d0", "decode", "m", kv_addr="tcp://d0", num_total_blocks=10))
    parts.handle(KVEvents("d0", 2, 0, stored=[11, 12], reset=True))
    assert reg.kv_index.nodes["d0"].tiers["memory"] == {11, 12}
    parts.handle(KVEvents("d0", 5, 4, stored=[13]))  # a gap: KVResync, nothing applied
    (_, node_id, resync), = parts.dispatcher.named("send")
    assert node_id == "d0" and isinstance(resync, KVResync)
    assert reg.kv_index.nodes["d0"].tiers["memory"] == {11, 12} and not reg.kv_index.knows(["d0"])
    parts.handle(Register("d0", "decode", "m", kv_addr="tcp://d0", num_total_blocks=10))
    assert reg.kv_index.nodes["d0"].num_blocks == 0  # registered again: its snapshot follows
    parts.handle(KVEvents("d0", 1, 0, stored=[11], reset=True))
    parts.handle(Deregister("d0"))
    assert "d0" not in reg.kv_index.nodes
    parts.handle(KVEvents("d0", 2, 1, stored=[12]))  # from a node that left: ignored
    assert "d0" not in reg.kv_index.nodes
    parts.handle(Register("d1", "decode", "m", kv_addr="tcp://d1", num_total_blocks=10))
    parts.handle(KVEvents("d1", 1, 0, stored=[11], reset=True))
    reg.expire(now=1e12)  # missed heartbeats
    assert reg.kv_index.nodes == {}


def test_staleness_and_prefix_metrics():
    parts = Parts()
    parts.handle(Register("p0", "prefill", "m", num_total_blocks=10))
    import time
    parts.handle(KVEvents("p0", 1, 0, stored=[1], reset=True, sent_at=time.time() - 0.02))
    text = asyncio.run(_render(parts))
    assert "pdserve_router_kv_event_staleness_seconds_count 1.0" in text
    assert 'pdserve_router_kv_events_total{op="stored"} 1.0' in text


async def _render(parts) -> str:
    from prometheus_client import generate_latest
    return generate_latest(parts.metrics.registry).decode()
