"""The KV tier below the pool (engine/kv_tier.py): the backends' put/get/LRU/cap/drop and digest
check, the block manager's offload-on-evict and load-on-hit bookkeeping, and an engine whose tiny
pool is backed by a disk (or host) tier: exact greedy outputs, hits served from the tier, a
corrupted tier file detected and recomputed, files removed on close, clear errors for bad flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.args import add_engine_args, engine_kwargs
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.kv_tier import BlockTier, DiskTier, HostTier, KVTier, make_tier
from tests.conftest import assert_no_leak, make_block_manager

pytestmark = pytest.mark.timeout(120)

BACKENDS = ["disk", "host"]


def make(kind: str, block_bytes: int = 64, capacity: int = 3, tmp_path=None) -> KVTier:
    return DiskTier(block_bytes, capacity, tmp_path) if kind == "disk" else HostTier(block_bytes, capacity)


def block(value: int, n: int = 64) -> torch.Tensor:
    return torch.arange(n, dtype=torch.uint8) ^ value


def corrupt_slot(tier: DiskTier, key: int, at: int = 5) -> None:
    offset = tier.slot_offset(key)
    with open(tier.path, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)[0]
        f.seek(offset + at)
        f.write(bytes([byte ^ 0x40]))


# ---- the backends -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", BACKENDS)
def test_put_get_lru_cap_drop(kind, tmp_path):
    tier = make(kind, tmp_path=tmp_path)
    events = []
    tier.listener = lambda key, stored: events.append((key, stored))
    for key in (10, -11, 12):  # keys are Python hashes: negative ones too
        tier.put(key, block(key & 0xFF))
    assert len(tier) == 3 and tier.keys() == [10, -11, 12] and -11 in tier
    assert torch.equal(tier.get(10), block(10))  # 10 is now the most recently used
    tier.put(13, block(13))  # full: the least recently used (-11) goes
    assert tier.keys() == [12, 10, 13] and -11 not in tier
    assert tier.get(-11) is None
    tier.put(12, block(99))  # held already: refreshed, not rewritten
    assert tier.keys() == [10, 13, 12] and torch.equal(tier.get(12), block(12))
    assert tier.drop(13) and not tier.drop(13)
    assert tier.keys() == [10, 12]
    assert (tier.hits, tier.misses, tier.puts, tier.evictions, tier.corrupt) == (2, 1, 4, 1, 0)
    assert tier.bytes_written == 4 * 64 and tier.bytes_read == 2 * 64 and tier.bytes_used == 2 * 64
    assert events == [(10, True), (-11, True), (12, True), (-11, False), (13, True), (13, False)]
    with pytest.raises(ValueError, match="64 bytes"):
        tier.put(14, torch.zeros(63, dtype=torch.uint8))
    tier.close()


def test_disk_tier_detects_a_corrupted_slot(tmp_path):
    tier = DiskTier(64, 4, tmp_path)
    events = []
    tier.listener = lambda key, stored: events.append((key, stored))
    tier.put(1, block(1))
    tier.put(2, block(2))
    corrupt_slot(tier, 2)
    assert tier.get(2) is None  # failed its digest: dropped
    assert tier.corrupt == 1 and 2 not in tier and tier.keys() == [1] and events[-1] == (2, False)
    assert torch.equal(tier.get(1), block(1))  # the others are untouched
    tier.put(2, block(2))  # the slot is reused
    assert torch.equal(tier.get(2), block(2))
    tier.close()


def test_disk_tier_file_is_capped_and_removed_on_close(tmp_path):
    tier = make_tier("disk", 1000, 0.5 / 1024, directory=tmp_path)  # 0.5 MiB of 1000-byte blocks
    assert tier.capacity == 524
    assert tier.path.parent.parent == tmp_path and tier.path.exists()
    assert tier.path.stat().st_size == tier.capacity * tier.slot_bytes
    for key in range(600):
        tier.put(key, torch.full((1000,), key % 256, dtype=torch.uint8))
    assert len(tier) == 524 and tier.evictions == 600 - 524
    tier.close()
    tier.close()  # idempotent
    assert not tier.directory.exists() and tmp_path.exists()
    with pytest.raises(ValueError, match="holds no block"):
        make_tier("disk", 1 << 20, 0.0001)


# ---- the block manager's hooks ----------------------------------------------------------------
class FakeTier:
    """BlockTier's interface over a dict; records which key each block's bytes came from."""

    def __init__(self, fail: set[int] = frozenset()):
        self.store: set[int] = set()
        self.fail = set(fail)
        self.loaded: dict[int, int] = {}  # block id → key its bytes came from
        self.offloads: list[tuple[int, int]] = []
        self.listener = None

    def offload(self, key, block_id):
        self.offloads.append((key, block_id))
        if key not in self.store:
            self.store.add(key)
            if self.listener:
                self.listener(key, True)

    def load(self, key, block_id):
        if key in self.fail:
            self.store.discard(key)
            if self.listener:
                self.listener(key, False)
            return False
        self.loaded[block_id] = key
        return True

    def touch(self, key):
        return key in self.store

    def __contains__(self, key):
        return key in self.store

    def keys(self):
        return list(self.store)


def fill(bm, request_id, tokens):
    """A request that computed `tokens` and finished: its full blocks cached and evictable."""
    bm.allocate(request_id, len(tokens))
    bm.cache_full_blocks(request_id, tokens, len(tokens))
    bm.free(request_id)
    bm.check_invariants()


def test_evicted_blocks_go_to_the_tier_and_come_back_as_hits():
    bm = make_block_manager(4, 2)
    tier = FakeTier()
    bm.attach_tier(tier)
    bm.events = KVEventLog()
    a, b = list(range(1, 9)), list(range(20, 28))
    fill(bm, "a", a)
    keys_a = list(bm.cached)
    fill(bm, "b", b)  # takes every block: A's four go to the tier first
    assert {k for k, _ in tier.offloads} == set(keys_a) and bm.num_tier_offloads == 4
    assert all(k not in bm.cached for k in keys_a)
    hits = bm.get_computed_blocks(a + [9])
    bm.check_invariants()
    assert len(hits) == 4 and [bm.block_keys[h] for h in hits] == keys_a
    assert all(tier.loaded[h] == bm.block_keys[h] for h in hits)
    assert bm.num_tier_hits == 8 and bm.num_prefix_hits == 8
    # The pool cannot hold A's 5 blocks plus nothing: admission fails and the loaded blocks stay cached.
    assert not bm.can_allocate("a2", 9, hits)
    assert all(bm.ref_counts[h] == 0 and h in bm.evictable for h in hits)
    bm.allocate("a3", 8, hits)  # a request that fits takes them as hits
    bm.check_invariants()
    assert bm.block_ids("a3") == hits
    bm.free("a3")
    assert_no_leak(bm)
    changes = bm.events.since(0)
    assert set(changes["disk"][0]) == set(tier.store) and set(keys_a) <= set(changes["memory"][0])
    assert sorted(bm.tier_keys()) == sorted(tier.store)


def test_loads_never_evict_the_requests_own_hits():
    bm = make_block_manager(4, 2)
    tier = FakeTier()
    bm.attach_tier(tier)
    a = list(range(1, 9))
    fill(bm, "a", a)
    bm.allocate("x", 4)  # two blocks: A's last two (least recently used) go to the tier
    assert len(tier.store) == 2
    hits = bm.get_computed_blocks(a + [9])
    bm.check_invariants()
    assert len(hits) == 2 and not tier.loaded  # no room but A's own hits: no load
    assert all(bm.block_keys[h] is not None for h in hits)
    bm.free("x")
    hits = bm.get_computed_blocks(a + [9])
    bm.check_invariants()
    assert len(hits) == 4 and len(tier.loaded) == 2 and len(set(hits)) == 4
    assert_no_leak(bm)


def test_a_failed_load_ends_the_chain():
    bm = make_block_manager(4, 2)
    a = list(range(1, 9))
    tier = FakeTier()
    bm.attach_tier(tier)
    fill(bm, "a", a)
    keys_a = list(bm.cached)
    fill(bm, "b", list(range(20, 28)))
    tier.fail = {keys_a[2]}
    hits = bm.get_computed_blocks(a + [9])
    bm.check_invariants()
    assert len(hits) == 2 and bm.num_tier_failed_loads == 1 and keys_a[2] not in tier
    assert_no_leak(bm)


def test_no_load_while_swap_outs_are_pending():
    bm = make_block_manager(4, 2)
    tier = FakeTier()
    bm.attach_tier(tier)
    a = list(range(1, 9))
    fill(bm, "a", a)
    fill(bm, "b", list(range(20, 28)))
    assert bm.get_computed_blocks(a + [9], load=False) == [] and not tier.loaded
    assert_no_leak(bm)


def test_a_tier_needs_prefix_caching():
    bm = make_block_manager(4, 2, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        bm.attach_tier(FakeTier())


def test_block_tier_round_trips_a_pool_block(tmp_path):
    pools = [torch.randn(2, 2, 5, 4, 2, 3), torch.randn(1, 2, 5, 4, 1, 3).to(torch.bfloat16)]
    tier = make_tier("disk", BlockTier.block_bytes(pools), 0.001, directory=tmp_path)
    bt = BlockTier(tier, pools)
    want = [p[:, :, 3].clone() for p in pools]
    bt.offload(7, 3)
    for p in pools:
        p[:, :, 3] = 0
    assert bt.load(7, 1)
    assert all(torch.equal(p[:, :, 1], w) for p, w in zip(pools, want))
    assert not bt.load(8, 2)
    tier.close()


# ---- an engine over a tiny pool -----------------------------------------------------------------
BLOCK = 8
PROMPT_A = [(7 * i + 3) % 250 for i in range(64)]
OTHERS = [[(11 * i + 5 * j + 1) % 250 for i in range(64)] for j in range(1, 5)]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def tiny_llm(path, **kw):
    return LLM(str(path), dtype="float32", num_threads=2, block_size=BLOCK, num_kv_blocks=16,
               skip_tokenizer_init=True, **kw)


def run_checked(llm, prompt):
    """One request alone, the block manager's books checked after every step."""
    engine = llm.engine
    request_id = engine.add_request(prompt, GREEDY)
    done = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                done = out
        engine.block_manager.check_invariants()
    return done


