"""The transport interface as the receiver uses it: which transport moves a request (the first
whose probe accepts the peer, in list order), the fallback to ZMQ past the peer's lease, counts
and bytes per transport name, and a new backend added as one class plus one list entry."""

import pytest

from pdserve.kvcache.shard import KVShard
from pdserve.kvtransfer import cuda_ipc
from pdserve.kvtransfer.layout import bytes_per_token
from pdserve.kvtransfer.payload import gather_tokens
from pdserve.kvtransfer.receiver import SHM_LEASE_MARGIN_S, TRANSPORTS, KVEventKind
from pdserve.kvtransfer.shm import SharedMemoryTransport
from pdserve.kvtransfer.transport import KVTransport, Outcome, PeerPoolCopy
from pdserve.kvtransfer.zmq_pull import ZmqPullTransport

from .conftest import FakeClock, kinds, make_layout, make_pool, same_bytes


class Loopback(PeerPoolCopy):
    """A stand-in for a new backend (RDMA, say) that reads the peer's pool but proves nothing
    about the host: here the "remote" pool is a tensor the test hands it."""

    name = "loopback"
    same_host = False
    pool = None

    def open_rank(self, peer_layout, rank):
        return type(self).pool


class Refuses(KVTransport):
    name, reads_peer_pool, same_host = "refuses", False, False

    def open(self, peer_layout, send):
        return None

    def start(self, handle, ready, dst_block_ids, first_block=0):
        raise AssertionError("never opened, never started")


def moved(pair, src_ids, dst_ids, num_tokens) -> bool:
    return same_bytes(gather_tokens(pair.dst, dst_ids, num_tokens), gather_tokens(pair.src, src_ids, num_tokens))


def test_event_kinds_are_a_str_enum(make_pair):
    assert KVEventKind.READY == "ready" and KVEventKind("failed") is KVEventKind.FAILED
    pair = make_pair()
    events = pair.transfer("r1", [0, 1], [2, 3], 20)
    assert [e.kind for e in events] == [KVEventKind.READY, KVEventKind.DONE]
    assert all(isinstance(e.kind, KVEventKind) for e in events)


def test_default_order_and_names():
    assert TRANSPORTS == (SharedMemoryTransport, cuda_ipc.CudaIpcTransport, ZmqPullTransport)
    assert [t.name for t in TRANSPORTS] == ["shm", "cuda_ipc", "zmq"]
    assert not TRANSPORTS[-1].reads_peer_pool, "the last transport must be safe past the lease"


@pytest.mark.parametrize("shm", [False, True])
def test_counts_and_bytes_per_transport(make_pair, shm):
    pair = make_pair(shm=shm, src_bs=16, dst_bs=8)
    assert kinds(pair.transfer("r1", [3, 4], [0, 5, 7], 20), "done") == ["r1"]
    assert moved(pair, [3, 4], [0, 5, 7], 20)
    name = "shm" if shm else "zmq"
    nbytes = 20 * bytes_per_token(pair.receiver.layout)
    assert pair.receiver.num_transfers == {name: 1} and pair.receiver.num_bytes == {name: nbytes}
    assert pair.receiver.num_bytes_received == nbytes
    assert (pair.receiver.num_shm_copies, pair.receiver.num_zmq_pulls) == ((1, 0) if shm else (0, 1))
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1"])


def test_shm_disabled_pulls_over_zmq(make_pair):
    pair = make_pair(shm=True, enable_shm=False)
    assert [t.name for t in pair.receiver.transports] == ["zmq"]
    pair.transfer("r1", [1], [2], 10)
    assert pair.receiver.num_transfers == {"zmq": 1} and not pair.sender.is_same_host("d0")


def test_a_new_backend_is_one_list_entry(make_pair, monkeypatch):
    clock = FakeClock()
    pair = make_pair(clock=clock, transports=(Refuses, Loopback, ZmqPullTransport))
    monkeypatch.setattr(Loopback, "pool", pair.src)
    assert kinds(pair.transfer("r1", [5, 6], [1, 2], 30), "done") == ["r1"]
    assert moved(pair, [5, 6], [1, 2], 30)
    assert pair.receiver.num_transfers == {"loopback": 1} and pair.sender.num_pulls_served == 0
    assert not pair.sender.is_same_host("d0")  # this backend proves nothing about the host
    # close to the peer's lease: the backend reads the peer's pool, so the receiver pulls over ZMQ
    pair.send("r2", [7], 10, lease_s=10.0)
    pair.pump(lambda ev: "r2" in kinds(ev, "ready"))
    clock.advance(10.0 - SHM_LEASE_MARGIN_S)
    pair.receiver.pull("r2", [9])
    assert kinds(pair.pump(lambda ev: "r2" in kinds(ev, "done")), "done") == ["r2"]
    assert pair.receiver.num_transfers == {"loopback": 1, "zmq": 1} and pair.sender.num_pulls_served == 1
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1", "r2"])


def test_no_transport_reaches_the_peer(make_pair):
    pair = make_pair(transports=(Refuses,))
    pair.send("r1", [0], 8)
    pair.pump(lambda ev: "r1" in kinds(ev, "ready"))
    pair.receiver.pull("r1", [1])
    events = pair.pump(lambda ev: "r1" in kinds(ev, "failed"))
    assert "no transport reaches" in events[-1].error
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1"])


def test_a_failed_copy_fails_the_request(make_pair, monkeypatch):
    pair = make_pair(transports=(Loopback, ZmqPullTransport))
    monkeypatch.setattr(Loopback, "pool", make_pool(make_layout(num_layers=3)))  # not a pool we can copy from
    pair.send("r1", [0], 8)
    pair.pump(lambda ev: "r1" in kinds(ev, "ready"))
    pair.receiver.pull("r1", [1])
    events = pair.pump(lambda ev: "r1" in kinds(ev, "failed"))
    assert "same-host copy failed (loopback)" in events[-1].error and not pair.receiver.num_transfers
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1"])


def test_outcomes():
    assert Outcome.done(5).num_bytes == 5 and Outcome.failed("x").error == "x"
    assert Outcome.pending().state.value == "pending"


def test_cuda_ipc_advertises_nothing_for_a_cpu_pool():
    layout = make_layout()
    entry = layout.ranks[0]
    assert cuda_ipc.advertise(entry, KVShard(0, 0, 2, make_pool(layout))) is entry
