"""Sender and receiver end to end in one process over tcp loopback: the happy paths (ZMQ and
shared memory), refused handshakes, and garbage on both sockets."""

import os
from types import SimpleNamespace

import msgpack
import pytest
import torch
import zmq

from pdserve.kvtransfer.payload import gather_tokens
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.protocol.messages import Handshake, HandshakeAck, KVData, KVReady
from pdserve.protocol.sockets import make_socket, send_msg

from .conftest import (
    TEST_DTYPES,
    ReleaseLog,
    kinds,
    make_layout,
    make_pool,
    make_ready,
    pump,
    recv_msg_within,
    same_bytes,
    send_within,
)

PAIRS = [(16, 16), (16, 8), (8, 32), (4, 16)]


def assert_moved(pair, src_ids, dst_ids, num_tokens):
    assert same_bytes(gather_tokens(pair.dst, dst_ids, num_tokens), gather_tokens(pair.src, src_ids, num_tokens))


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize("src_bs,dst_bs", PAIRS)
def test_zmq_transfer(make_pair, dtype, src_bs, dst_bs):
    pair = make_pair(src_bs=src_bs, dst_bs=dst_bs, dtype=dtype)
    requests = {"r1": ([5, 2, 9, 14, 0, 11, 3, 7, 12, 1][: -(-37 // src_bs)], [3, 1, 6, 8, 10][: -(-37 // dst_bs)]),
                "r2": ([13, 4], [12, 15])}
    for rid, (src_ids, dst_ids) in requests.items():
        num_tokens = 37 if rid == "r1" else min(src_bs, dst_bs) + 1
        events = pair.transfer(rid, src_ids, dst_ids, num_tokens)
        assert kinds(events, "done") == [rid] and not kinds(events, "failed")
        assert events[0].ready.first_token == 7 and events[0].ready.num_tokens == num_tokens
        assert_moved(pair, src_ids, dst_ids, num_tokens)
    pair.pump(lambda _: pair.sender.num_held == 0)
    assert pair.receiver.num_zmq_pulls == 2 and pair.receiver.num_shm_copies == 0
    assert not pair.sender.is_same_host("d0") and not pair.errors
    pair.released.assert_released_once(requests)


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize("src_bs,dst_bs", [(16, 8), (4, 16)])
def test_shm_transfer(make_pair, dtype, src_bs, dst_bs):
    pair = make_pair(src_bs=src_bs, dst_bs=dst_bs, dtype=dtype, shm=True)
    src_ids, dst_ids = [9, 3, 12, 5, 1, 0, 7, 2, 15, 6][: -(-37 // src_bs)], [4, 11, 2, 8, 0][: -(-37 // dst_bs)]
    events = pair.transfer("r1", src_ids, dst_ids, 37)
    assert kinds(events, "done") == ["r1"]
    assert_moved(pair, src_ids, dst_ids, 37)
    pair.pump(lambda _: pair.sender.num_held == 0)
    assert pair.receiver.num_shm_copies == 1 and pair.receiver.num_zmq_pulls == 0
    assert pair.sender.is_same_host("d0") and pair.sender.num_pulls_served == 0
    pair.released.assert_released_once(["r1"])


@pytest.mark.parametrize("shm", [False, True])
def test_a_pull_from_a_first_block_moves_only_the_rest(make_pair, shm):
    """The decode node's cache holds the first blocks: only the tokens after them move, into the
    blocks after them; the cached blocks are left as they were."""
    pair = make_pair(shm=shm)
    src_ids, dst_ids = [9, 3, 12], [4, 11, 2]
    before = pair.dst.clone()
    pair.send("r1", src_ids, 37)
    pair.pump(lambda ev: "r1" in kinds(ev, "ready"))
    with pytest.raises(ValueError, match="past the request"):
        pair.receiver.pull("r1", dst_ids, first_block=3)
    pair.receiver.pull("r1", dst_ids, first_block=2)
    events = pair.pump(lambda ev: "r1" in kinds(ev, "done") + kinds(ev, "failed"))
    assert kinds(events, "done") == ["r1"] and events[-1].num_bytes == 5 * 2 * 2 * 2 * 16 * 4  # 5 tokens
    assert same_bytes(gather_tokens(pair.dst, [2], 5), gather_tokens(pair.src, [12], 5))
    assert same_bytes(pair.dst[:, :, [4, 11]], before[:, :, [4, 11]])  # untouched
    assert pair.receiver.num_bytes_received == events[-1].num_bytes
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1"])


def test_probe_rejects_a_fake_segment(closing, shm_pool_factory):
    """The sender names a real segment but the wrong token: the receiver must not trust it."""
    layout = make_layout()
    pool = shm_pool_factory(layout)
    released = ReleaseLog()
    impostor = SimpleNamespace(name=pool.name, probe_token=os.urandom(16).hex(), tensor=pool.tensor)
    sender = KVSender("p0", layout, pool.tensor, released, shm_pool=impostor)
    assert sender.layout.ranks[0].shm_name == pool.name
    receiver = KVReceiver("d0", layout, make_pool(layout, seed=None))
    closing(receiver)
    closing(sender)
    sender.send("d0", receiver.kv_addr, make_ready("r1", [3, 4], 20, 16))
    pump(sender, receiver, lambda ev: "r1" in kinds(ev, "ready"))
    receiver.pull("r1", [0, 1])
    pump(sender, receiver, lambda ev: "r1" in kinds(ev, "done"))
    assert receiver.num_shm_copies == 0 and receiver.num_zmq_pulls == 1 and not sender.is_same_host("d0")
    assert same_bytes(gather_tokens(receiver.kv_buffer, [0, 1], 20), gather_tokens(pool.tensor, [3, 4], 20))
    pump(sender, receiver, lambda _: sender.num_held == 0)
    released.assert_released_once(["r1"])


@pytest.mark.parametrize("field,value,expected", [("num_layers", 3, "num_layers differs"),
                                                  ("dtype", "bfloat16", "dtype differs"),
                                                  ("model", "other-model", "model differs")])
def test_incompatible_peer_is_refused(make_pair, field, value, expected):
    pair = make_pair(sender_layout={field: value})
    pair.send("r1", [0], 10)
    pair.send("r2", [1, 2], 20)
    events = pair.pump(lambda _: len(pair.errors) == 2)
    assert not events, "a refused peer's KVReady must be ignored"
    assert {rid for rid, _ in pair.errors} == {"r1", "r2"}
    assert all(expected in msg and "refused" in msg for _, msg in pair.errors)
    assert pair.sender.num_held == 0
    pair.released.assert_released_once(["r1", "r2"])
    pair.send("r3", [3], 5)  # a later send re-handshakes on a fresh connection, refused again
    pair.pump(lambda _: len(pair.errors) == 3)
    pair.released.assert_released_once(["r1", "r2", "r3"])


GARBAGE = [b"", b"\xc1", b"\x00" * 64, msgpack.packb([1, 2, 3]), msgpack.packb({"type": "kv_data", "version": 1}),
           msgpack.packb({"type": "kv_pull", "version": 99, "request_id": "r1"}),
           msgpack.packb({"type": "handshake", "version": 1, "node_id": 5, "layout": {}})]


def test_garbage_on_both_sockets_is_dropped(make_pair):
    pair = make_pair(src_bs=8, dst_bs=16)
    pair.transfer("r1", [1, 2], [0], 12)
    # garbage into the receiver from a stranger, including well-formed but unexpected messages
    stranger = make_socket(zmq.DEALER, connect=pair.receiver.kv_addr, identity=b"stranger")
    for g in GARBAGE:
        assert send_within(stranger, g)
    assert send_within(stranger, b"\x92", b"junk frame")
    send_msg(stranger, KVData("r1", ok=True, dtype="float32", shapes=[[1]]), b"\x00" * 4)
    send_msg(stranger, make_ready("rX", [0], 4, 16))  # no handshake: refused, no event
    # garbage into the sender, through the receiver's ROUTER (the sender's identity is its peer key)
    (sender_identity,) = list(pair.receiver._peers)
    for g in GARBAGE[1:] + [Handshake("x", make_layout()).encode()]:
        assert send_within(pair.receiver.sock, sender_identity, g)
    events = pair.transfer("r2", [5, 6, 7], [3, 4], 20)
    assert kinds(events, "ready") == ["r2"] and kinds(events, "done") == ["r2"]
    assert_moved(pair, [5, 6, 7], [3, 4], 20)
    ack = recv_msg_within(stranger)
    assert isinstance(ack, HandshakeAck) and not ack.ok and "handshake" in ack.error
    stranger.close(0)
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1", "r2"])


def test_oversized_frame_disconnects_only_that_peer(make_pair):
    pair = make_pair(max_frame_bytes=64 << 10)
    stranger = make_socket(zmq.DEALER, connect=pair.receiver.kv_addr)
    assert send_within(stranger, KVReady.__name__.encode(), b"\x00" * (1 << 20))
    events = pair.transfer("r1", [0, 1], [2, 3], 30)  # 30 tokens: 15 KiB, under the bound
    assert kinds(events, "done") == ["r1"]
    stranger.close(0)
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1"])


def test_sender_close_releases_everything(make_pair):
    pair = make_pair()
    for i in range(3):
        pair.send(f"r{i}", [i], 4)
    pair.pump(lambda ev: len(kinds(ev, "ready")) == 3)
    pair.sender.close()
    assert pair.sender.num_held == 0
    pair.released.assert_released_once(["r0", "r1", "r2"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (checks ZMQ between GPU pools; CUDA IPC: test_cuda_ipc.py)")
def test_zmq_transfer_between_cuda_pools(closing):
    src_layout, dst_layout = make_layout(block_size=16, dtype="bfloat16"), make_layout(block_size=8, dtype="bfloat16")
    src = make_pool(src_layout).cuda()
    released = ReleaseLog()
    sender = KVSender("p0", src_layout, src, released)
    receiver = KVReceiver("d0", dst_layout, make_pool(dst_layout, seed=None).cuda())
    closing(receiver)
    closing(sender)
    sender.send("d0", receiver.kv_addr, make_ready("r1", [7, 2, 11], 40, 16))
    pump(sender, receiver, lambda ev: "r1" in kinds(ev, "ready"))
    receiver.pull("r1", [9, 0, 4, 13, 6])
    pump(sender, receiver, lambda ev: "r1" in kinds(ev, "done"))
    got = gather_tokens(receiver.kv_buffer, [9, 0, 4, 13, 6], 40).cpu()
    assert same_bytes(got, gather_tokens(src, [7, 2, 11], 40).cpu())
    pump(sender, receiver, lambda _: sender.num_held == 0)
    released.assert_released_once(["r1"])