def a_then_others_then_a(llm, between=None):
    first = run_checked(llm, PROMPT_A)
    for prompt in OTHERS:  # 4 x 9 blocks through a 16-block pool: A's blocks are evicted
        run_checked(llm, prompt)
    assert all(k not in llm.engine.block_manager.cached for k in keys_of(PROMPT_A))
    if between is not None:
        between(llm)
    return first, run_checked(llm, PROMPT_A)


def keys_of(prompt):
    keys, parent = [], 0
    for start in range(0, len(prompt) - BLOCK, BLOCK):
        parent = hash((parent, tuple(prompt[start : start + BLOCK])))
        keys.append(parent)
    return keys


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with tiny_llm(tiny_llama) as llm:
        first, again = a_then_others_then_a(llm)
        assert again.num_cached_tokens == 0  # without a tier, A is recomputed
        assert first.token_ids == again.token_ids
        return again.token_ids


@pytest.mark.parametrize("kind", BACKENDS)
def test_engine_serves_evicted_blocks_from_the_tier_exactly(tiny_llama, reference, kind, tmp_path):
    kw = {"kv_offload_dir": str(tmp_path)} if kind == "disk" else {}
    with tiny_llm(tiny_llama, kv_offload=kind, kv_offload_gb=0.01, **kw) as llm:
        bm = llm.engine.block_manager
        bm.events = KVEventLog()
        first, again = a_then_others_then_a(llm)
        tier = llm.engine.kv_tier
        assert first.token_ids == reference and again.token_ids == reference
        assert again.num_cached_tokens == 7 * BLOCK  # every full block but the last token's
        assert tier.hits == 7 and bm.num_tier_hits == 7 * BLOCK and tier.corrupt == 0
        assert tier.puts > 0 and bm.num_tier_offloads > 0
        assert sorted(bm.tier_keys()) == sorted(tier.keys())
        assert set(bm.events.since(0)["disk"][0]) == set(tier.keys())
        assert_no_leak(bm)
        if kind == "disk":
            directory = tier.directory
            assert directory.parent == tmp_path and tier.path.exists()
    if kind == "disk":
        assert not directory.exists() and tmp_path.exists()  # the node's file goes with the engine


