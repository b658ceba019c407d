"""KV hand-off between nodes of different tensor-parallel sizes: sender and receiver in one process
over tcp loopback, each rank's pool a hand-made shard (a plain tensor, or a /dev/shm segment of its
own). Every decode rank gets exactly its KV heads, from the prefill ranks holding them, over shared
memory and over ZMQ; the bytes each decode rank received are exactly its heads' share; one KVDone
per request, each request released once by the prefill side; a failed part fails the request; bad
layouts and pulls are refused with a clear error."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import zmq

from pdserve.engine.parallel.sharding import kv_head_range
from pdserve.kvcache.shard import KVShard
from pdserve.kvcache.shm_pool import SharedKVPool
from pdserve.kvtransfer import transport
from pdserve.kvtransfer.heads import Piece, cover, ranges_error
from pdserve.kvtransfer.layout import layout_shape
from pdserve.kvtransfer.payload import DTYPES, frame_to_tensor, gather_tokens
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.node.engine_wire import kv_shards
from pdserve.protocol.messages import (
    Handshake,
    HandshakeAck,
    KVData,
    KVDone,
    KVPull,
    KVRank,
    KVReady,
    decode,
)
from pdserve.protocol.sockets import endpoint, make_socket, send_msg

from .conftest import (
    EveryNthPull,
    Pair,
    ReleaseLog,
    kinds,
    make_layout,
    make_ready,
    pump,
    recv_msg_within,
    recv_within,
)

L, D, BS, NB = 2, 8, 8, 16  # layers, head_dim, block size, blocks
CASES = [(4, p, d) for p in (1, 2, 4) for d in (1, 2, 4)] + [(1, 1, 2), (1, 2, 1), (1, 4, 2)]  # (KV heads, P, D)
REQUESTS = {"r1": ([5, 2, 9, 14, 0], [3, 1, 6, 8, 10], 37), "r2": ([13, 4], [12, 15], 9)}  # src, dst blocks, tokens


def layout_for(num_kv_heads: int, dtype: str = "float32"):
    return make_layout(num_layers=L, head_dim=D, block_size=BS, num_blocks=NB, num_kv_heads=num_kv_heads, dtype=dtype)


def split(full: torch.Tensor, tp: int, make_tensor) -> list[KVShard]:
    """Rank r of `tp`: the heads kv_head_range gives it, copied out of `full` into make_tensor(shape)."""
    shards = []
    for r in range(tp):
        start, end = kv_head_range(r, tp, full.shape[4])
        tensor, shm = make_tensor(full[:, :, :, :, start:end].shape)
        tensor.copy_(full[:, :, :, :, start:end])
        shards.append(KVShard(r, start, end, tensor, shm))
    return shards


class TPPair(Pair):
    def __init__(self, sender, receiver, released, errors, full, src_shards, dst_shards):
        super().__init__(sender, receiver, released, errors)
        self.full, self.src_shards, self.dst_shards = full, src_shards, dst_shards
        self.dones: Counter[str] = Counter()  # KVDone messages the sender got, per request
        on_done = sender._on_done

        def count(peer, done):
            self.dones[done.request_id] += 1
            on_done(peer, done)
        sender._on_done = count

    def transfer_all(self, requests=REQUESTS) -> list:
        events = [e for rid, (src, dst, n) in requests.items() for e in self.transfer(rid, src, dst, n)]
        self.pump(lambda _: self.sender.num_held == 0)
        for _ in range(5):  # a second KVDone would arrive right behind the first
            self.sender.poll(5)
        return events

    def expected_rank_bytes(self, requests=REQUESTS) -> list[int]:
        num_tokens = sum(n for _, _, n in requests.values())
        itemsize = self.full.element_size()
        return [num_tokens * L * 2 * s.num_heads * D * itemsize for s in self.dst_shards]


@pytest.fixture
def make_tp_pair(closing):
    def make(num_kv_heads: int, prefill_tp: int, decode_tp: int, *, shm: bool = False, dtype: str = "float32",
             no_shm_ranks=(), **sender_kw) -> TPPair:
        layout = layout_for(num_kv_heads, dtype)
        full = torch.randn(layout_shape(layout), generator=torch.Generator().manual_seed(7)).to(DTYPES[dtype])

        def in_shm(shape):
            pool = SharedKVPool.create("tp", shape, full.dtype)
            closing(pool)
            return pool.tensor, pool

        src = split(full, prefill_tp, in_shm if shm else lambda shape: (torch.empty(shape, dtype=full.dtype), None))
        src = [KVShard(s.rank, s.head_start, s.head_end, s.tensor, None) if s.rank in no_shm_ranks else s for s in src]
        dst = split(torch.zeros_like(full), decode_tp, lambda shape: (torch.empty(shape, dtype=full.dtype), None))
        released, errors = ReleaseLog(), []
        sender = KVSender("p0", layout, src, released, on_error=lambda rid, msg: errors.append((rid, msg)), **sender_kw)
        receiver = KVReceiver("d0", layout, dst)
        closing(receiver)
        closing(sender)
        return TPPair(sender, receiver, released, errors, full, src, dst)
    return make


def assert_heads_moved(tp: TPPair, requests=REQUESTS) -> None:
    """Each decode rank holds exactly its heads of every request, and nothing outside its blocks."""
    for src_ids, dst_ids, n in requests.values():
        want = gather_tokens(tp.full, src_ids, n)
        for shard in tp.dst_shards:
            got = gather_tokens(shard.tensor, dst_ids, n)
            assert torch.equal(got, want[:, :, :, shard.head_start:shard.head_end]), f"rank {shard.rank}"
    untouched = [b for b in range(NB) if all(b not in dst for _, dst, _ in requests.values())]
    assert not any(shard.tensor[:, :, untouched].any() for shard in tp.dst_shards)


@pytest.mark.parametrize("path", ["shm", "zmq"])
@pytest.mark.parametrize("num_kv_heads,prefill_tp,decode_tp", CASES)
def test_every_decode_rank_gets_exactly_its_heads(make_tp_pair, path, num_kv_heads, prefill_tp, decode_tp):
    tp = make_tp_pair(num_kv_heads, prefill_tp, decode_tp, shm=path == "shm")
    assert tp.sender.layout.tp_size == prefill_tp
    assert [(r.head_start, r.head_end) for r in tp.sender.layout.ranks] == [
        kv_head_range(r, prefill_tp, num_kv_heads) for r in range(prefill_tp)]
    events = tp.transfer_all()
    assert kinds(events, "done") == list(REQUESTS) and not kinds(events, "failed")
    assert_heads_moved(tp)
    rank_bytes = tp.expected_rank_bytes()
    assert tp.receiver.num_bytes_by_rank == rank_bytes and tp.receiver.num_bytes_received == sum(rank_bytes)
    assert [e.num_bytes for e in events if e.kind == "done"] == [sum(tp.expected_rank_bytes({rid: r}))
                                                                 for rid, r in REQUESTS.items()]
    assert tp.receiver.num_transfers == {path: 2}
    if path == "shm":
        assert tp.sender.is_same_host("d0") and tp.sender.num_pulls_served == 0
    else:
        assert tp.sender.num_pulls_served == 2 and tp.sender.num_bytes_sent == sum(rank_bytes)
    assert tp.dones == Counter(list(REQUESTS)) and not tp.errors
    tp.released.assert_released_once(REQUESTS)


def test_bfloat16_over_both_paths(make_tp_pair):
    for shm in (True, False):
        tp = make_tp_pair(4, 2, 4, shm=shm, dtype="bfloat16")
        tp.transfer_all()
        assert_heads_moved(tp)
        assert tp.receiver.num_bytes_by_rank == tp.expected_rank_bytes()


def test_only_the_prefill_ranks_read_are_mapped(make_tp_pair):
    """1 KV head on 4 prefill ranks (replicas): the decode node maps the first replica alone."""
    tp = make_tp_pair(1, 4, 2, shm=True)
    tp.transfer_all()
    (peer,) = tp.receiver._peers.values()
    assert set(peer.links[0].handle.pools) == {0}
    assert_heads_moved(tp)


def test_a_prefill_rank_without_a_segment_sends_everything_over_zmq(make_tp_pair):
    tp = make_tp_pair(4, 2, 2, shm=True, no_shm_ranks=(1,))
    tp.transfer_all()
    assert tp.receiver.num_transfers == {"zmq": 2} and not tp.sender.is_same_host("d0")
    assert_heads_moved(tp)
    tp.released.assert_released_once(REQUESTS)


def test_a_spoiled_frame_fails_the_whole_request(make_tp_pair):
    tp = make_tp_pair(4, 1, 2, faults=EveryNthPull("corrupt"))  # the last frame (decode rank 1's) is short
    src, dst, n = REQUESTS["r1"]
    events = tp.transfer("r1", src, dst, n)
    assert kinds(events, "failed") == ["r1"] and "bad KV payload" in events[-1].error
    tp.pump(lambda _: tp.sender.num_held == 0)
    assert tp.receiver.num_bytes_by_rank == [0, 0] and not tp.receiver.num_transfers
    assert tp.dones == Counter(["r1"])
    tp.released.assert_released_once(["r1"])


def test_a_failed_copy_of_one_rank_fails_the_whole_request(make_tp_pair, monkeypatch):
    copies = []

    def second_copy_fails(*args, **kw):
        copies.append(args)
        if len(copies) == 2:
            raise RuntimeError("injected")
        return copy_tokens(*args, **kw)

    copy_tokens = transport.copy_tokens
    monkeypatch.setattr(transport, "copy_tokens", second_copy_fails)
    tp = make_tp_pair(4, 2, 2, shm=True)
    src, dst, n = REQUESTS["r1"]
    events = tp.transfer("r1", src, dst, n)
    assert kinds(events, "failed") == ["r1"] and "same-host copy failed (shm): injected" in events[-1].error
    tp.pump(lambda _: tp.sender.num_held == 0)
    assert tp.receiver.num_bytes_by_rank == [0, 0] and tp.dones == Counter(["r1"])
    tp.released.assert_released_once(["r1"])


BAD_LAYOUTS = [
    (dict(ranks=[KVRank(0, 4)], tp_size=2), "tp_size 2 but 1 rank layouts"),
    (dict(ranks=[KVRank(0, 2), KVRank(3, 4)], tp_size=2), "no rank holds KV head 2"),
    (dict(ranks=[KVRank(0, 5)], tp_size=1), "[0, 5) is empty or outside the model's 4 KV heads"),
    (dict(ranks=[KVRank(-1, 2), KVRank(2, 4)], tp_size=2), "[-1, 2) is empty or outside"),
    (dict(ranks=[KVRank(2, 2), KVRank(0, 4)], tp_size=2), "[2, 2) is empty or outside"),
    (dict(ranks=[], tp_size=0), "0 head ranges"),
]


@pytest.mark.parametrize("fields,expected", BAD_LAYOUTS, ids=[e for _, e in BAD_LAYOUTS])
def test_a_bad_tensor_parallel_layout_is_refused(make_tp_pair, closing, fields, expected):
    tp = make_tp_pair(4, 2, 2)
    stranger = make_socket(zmq.DEALER, connect=tp.receiver.kv_addr, identity=b"bad-prefill")
    closing(SimpleNamespace(close=lambda: stranger.close(0)))
    bad = layout_for(4)
    bad.ranks, bad.tp_size = fields["ranks"], fields["tp_size"]
    send_msg(stranger, Handshake("bad", bad))
    send_msg(stranger, make_ready("rX", [0], 4, BS))
    events = pump(tp.sender, tp.receiver, lambda _: stranger.poll(0), timeout_s=3)
    ack = recv_msg_within(stranger)
    assert isinstance(ack, HandshakeAck) and not ack.ok
    assert "bad tensor-parallel layout" in ack.error and expected in ack.error, ack.error
    assert not events  # its KVReady is ignored
    tp.transfer_all()  # the receiver is unharmed
    assert_heads_moved(tp)


@pytest.mark.parametrize("shards,match", [
    (lambda t: [KVShard(1, 2, 4, t[:, :, :, :, 2:].clone()), KVShard(0, 0, 2, t[:, :, :, :, :2].clone())],
     "ranks 0..N-1"),
    (lambda t: [KVShard(0, 0, 1, t[:, :, :, :, :1].clone()), KVShard(1, 2, 4, t[:, :, :, :, 2:].clone())],
     "no rank holds KV head 1"),
    (lambda t: [KVShard(0, 0, 2, t[:, :, :, :, :3].clone()), KVShard(1, 2, 4, t[:, :, :, :, 2:].clone())],
     "does not match"),
])
def test_bad_shards_are_refused_by_both_ends(shards, match):
    layout = layout_for(4)
    pool = torch.zeros(layout_shape(layout))
    with pytest.raises(ValueError, match=match):
        KVSender("p0", layout, shards(pool), ReleaseLog())
    with pytest.raises(ValueError, match=match):
        KVReceiver("d0", layout, shards(pool))


def test_sender_serves_named_head_ranges_and_refuses_bad_ones(make_tp_pair, closing):
    """A decode node (a raw ROUTER here) pulls heads [1, 3): gathered from prefill ranks 1 and 2."""
    tp = make_tp_pair(4, 4, 1)
    decode_sock = make_socket(zmq.ROUTER, bind="tcp://127.0.0.1:0")
    closing(SimpleNamespace(close=lambda: decode_sock.close(0)))
    src, _, n = REQUESTS["r1"]
    tp.sender.send("dx", endpoint(decode_sock), make_ready("r1", src, n, BS))
    identity, handshake = recv_within(decode_sock)[:2]
    assert decode(handshake).layout.tp_size == 4
    send_msg(decode_sock, HandshakeAck("dx", ok=True), identity=identity)
    assert isinstance(decode(recv_within(decode_sock)[1]), KVReady)

    def ask(*ranges) -> tuple[KVData, list]:
        send_msg(decode_sock, KVPull("r1", head_ranges=[list(r) for r in ranges]), identity=identity)
        for _ in range(100):
            tp.sender.poll(10)
            if decode_sock.poll(0):
                frames = decode_sock.recv_multipart()
                return decode(frames[1]), frames[2:]
        raise AssertionError("no answer to the pull")

    for bad in ([0, 5], [2, 2], [-1, 1]):
        data, frames = ask(bad)
        assert not data.ok and "bad KVPull" in data.error and not frames
    data, frames = ask((1, 3), (0, 1))
    assert data.ok and data.shapes == [[L, 2, n, 2, D], [L, 2, n, 1, D]] and len(frames) == 2
    want = gather_tokens(tp.full, src, n)
    assert torch.equal(frame_to_tensor(frames[0], "float32", data.shapes[0]), want[:, :, :, 1:3])
    assert torch.equal(frame_to_tensor(frames[1], "float32", data.shapes[1]), want[:, :, :, 0:1])
    send_msg(decode_sock, KVDone("r1"), identity=identity)
    tp.pump(lambda _: tp.sender.num_held == 0)
    tp.released.assert_released_once(["r1"])


def test_cover_takes_each_head_from_one_rank():
    assert cover(0, 4, [(0, 2), (2, 4)]) == [Piece(0, 0, 2), Piece(1, 2, 4)]
    assert cover(1, 3, [(0, 4)]) == [Piece(0, 1, 3)]
    assert cover(0, 1, [(0, 1), (0, 1)]) == [Piece(0, 0, 1)]  # replicas: the first
    assert cover(0, 2, [(0, 1), (0, 2)]) == [Piece(1, 0, 2)]  # the fewest pieces
    with pytest.raises(ValueError, match="no rank holds KV head 2"):
        cover(0, 4, [(0, 2), (3, 4)])
    assert ranges_error([(0, 2), (2, 4)], 4) is None and ranges_error([(1, 2)], 4, cover_all=False) is None


def test_node_kv_shards_fall_back_to_one_shard(closing):
    layout = layout_for(4)
    pool = SharedKVPool.create("tp", layout_shape(layout), torch.float32)
    closing(pool)
    engine = SimpleNamespace(runner=SimpleNamespace(kv_buffer=pool.tensor), model_config=SimpleNamespace(num_kv_heads=4))
    (shard,) = kv_shards(engine, pool)
    assert (shard.rank, shard.head_start, shard.head_end, shard.shm) == (0, 0, 4, pool)
    assert kv_shards(engine)[0].shm is None
    half = layout_shape(layout_for(2))
    engine.runner.kv_shards = [KVShard(0, 0, 2, torch.zeros(half)), KVShard(1, 2, 4, torch.zeros(half))]
    got = kv_shards(engine, pool)  # the runner's shards as they are
    assert len(got) == 2 and all(a is b for a, b in zip(got, engine.runner.kv_shards))
    engine.runner.kv_shards = [KVShard(0, 0, 4, pool.tensor)]  # a runner that did not name rank 0's segment
    assert kv_shards(engine, pool)[0].shm is pool and kv_shards(engine)[0].shm is None


def test_metrics_export_bytes_per_rank():
    from pdserve.node.metrics import NodeMetrics

    from .test_node_metrics import make_snapshot, samples, value

    metrics = NodeMetrics("d0", "decode")
    snap = {"s": make_snapshot(bytes_received_by_rank=[300, 500])}
    metrics.watch(lambda: snap["s"])
    got = samples(metrics.render())
    for rank, num_bytes in ((0, 300), (1, 500)):
        assert value(got, "pdserve_kv_bytes_received_by_rank_total", node_id="d0", role="decode",
                     rank=str(rank)) == num_bytes
    snap["s"] = make_snapshot()  # a prefill node: no such series
    assert not [k for k in samples(metrics.render()) if k[0] == "pdserve_kv_bytes_received_by_rank_total"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in gpu_check.sh)")
def test_head_slices_on_cuda_pools(closing):
    """The CUDA side of the plan: head-sliced gathers and pool-to-pool copies on the GPU equal the
    CPU ones, and a ZMQ transfer between CUDA shards of TP 2 and TP 4 moves exactly each rank's heads."""
    from pdserve.kvtransfer.payload import copy_tokens

    layout = layout_for(4)
    full = torch.randn(layout_shape(layout), generator=torch.Generator().manual_seed(3))
    src, dst_ids, n = REQUESTS["r1"][0], REQUESTS["r1"][1], REQUESTS["r1"][2]
    want = gather_tokens(full, src, n)
    assert torch.equal(gather_tokens(full.cuda(), src, n, heads=(1, 3)).cpu(), want[:, :, :, 1:3])
    dst = torch.zeros(layout_shape(layout_for(2))).cuda()
    copy_tokens(full.cuda(), src, dst, dst_ids, n, src_heads=(2, 4), dst_heads=(0, 2))
    assert torch.equal(gather_tokens(dst.cpu(), dst_ids, n), want[:, :, :, 2:4])
    src_shards = split(full.cuda(), 2, lambda shape: (torch.empty(shape, device="cuda"), None))
    dst_shards = split(torch.zeros_like(full).cuda(), 4, lambda shape: (torch.empty(shape, device="cuda"), None))
    released = ReleaseLog()
    sender = KVSender("p0", layout, src_shards, released)
    receiver = KVReceiver("d0", layout, dst_shards, enable_shm=False)
    closing(receiver)
    closing(sender)
    tp = TPPair(sender, receiver, released, [], full, src_shards, dst_shards)
    tp.transfer_all({"r1": REQUESTS["r1"]})
    for shard in dst_shards:
        assert torch.equal(gather_tokens(shard.tensor, dst_ids, n).cpu(), want[:, :, :, shard.head_start:shard.head_end])
    assert receiver.num_bytes_by_rank == tp.expected_rank_bytes({"r1": REQUESTS["r1"]})
    released.assert_released_once(["r1"])
