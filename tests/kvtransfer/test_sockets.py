import msgpack
import pytest
import zmq

from pdserve.protocol.messages import KVDone, KVPull, MessageError
from pdserve.protocol.sockets import drain, endpoint, make_socket, recv_msg, send_msg

from .conftest import recv_msg_within, send_within


@pytest.fixture
def router_dealer():
    router = make_socket(zmq.ROUTER, bind="tcp://127.0.0.1:0")
    addr = endpoint(router)
    dealer = make_socket(zmq.DEALER, connect=addr, identity=b"d1")
    yield router, dealer
    dealer.close(0)
    router.close(0)


def test_bind_reports_real_port(router_dealer):
    router, _ = router_dealer
    addr = endpoint(router)
    assert addr.startswith("tcp://127.0.0.1:") and not addr.endswith(":0")


def test_round_trip_with_frames(router_dealer):
    router, dealer = router_dealer
    send_msg(dealer, KVPull("r1"), b"payload", memoryview(b"xyz"))
    assert router.poll(2000)
    identity, msg, frames = recv_msg(router, zmq.NOBLOCK)
    assert identity == b"d1" and msg == KVPull("r1") and [bytes(f) for f in frames] == [b"payload", b"xyz"]
    send_msg(router, KVDone("r1"), identity=b"d1")
    assert dealer.poll(2000)
    assert recv_msg(dealer, zmq.NOBLOCK) == (None, KVDone("r1"), [])


def test_garbage_raises_message_error_and_drain_goes_on(router_dealer):
    router, dealer = router_dealer
    garbage = [b"\xc1\xff", msgpack.packb({"type": "kv_pull", "version": 1}), msgpack.packb([1, 2]),
               msgpack.packb({"type": "nope", "version": 1})]
    for g in garbage:
        assert send_within(dealer, g)
    send_msg(dealer, KVPull("ok"))
    with pytest.raises(MessageError):
        recv_msg_within(router)
    got = []
    for _ in range(50):  # the rest may still be in flight
        got.extend(m for _, m, _ in drain(router))
        if any(isinstance(m, KVPull) for m in got):
            break
        router.poll(100)
    assert sum(isinstance(m, MessageError) for m in got) == len(garbage) - 1
    assert got[-1] == KVPull("ok")


def test_unknown_router_peer_raises(router_dealer):
    router, _ = router_dealer
    with pytest.raises(zmq.ZMQError):
        send_msg(router, KVDone("x"), identity=b"nobody")


def test_handshake_with_probe_token_round_trips():
    from pdserve.protocol.messages import Handshake, KVLayout, KVRank, decode
    layout = KVLayout(model="m", dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                      num_blocks=100, ranks=[KVRank(0, 3, shm_name="pdserve-x-1-2-ab", probe_token="00ff" * 8)])
    assert decode(Handshake("p0", layout).encode()) == Handshake("p0", layout)