def test_engine_recomputes_a_corrupted_tier_block(tiny_llama, reference, tmp_path):
    keys = keys_of(PROMPT_A)

    def corrupt(llm):
        corrupt_slot(llm.engine.kv_tier, keys[3], at=100)

    with tiny_llm(tiny_llama, kv_offload="disk", kv_offload_gb=0.01, kv_offload_dir=str(tmp_path)) as llm:
        _, again = a_then_others_then_a(llm, corrupt)
        tier, bm = llm.engine.kv_tier, llm.engine.block_manager
        assert again.token_ids == reference  # exact: the bad block and the rest were recomputed
        assert tier.corrupt == 1 and again.num_cached_tokens == 3 * BLOCK and tier.hits == 3
        assert bm.num_tier_failed_loads == 1
        assert keys[3] not in tier and keys[3] in bm.cached  # dropped from the tier, recomputed into memory
        assert_no_leak(bm)


# ---- flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(kv_offload="ssd"), "kv_offload .*none, host, disk"),
    (dict(kv_offload="disk", kv_offload_gb=0), "kv_offload_gb"),
    (dict(kv_offload="disk", kv_offload_gb=-1.5), "kv_offload_gb"),
    (dict(kv_offload="host", kv_offload_dir="/tmp"), "kv_offload_dir"),
    (dict(kv_offload="disk", tensor_parallel_size=2), "--kv-offload needs --tensor-parallel-size 1"),
    (dict(kv_offload="disk", enable_prefix_caching=False), "prefix caching"),
])
def test_bad_flags_are_one_line_errors(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match) as e:
        EngineConfig(model_path=tmp_path, **kw)
    assert "\n" not in str(e.value)


def test_flag_parsing(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-offload", "disk", "--kv-offload-gb", "2",
                                              "--kv-offload-dir", str(tmp_path)]))
    assert (kwargs["kv_offload"], kwargs["kv_offload_gb"], kwargs["kv_offload_dir"]) == ("disk", 2.0, str(tmp_path))
    assert engine_kwargs(parser.parse_args([]))["kv_offload"] == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-offload", "ssd"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_nodes_kv_events_index_its_tier_and_metrics_count_it(tiny_llama, tmp_path):
    """A node's publisher reports both tiers; a router's index built from them finds prompt A's
    evicted blocks on the disk tier (so routing counts them as cached there); /metrics counts them."""
    from pdserve.node.kv_events import KVEventPublisher
    from pdserve.node.metrics import NodeMetrics, engine_snapshot
    from pdserve.router.kv_index import KVIndex, prompt_keys
    from tests.router.test_kv_index import FakeLink

    with tiny_llm(tiny_llama, kv_offload="disk", kv_offload_gb=0.01, kv_offload_dir=str(tmp_path)) as llm:
        bm = llm.engine.block_manager
        pub, link, index = KVEventPublisher(bm, "n", interval_s=0.0), FakeLink(), KVIndex()
        index.reset_node("n")
        run_checked(llm, PROMPT_A)
        pub.publish(link, force=True)  # the snapshot: memory, and the (empty) disk tier
        for prompt in OTHERS:
            run_checked(llm, prompt)
            pub.publish(link, force=True)
        for msg in link.take():
            assert index.apply(msg)
        tiers = index.nodes["n"].tiers
        assert tiers["memory"] == set(bm.cached) and tiers["disk"] == set(llm.engine.kv_tier.keys())
        assert index.cached_tokens("n", prompt_keys(PROMPT_A, BLOCK), BLOCK) == 7 * BLOCK  # all on disk now
        metrics = NodeMetrics("n", "prefill")
        metrics.watch(lambda: engine_snapshot(llm.engine))
        text = metrics.render().decode()
        assert f'pdserve_kv_tier_puts_total{{node_id="n",role="prefill"}} {float(llm.engine.kv_tier.puts)}' in text


def test_a_killed_nodes_disk_tier_is_removed_by_the_next_one(tmp_path):
    """A tier whose process died (-9: nothing ran) leaves its directory; the next disk tier under
    the same directory removes it, and never a live tier's or one just being created."""
    import os
    import time

    from pdserve.engine.kv_tier import TIER_DIR_PREFIX

    live = DiskTier(64, 4, tmp_path)
    dead = tmp_path / f"{TIER_DIR_PREFIX}dead"
    dead.mkdir()
    (dead / "lock").write_text("")
    (dead / "blocks.bin").write_bytes(b"\0" * 1024)
    young = tmp_path / f"{TIER_DIR_PREFIX}young"  # being created: its lock not taken yet
    young.mkdir()
    old = time.time() - 60
    for path in (dead, live.directory):
        os.utime(path, (old, old))
    newer = DiskTier(64, 4, tmp_path)
    assert newer.num_swept == 1 and not dead.exists()
    assert live.directory.exists() and young.exists()
    live.put(1, block(1))
    assert live.get(1) is not None  # untouched
    live.close()
    newer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [young.name]
